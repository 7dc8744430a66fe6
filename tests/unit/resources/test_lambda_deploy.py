"""The AWS deployment of the reward functions: the SAM template, its loader, and the zip build.

Builds run on a tree of fake files under tmp_path, so they depend neither on the handler code
being complete nor on the network.
"""

from __future__ import annotations

import os
import re
import zipfile
from pathlib import Path

import pytest
import yaml

from resources import lambda_build
from resources.lambda_build import (
    DEFAULT_OUT,
    PROJECT_ROOT,
    RULE_DIR_NAME,
    RULE_FUNCTION_FILES,
    RULE_ZIP_NAME,
    ArtefactTooLargeError,
    build_rule_function,
    main,
    pip_install_command,
)
from resources.lambda_template import (
    DEFAULT_TEMPLATE,
    check_template_functions,
    function_specs,
    load_sam_template,
    parse_sam_template,
)

HANDLER = "resources.lambda_handler.lambda_handler"


@pytest.fixture(scope="module")
def template():
    return load_sam_template(DEFAULT_TEMPLATE)


def _fake_tree(root: Path, files=RULE_FUNCTION_FILES) -> Path:
    for rel in files:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f'"""{rel}"""\nVALUE = {len(rel)}\n')
    return root


# --- the template and its loader ----------------------------------------------------------------


def test_short_tags_become_long_form_and_plain_safe_load_is_untouched():
    text = """
a: !Ref Param
b: !Sub arn:${AWS::Region}:x
c: !Sub ["${X}-y", {X: !Ref Other}]
d: !GetAtt Fn.Arn
e: !Join [",", [!Ref A, !GetAtt [B, Arn]]]
f: !Transform {Name: AWS::Include, Parameters: {Location: s3://b/k}}
g: !Condition IsProd
h: !Select [0, !GetAZs ""]
"""
    data = parse_sam_template(text)
    assert data["a"] == {"Ref": "Param"}
    assert data["b"] == {"Fn::Sub": "arn:${AWS::Region}:x"}
    assert data["c"] == {"Fn::Sub": ["${X}-y", {"X": {"Ref": "Other"}}]}
    assert data["d"] == {"Fn::GetAtt": ["Fn", "Arn"]}
    assert data["e"] == {"Fn::Join": [",", [{"Ref": "A"}, {"Fn::GetAtt": ["B", "Arn"]}]]}
    assert data["f"] == {"Fn::Transform": {"Name": "AWS::Include",
                                           "Parameters": {"Location": "s3://b/k"}}}
    assert data["g"] == {"Condition": "IsProd"}
    assert data["h"] == {"Fn::Select": [0, {"Fn::GetAZs": ""}]}
    # The constructors live on the private loader only.
    with pytest.raises(yaml.constructor.ConstructorError):
        yaml.safe_load("a: !Ref Param")


def test_template_parses_with_its_tags(template):
    assert template["Transform"] == "AWS::Serverless-2016-10-31"
    globals_fn = template["Globals"]["Function"]
    assert globals_fn["Runtime"] == "python3.12"
    assert globals_fn["Architectures"] == ["x86_64"]
    assert globals_fn["Tracing"] == "Active"
    assert globals_fn["Environment"]["Variables"] == {
        "POWERTOOLS_SERVICE_NAME": "rollarc-reward",
        "POWERTOOLS_METRICS_NAMESPACE": "RollArc",
        "POWERTOOLS_LOG_LEVEL": "INFO",
    }
    params = template["Parameters"]
    assert params["ReservedConcurrency"]["Default"] == 64
    assert params["ModelReservedConcurrency"]["Default"] == 16
    assert "PowertoolsLayerVersion" in params

    rule = template["Resources"]["RuleRewardFunction"]["Properties"]
    assert rule["ReservedConcurrentExecutions"] == {"Ref": "ReservedConcurrency"}
    assert rule["Layers"] == [{"Fn::Sub": (
        "arn:aws:lambda:${AWS::Region}:017000801446:layer:"
        "AWSLambdaPowertoolsPythonV3-python312-x86_64:${PowertoolsLayerVersion}")}]
    model = template["Resources"]["ModelRewardFunction"]
    assert model["Properties"]["ReservedConcurrentExecutions"] == {
        "Ref": "ModelReservedConcurrency"}
    assert model["Metadata"]["DockerContext"] == "../.."
    pinn = template["Resources"]["PinnRewardFunction"]
    assert pinn["Properties"]["ReservedConcurrentExecutions"] == {
        "Ref": "PinnReservedConcurrency"}

    outputs = template["Outputs"]
    assert outputs["RuleRewardFunctionName"]["Value"] == {"Ref": "RuleRewardFunction"}
    assert outputs["RuleRewardFunctionArn"]["Value"] == {
        "Fn::GetAtt": ["RuleRewardFunction", "Arn"]}
    assert outputs["ModelRewardFunctionArn"]["Value"] == {
        "Fn::GetAtt": ["ModelRewardFunction", "Arn"]}


