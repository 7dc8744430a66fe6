"""Every YAML under config/ loads and every _component_ resolves; bad config names the key."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest

from flows.config import ConfigError, load_config, resolved_yaml, reward_callables, validate
from flows.config.derived import effective_pools, lambda_function_of
from flows.simulation.settings import load as load_simulation
from flows.training.launch import start_reward_service
from resources.lambda_template import DEFAULT_TEMPLATE, function_specs, load_sam_template
from tasks.components import accepts, describe, instantiate, resolve
from tests import ROOT

# config/deploy/ holds deployment specs (Kubernetes, SLURM), not training configs.
CONFIGS = sorted(p for p in (ROOT / "config").rglob("*.yaml") if p.parent.name != "deploy")


FUNCTIONS = function_specs(load_sam_template(DEFAULT_TEMPLATE))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_and_components_resolve(path):
    # config/scale/ holds clusters for flows/simulate.py: a run's config plus `simulate:`
    cfg = load_simulation(path)[0] if path.parent.name == "scale" else load_config(path)
    for task in cfg.env_tasks:
        # remote-latency environments of the bench workloads wait a thousandth of their latency
        scaled = {"time_scale": 1e-3} if accepts(resolve(task.env["_component_"]),
                                                  "time_scale") else {}
        env = instantiate(task.env, **scaled)
        obs, info = env.reset(seed=1)
        assert isinstance(obs, str) and obs
        assert callable(resolve(task.reward_fn))
        # the Lambda function the env task names may run its reward (the template's allow-list)
        allowed = FUNCTIONS[lambda_function_of(cfg.reward, task)]["environment"]["ROLLARC_REWARD_MODULES"]
        assert task.reward_fn.rpartition(".")[0] in allowed.split(","), task.name
    for spec in (cfg.engine.backend, cfg.trainer.backend, cfg.trainer.loss):
        assert callable(resolve(spec["_component_"]))
    assert effective_pools(cfg)


@pytest.mark.parametrize("override,key", [
    ("trainer.max_steps=-1", "trainer.max_steps"),
    ("no.such.key=1", "no"),
    ("mode=bogus", "mode"),
    ("placement=everywhere", "placement"),
    ("rollout.max_staleness=-2", "rollout.max_staleness"),
    ("env_tasks.0.weight=0", "env_tasks.0.weight"),
    ("trainer.hparams.lrr=1", "trainer.hparams.lrr"),
    ("cluster.pools.0.slots=0", "cluster.pools.0.slots"),
    ("env_tasks.1.env.low=9", "env_tasks.1.env"),
    ("env_tasks.0.env.bogus_kwarg=1", "env_tasks.0.env"),
    ("env_tasks.0.env._component_=tasks.envs.nope.Env", "env_tasks.0.env"),
    ("env_tasks.0.reward_fn=tasks.rewards.missing", "env_tasks.0.reward_fn"),
    ("cluster.pools.1.profile=B300", "cluster.pools.1.profile"),
    ("rollout.max_in_flight=4", "rollout.max_in_flight"),
    ("rollout.sampling.temperature=0.7", "trainer.hparams.temperature"),
    # an event must not reach code outside the reward modules, and the config says so at start
    ("env_tasks.0.reward_fn=os.system", "env_tasks.0.reward_fn"),
    ("reward.backend=aws", "reward.backend"),
    ("reward.max_payload_bytes=7000000", "reward.max_payload_bytes"),
    # renamed keys say what they are called now
    ("env_tasks.0.reward=tasks.rewards.env_return", "env_tasks.0.reward_fn"),
    ("env_tasks.0.reward_function=nope", "env_tasks.0.lambda_function"),
    ("reward.function_name=nope", "reward.lambda_function"),
    # staleness bound below what the admission window produces by design
    ("rollout.max_staleness=1", "rollout.max_staleness"),
    ("engine.backend._component_=resources.engine.nope", "engine.backend"),
    ("engine.backend.hold_s=abc", "hold_s"),  # the hf backend's own check of its values
    ("engine.backend.batch_wait_s=-1", "batch_wait_s"),
    ("trainer.loss._component_=tasks.losses.nope", "trainer.loss"),
    ("reward.endpoint_url=http://127.0.0.1:1", "reward.endpoint_url"),
    ("cluster.pools.4.role=env", "serverless"),
    # emulated devices
    ("engine.backend=tpu", "engine.backend"),
    ("engine.time_scale=0", "engine.time_scale"),
    ("engine.device.model=gpt-9", "engine.device.model"),
    ("rollout.env_barrier=true", "rollout.env_barrier"),  # a baseline of sync mode only
    ("reward.judge={model: dense-8b}", "reward.judge"),  # needs the emulated backend
    ("env_tasks.0.shape={prompt_tokens: {median: 0}, turn_tokens: {median: 1}, "
     "response_tokens: {median: 1}}", "env_tasks.0.shape.prompt_tokens.median"),
    ("rollout.turn_placement=random", "rollout.turn_placement"),
])
def test_bad_override_names_key(override, key):
    with pytest.raises(ConfigError) as exc:
        load_config(overrides=[override])
    assert key in str(exc.value)


def test_a_bad_key_or_value_is_reported_without_importing_torch():
    code = ("import sys\nfrom flows.config import ConfigError, load_config\n"
            "for o in ('trainer.max_stepz=3', 'trainer.max_steps=0', 'mode=fast',\n"
            "          'rollout.max_staleness=0'):\n"
            "    try:\n        load_config(overrides=[o])\n"
            "    except ConfigError as exc:\n        print(exc)\n"
            "print([m for m in ('torch', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True, cwd=ROOT).stdout.splitlines()
    assert len(out) == 5, out
    for line, key in zip(out, ["trainer.max_stepz", "trainer.max_steps", "mode",
                               "rollout.max_staleness"], strict=False):
        assert line.startswith(key), line
    assert out[-1] == "[]"


@pytest.mark.parametrize("override,key", [
    ("reward.lambda_function=nope", "reward.lambda_function"),
    ("env_tasks.0.lambda_function=nope", "env_tasks.*.lambda_function"),
    ("reward.read_timeout_s=60", "reward.read_timeout_s"),
])
def test_emulated_functions_are_checked_against_the_template_at_start(override, key):
    # the deployment template is read when the emulation starts, not by every config load
    cfg = load_config(overrides=[override])
    with pytest.raises(ConfigError) as exc:
        start_reward_service(cfg)
    assert key in str(exc.value)


@pytest.mark.parametrize("override", [
    "env_tasks.1.env.env.boxes=3",  # the wrapped environment's own check
    "env_tasks.1.env.env._component_=tasks.envs.sokoban.Nope",
    "env_tasks.1.env.failure_rate=1.5",
    "env_tasks.2.env.env.max_operand=0",
])
def test_wrapped_environments_are_checked_without_being_built(override):
    with pytest.raises(ConfigError) as exc:
        load_config(ROOT / "config" / "mix_sandbox.yaml", [override])
    assert str(exc.value).startswith(f"env_tasks.{override.split('.')[1]}.env")


@pytest.mark.parametrize("override,key", [
    ("trainer.loss.clip_eps=0.1", "trainer.loss.clip_eps"),  # the trainer would override it
    ("trainer.loss.typo=1", "trainer.loss"),
    ("engine.backend.bogus=2", "engine.backend"),
    ("trainer.backend.nope=3", "trainer.backend"),
    ("affinity.workload.model=no-such-model", "affinity.workload.model"),
])
def test_component_arguments_are_checked_at_start(override, key):
    with pytest.raises(ConfigError) as exc:
        load_config(overrides=[override])
    assert str(exc.value).startswith(key)


def test_config_load_builds_no_environment(monkeypatch):
    from tasks.envs import frozenlake, guess_number

    def refuse(*a, **k):
        raise AssertionError("an environment was constructed while loading the config")

    monkeypatch.setattr(frozenlake.FrozenLakeText, "__init__", refuse)
    monkeypatch.setattr(guess_number.GuessNumber, "__init__", refuse)
    assert load_config().env_tasks


def scaled(item, scale=1.0):
    return scale, {}


def test_python_objects_as_components_and_a_callable_reward_needs_the_local_backend():
    class MyEnv:  # defined here: no dotted path reaches it
        def __init__(self, size: int = 2):
            self.size = size

    def my_reward(item):
        return 1.0, {}

    cfg = load_config(overrides=["reward.backend=local"])
    cfg.env_tasks[0].env = {"_component_": MyEnv, "size": 3}
    cfg.env_tasks[0].reward_fn = my_reward
    # two partials of one function are two rewards, each env task keeps its own
    cfg.env_tasks[1].reward_fn = functools.partial(scaled, scale=2.0)
    cfg = validate(cfg)
    assert cfg.env_tasks[0].env["_component_"] is MyEnv
    fns = reward_callables(cfg)
    assert fns[f"{describe(my_reward)}@frozenlake"] is my_reward
    assert fns["partial(tests.unit.flows.test_configs.scaled)@guess_number"].keywords == {"scale": 2.0}
    assert "<python: tests.unit.flows.test_configs." in resolved_yaml(cfg)
    cfg.env_tasks[0].env = {"_component_": MyEnv, "bogus": 1}
    with pytest.raises(ConfigError, match="env_tasks.0.env"):
        validate(cfg)
    # the lambda backend cannot run a function that was never deployed: one line says why
    cfg = load_config()
    cfg.env_tasks[0].reward_fn = my_reward
    with pytest.raises(ConfigError) as exc:
        validate(cfg)
    msg = str(exc.value)
    assert "\n" not in msg and "env_tasks.0.reward_fn" in msg and "deploy" in msg


def test_overrides_apply():
    cfg = load_config(overrides=["trainer.max_steps=7", "mode=sync", "placement=monolithic",
                                 "rollout.max_staleness=1", "seed=3", "env_tasks.1.weight=0.5"])
    assert (cfg.trainer.max_steps, cfg.mode, cfg.placement) == (7, "sync", "monolithic")
    assert cfg.rollout.max_staleness == 1 and cfg.seed == 3 and cfg.env_tasks[1].weight == 0.5


def test_missing_config_file():
    with pytest.raises(ConfigError, match="--config"):
        load_config("/nonexistent.yaml")


@pytest.mark.parametrize("arg,key", [("trainer.max_steps=-1", "trainer.max_steps"),
                                     ("no.such.key=1", "no.such.key")])
def test_cli_bad_config_exits_2_with_one_line(arg, key, tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "flows" / "train.py"), arg,
                           "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert key in lines[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("args,said", [
    (["--config", "{tmp}"], "is a directory"),
    (["--run-dir", "/proc/rollarc-run"], "--run-dir"),
    (["--run-dir", "{tmp}/afile/run"], "--run-dir"),
    (["--dump-trajectories", "-1"], "metrics.dump_trajectories"),
])
def test_cli_unusable_paths_exit_2_with_one_line(args, said, tmp_path):
    (tmp_path / "afile").write_text("")
    args = [a.format(tmp=tmp_path) for a in args]
    proc = subprocess.run([sys.executable, str(ROOT / "flows" / "train.py"), *args],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and said in lines[0] and "Traceback" not in proc.stderr