def test_template_paths_point_at_the_build_output_and_the_project_root(template):
    here = DEFAULT_TEMPLATE.resolve().parent
    rule = template["Resources"]["RuleRewardFunction"]["Properties"]
    assert (here / rule["CodeUri"]).resolve() == (DEFAULT_OUT / RULE_DIR_NAME).resolve()
    for function in ("ModelRewardFunction", "PinnRewardFunction"):
        meta = template["Resources"][function]["Metadata"]
        context = (here / meta["DockerContext"]).resolve()
        assert context == PROJECT_ROOT
        assert (context / meta["Dockerfile"]).is_file()


def test_function_specs_merge_globals(template):
    specs = function_specs(template)
    assert set(specs) == {"rollarc-reward", "rollarc-reward-model", "rollarc-reward-pinn"}

    rule = specs["rollarc-reward"]
    assert rule["handler"] == HANDLER
    assert rule["runtime"] == "python3.12"
    assert rule["timeout_s"] == 60.0
    assert rule["memory_mb"] == 1024
    assert rule["package_type"] == "Zip"
    assert rule["logical_id"] == "RuleRewardFunction"
    assert rule["environment"] == {
        "POWERTOOLS_SERVICE_NAME": "rollarc-reward",
        "POWERTOOLS_METRICS_NAMESPACE": "RollArc",
        "POWERTOOLS_LOG_LEVEL": "INFO",
        "ROLLARC_REWARD_MODULES": "tasks.rewards",
    }

    model = specs["rollarc-reward-model"]
    assert model["handler"] == HANDLER
    assert model["timeout_s"] == 120.0
    assert model["memory_mb"] == 3008
    assert model["package_type"] == "Image"
    assert model["logical_id"] == "ModelRewardFunction"
    # SAM refuses Runtime on an image function: the template opts it out of the global one, and
    # the image's base is Python 3.12 (checked against the Dockerfile below).
    assert model["runtime"] is None
    assert model["environment"] == {
        "POWERTOOLS_SERVICE_NAME": "rollarc-reward",
        "POWERTOOLS_METRICS_NAMESPACE": "RollArc",
        "POWERTOOLS_LOG_LEVEL": "INFO",
        "ROLLARC_REWARD_MODULES": "tasks.rewards,tasks.reward_models",
        "ROLLARC_PRELOAD_REWARD_MODEL": "1",
        "HF_HUB_OFFLINE": "1",
    }
    pinn = specs["rollarc-reward-pinn"]
    assert (pinn["package_type"], pinn["runtime"], pinn["timeout_s"]) == ("Image", None, 120.0)
    assert pinn["environment"]["ROLLARC_REWARD_MODULES"] == "tasks.rewards,tasks.hc_pinn.verify"
    assert all(isinstance(v, str) for s in specs.values() for v in s["environment"].values())


def test_function_specs_defaults_overrides_and_parameter_refs():
    template = parse_sam_template("""
Parameters:
  T: {Type: Number, Default: 7}
Globals:
  Function:
    Runtime: python3.12
    Timeout: 30
    MemorySize: 256
    Environment: {Variables: {A: "1", B: "2"}}
Resources:
  Plain:
    Type: AWS::Serverless::Function
    Properties: {Handler: m.h, Environment: {Variables: {B: "3", FLAG: true}}}
  Tuned:
    Type: AWS::Serverless::Function
    IgnoreGlobals: "*"
    Properties: {FunctionName: tuned, Handler: m.g, Timeout: !Ref T}
  Table:
    Type: AWS::DynamoDB::Table
""")
    specs = function_specs(template)
    assert set(specs) == {"Plain", "tuned"}  # logical id when FunctionName is absent
    assert specs["Plain"]["timeout_s"] == 30.0
    assert specs["Plain"]["memory_mb"] == 256
    assert specs["Plain"]["runtime"] == "python3.12"
    assert specs["Plain"]["environment"] == {"A": "1", "B": "3", "FLAG": "true"}
    assert specs["tuned"]["timeout_s"] == 7.0
    assert specs["tuned"]["memory_mb"] == 128  # Lambda's default, Globals ignored
    assert specs["tuned"]["environment"] == {}
    assert specs["tuned"]["runtime"] is None


@pytest.mark.parametrize(("function", "extra"), [
    ("ModelRewardFunction", ("tasks/reward_models.py",)),
    ("PinnRewardFunction", ("tasks/hc_pinn/verify.py", "tasks/hc_pinn/training.py",
                            "tasks/hc_pinn/ntk.py", "tasks/hc_pinn/problems.py",
                            "tasks/hc_pinn/boundary.py")),
])
def test_dockerfile_matches_the_template(template, function, extra):
    resource = template["Resources"][function]
    dockerfile = (PROJECT_ROOT / resource["Metadata"]["Dockerfile"]).read_text()
    assert "FROM public.ecr.aws/lambda/python:3.12" in dockerfile
    assert "--index-url https://download.pytorch.org/whl/cpu" in dockerfile
    assert f'CMD ["{HANDLER}"]' in dockerfile
    assert resource["Properties"]["ImageConfig"]["Command"] == [HANDLER]
    # the image holds what the zip holds, plus its own rewards: each file named, or its
    # directory copied whole
    copied_dirs = re.findall(r"COPY (tasks/[\w/]+/) ", dockerfile)
    for rel in (*RULE_FUNCTION_FILES, *extra):
        assert rel in dockerfile or any(rel.startswith(d) for d in copied_dirs), rel
    assert "COPY tasks/envs/ " in dockerfile


def test_check_template_functions_names_the_config_key(tmp_path):
    check_template_functions(DEFAULT_TEMPLATE, ["rollarc-reward", "rollarc-reward-model"], 130)
    check_template_functions(None, ["rollarc-reward"], 61)  # None: the project's template
    with pytest.raises(ValueError, match=r"^reward\.lambda_function / env_tasks\.\*\."
                                         r"lambda_function: 'nope' is not a function of"):
        check_template_functions(DEFAULT_TEMPLATE, ["rollarc-reward", "nope"], 130)
    # rollarc-reward-model's timeout is 120 s: a read timeout of 120 would re-send its calls
    with pytest.raises(ValueError, match=r"^reward\.read_timeout_s \(120\.0\) must exceed the "
                                         r"timeout of rollarc-reward-model \(120\.0 s\)"):
        check_template_functions(DEFAULT_TEMPLATE, ["rollarc-reward-model"], 120.0)
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ValueError, match=r"^reward\.emulator\.template: cannot read .*missing"):
        check_template_functions(missing, ["rollarc-reward"], 130)
    broken = tmp_path / "broken.yaml"
    broken.write_text("Resources:\n  F: {Type: AWS::Serverless::Function, Properties: {}}\n")
    with pytest.raises(ValueError, match=r"^reward\.emulator\.template: cannot read .*Handler"):
        check_template_functions(broken, ["F"], 130)


# --- the build ----------------------------------------------------------------------------------


def test_rule_function_files_are_relative_package_paths():
    assert len(set(RULE_FUNCTION_FILES)) == len(RULE_FUNCTION_FILES)
    for rel in RULE_FUNCTION_FILES:
        assert not Path(rel).is_absolute() and rel.endswith(".py")
        assert rel.startswith(("tasks/", "resources/")), rel
    # the handler's module ships with its package, and nothing else of resources/ (boto3, dask)
    assert {r for r in RULE_FUNCTION_FILES if r.startswith("resources/")} == {
        "resources/__init__.py", "resources/lambda_handler.py"}


def test_build_is_deterministic_and_holds_exactly_the_files(tmp_path):
    root = _fake_tree(tmp_path / "src")
    first = build_rule_function(tmp_path / "out1", root=root)
    # Newer mtimes and a rebuild over the old output must not change a byte.
    for rel in RULE_FUNCTION_FILES:
        os.utime(root / rel, (2_000_000_000, 2_000_000_000))
    second = build_rule_function(tmp_path / "out2", root=root)
    again = build_rule_function(tmp_path / "out1", root=root)

    assert first.zip_path == tmp_path / "out1" / RULE_ZIP_NAME
    assert first.directory == tmp_path / "out1" / RULE_DIR_NAME
    data = first.zip_path.read_bytes()
    assert data == second.zip_path.read_bytes() == again.zip_path.read_bytes()
    assert first.zip_bytes == len(data)

    with zipfile.ZipFile(first.zip_path) as zf:
        names = zf.namelist()
        assert names == sorted(RULE_FUNCTION_FILES)
        for rel in RULE_FUNCTION_FILES:
            assert zf.read(rel) == (root / rel).read_bytes()
        assert {info.date_time for info in zf.infolist()} == {(1980, 1, 1, 0, 0, 0)}
    on_disk = sorted(p.relative_to(first.directory).as_posix()
                     for p in first.directory.rglob("*") if p.is_file())
    assert on_disk == sorted(RULE_FUNCTION_FILES)
    assert first.directory_bytes == sum((root / rel).stat().st_size for rel in RULE_FUNCTION_FILES)


def test_rebuild_drops_files_left_in_the_output(tmp_path):
    root = _fake_tree(tmp_path / "src", ["tasks/a.py", "tasks/b.py"])
    build_rule_function(tmp_path / "out", root=root, files=["tasks/a.py", "tasks/b.py"])
    result = build_rule_function(tmp_path / "out", root=root, files=["tasks/a.py"])
    with zipfile.ZipFile(result.zip_path) as zf:
        assert zf.namelist() == ["tasks/a.py"]
    assert not (result.directory / "tasks/b.py").exists()


def test_missing_source_file_is_named(tmp_path):
    files = ["tasks/__init__.py", "tasks/not_written_yet.py"]
    root = _fake_tree(tmp_path / "src", files[:1])
    with pytest.raises(FileNotFoundError, match="tasks/not_written_yet.py"):
        build_rule_function(tmp_path / "out", root=root, files=files)
    assert not (tmp_path / "out").exists()  # checked before anything is written


def test_zip_over_its_limit_fails_clearly(tmp_path):
    root = _fake_tree(tmp_path / "src")
    with pytest.raises(ArtefactTooLargeError, match=r"over the 10 byte limit for a zip uploaded"):
        build_rule_function(tmp_path / "out", root=root, zip_limit_bytes=10)
    assert not (tmp_path / "out" / RULE_ZIP_NAME).exists()


def test_directory_over_its_limit_fails_clearly(tmp_path):
    root = _fake_tree(tmp_path / "src")
    with pytest.raises(ArtefactTooLargeError, match=r"over the 10 byte limit for a function's "
                                                     r"unzipped code"):
        build_rule_function(tmp_path / "out", root=root, unzipped_limit_bytes=10)


def test_with_deps_targets_lambdas_platform(tmp_path):
    command = pip_install_command(tmp_path)
    joined = " ".join(command)
    assert f"--target {tmp_path}" in joined
    for flag in ("--platform manylinux2014_x86_64", "--python-version 3.12",
                 "--only-binary=:all:", "--implementation cp"):
        assert flag in joined
    assert any(c.startswith("aws-lambda-powertools[parser]") for c in command)
    assert any(c.startswith("pydantic") for c in command)


def test_main_builds_and_prints_sizes_and_next_steps(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(lambda_build, "PROJECT_ROOT", _fake_tree(tmp_path / "src"))
    assert main(["--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "function zip:" in printed and "bytes" in printed
    assert "docker build -f resources/lambda/Dockerfile.model -t rollarc-reward-model ." in printed
    assert "docker build -f resources/lambda/Dockerfile.pinn -t rollarc-reward-pinn ." in printed
    assert "sam deploy --guided --template-file resources/lambda/template.yaml" in printed
    assert (tmp_path / "out" / RULE_ZIP_NAME).is_file()


def test_main_reports_a_missing_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(lambda_build, "PROJECT_ROOT", _fake_tree(tmp_path / "src"))
    monkeypatch.setattr(lambda_build, "RULE_FUNCTION_FILES",
                        (*RULE_FUNCTION_FILES, "tasks/not_written_yet.py"))
    assert main(["--out", str(tmp_path / "out")]) == 1
    assert "tasks/not_written_yet.py" in capsys.readouterr().err


def test_built_rule_function_runs_from_its_own_directory_without_torch(tmp_path):
    """The real build: the zip's code answers an event on its own (powertools and pydantic
    standing in for the layer), importing neither torch nor numpy nor gymnasium."""
    import json as _json
    import subprocess
    import sys

    from resources.lambda_build import build_rule_function

    result = build_rule_function(tmp_path / "out")
    event = {"schema_version": 1, "items": [{
        "id": "0", "idempotency_key": "k0", "reward_fn": "tasks.rewards.frozenlake_verifier",
        "env_name": "frozenlake", "env_rewards": [0, 0, 0, 0, 0, 1],
        "responses": ["down", "down", "right", "right", "down", "right"],
        "info": {"map": ["SFFF", "FHFH", "FFFH", "HFFG"], "success": True,
                 "format_penalty": 0.1}}]}
    code = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(result.directory)!r})\n"
        "import resources.lambda_handler as h\n"
        "import tasks.reward_service as core\n"
        "for m in (h, core): assert m.__file__.startswith(sys.path[0]), m.__file__\n"
        "class C: function_name='f'; memory_limit_in_mb=128; aws_request_id='r'\n"
        "C.invoked_function_arn='arn:aws:lambda:us-east-1:0:function:f'\n"
        f"out = h.lambda_handler(json.loads({_json.dumps(event)!r}), C())\n"
        "heavy = [m for m in ('torch', 'numpy', 'gymnasium') if m in sys.modules]\n"
        "sys.stderr.write(json.dumps({'out': out, 'heavy': heavy}))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60, env={"PATH": "/usr/bin:/bin",
                                                          "ROLLARC_REWARD_MODULES": "tasks.rewards"})
    assert proc.returncode == 0, proc.stderr
    report = _json.loads(proc.stderr.strip().splitlines()[-1])
    assert report["heavy"] == []
    assert report["out"]["results"][0]["score"] == 1.0
