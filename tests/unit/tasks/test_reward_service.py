"""The reward service's pure core (``tasks.reward_service``) apart from the Lambda tooling, reward
callables that were never deployed, and the choice of backend (``build_reward_client``)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from resources.lambda_build import PROJECT_ROOT
from resources.lambda_client import LambdaRewardClient
from resources.reward_backends import build_reward_client
from resources.reward_client import LocalRewardClient
from tasks.records import ScoreRequest
from tasks.reward_service import SCHEMA_VERSION, handle

LOCAL = {"backend": "local", "batch_max": 4, "min_batch": 1, "max_payload_bytes": 6_000_000}
LAMBDA = LOCAL | {"backend": "lambda", "region": "us-east-1", "endpoint_url": "http://127.0.0.1:9",
                  "concurrency": 2, "read_timeout_s": 130.0, "connect_timeout_s": 1.0,
                  "sdk_max_attempts": 1, "throttle_retries": 0, "function_error_retries": 0,
                  "emulated": True}

# Run first by ``python -c``: any import of aws_lambda_powertools fails, as where it is absent.
_NO_POWERTOOLS = """\
import sys

class NoPowertools:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "aws_lambda_powertools":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoPowertools())
"""


def _without_powertools(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _NO_POWERTOOLS + code], cwd=PROJECT_ROOT,
                          capture_output=True, text=True, timeout=120)


def _req(i, reward_fn="my.reward", answer="3"):
    return ScoreRequest(id=str(i), idempotency_key=f"run/{i}/0", reward_fn=reward_fn,
                        env_name="guess_number", env_rewards=[1.0 if answer == "3" else 0.0],
                        responses=[answer], info={"secret": 3, "low": 1, "high": 8,
                                                  "success": answer == "3",
                                                  "format_penalty": 0.1})


def _event(*reqs):
    return json.loads(json.dumps({"schema_version": SCHEMA_VERSION,
                                  "items": [r.to_json() for r in reqs]}))


# -- the core imports without the Lambda tooling ---------------------------------------------------
def test_core_and_client_import_without_powertools():
    proc = _without_powertools(
        "import tasks.rewards, tasks.reward_service, resources.reward_client\n"
        "loaded = [m for m in sys.modules if m.partition('.')[0] == 'aws_lambda_powertools'\n"
        "          or m in ('resources.lambda_client', 'resources.reward_backends')]\n"
        "assert not loaded, loaded\n")
    assert proc.returncode == 0, proc.stderr


def test_the_lambda_handler_needs_powertools():
    # the same blocker stops the handler: the test above would notice a powertools import
    proc = _without_powertools("import resources.lambda_handler\n")
    assert proc.returncode != 0
    assert "ModuleNotFoundError: No module named 'aws_lambda_powertools" in proc.stderr


# -- handle --------------------------------------------------------------------------------------
def test_handle_consults_functions_before_the_allowed_modules():
    def half(item):
        return 0.5, {"answer": item["responses"][-1]}

    out = handle(_event(_req(0), _req(1, "tasks.rewards.guess_number_verifier"),
                        _req(2, "tasks.rewards.guess_number_verifier", answer="5"),
                        _req(3, "os.system")),
                 functions={"my.reward": half, "tasks.rewards.guess_number_verifier": half})
    r = {x["id"]: x for x in out["results"]}
    assert out["schema_version"] == SCHEMA_VERSION
    assert r["0"] == {"id": "0", "idempotency_key": "run/0/0", "score": 0.5,
                      "details": {"answer": "3"}}
    assert r["1"]["score"] == r["2"]["score"] == 0.5  # the name given wins over the module's
    # a name not given still resolves only inside the allowed modules
    assert r["3"]["score"] is None and "outside the allowed modules" in r["3"]["error"]
    # without functions, an undeployed name is refused like any other outside name
    alone = handle(_event(_req(0)))["results"][0]
    assert alone["score"] is None and alone["error"].startswith("PermissionError")


def test_a_failing_callable_fails_its_item_only_and_is_logged():
    records: list[logging.LogRecord] = []
    sink = logging.Handler(logging.WARNING)
    sink.emit = records.append
    log = logging.getLogger("tasks.reward_service")
    log.addHandler(sink)
    try:
        out = handle(_event(_req(0, "my.nan"), _req(1, "my.boom"), _req(2, "my.ok")), {
            "my.nan": lambda item: (float("nan"), {}),
            "my.boom": lambda item: 1 / 0,
            "my.ok": lambda item: (1, {})})
    finally:
        log.removeHandler(sink)
    scores = [(x["score"], x.get("error", "")) for x in out["results"]]
    assert scores[0][0] is None and "non-finite score nan" in scores[0][1]
    assert scores[1] == (None, "ZeroDivisionError: division by zero")
    assert scores[2] == (1.0, "")
    assert [(rec.getMessage(), rec.id) for rec in records] == [("item failed", "0"),
                                                               ("item failed", "1")]


@pytest.mark.parametrize("event, field", [
    ({"schema_version": 1, "items": [{"id": "1"}]}, "items.0.idempotency_key"),
    ({"schema_version": 2, "items": []}, "schema_version"),
    ({"items": []}, "schema_version"),
    ({"schema_version": 1, "items": [{"x": 1}], "extra": 1}, "items.0.id"),
    ([1, 2], "<event>"),
])
def test_a_malformed_event_is_answered_naming_the_first_bad_field(event, field):
    out = handle(event, functions={"my.reward": lambda item: (1.0, {})})
    assert out == {"schema_version": SCHEMA_VERSION, "results": [],
                   "error": {"type": "ValidationError", "field": field,
                             "message": out["error"]["message"]}}
    assert out["error"]["message"].startswith(f"{field}: ")


# -- backends ------------------------------------------------------------------------------------
def test_local_backend_scores_with_a_callable_reward_defined_in_the_test():
    seen = []

    def length_reward(item):
        seen.append(item["id"])
        return len(item["responses"][-1]) / 10, {"chars": len(item["responses"][-1])}

    client = build_reward_client(LOCAL, "rollarc-reward", functions={"my.reward": length_reward})
    assert isinstance(client, LocalRewardClient)
    reqs = [_req(i, answer="x" * i) for i in range(6)]
    reqs.append(_req(6, "tasks.rewards.guess_number_verifier"))  # deployed rewards still work
    batch = client.score(reqs)
    assert [r.id for r in batch.results] == [str(i) for i in range(7)]
    assert [r.score for r in batch.results] == [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 1.0]
    assert batch.results[3].details == {"chars": 3} and batch.results[3].error is None
    assert [rec.batch_size for rec in batch.invocations] == [4, 3]
    assert {rec.status for rec in batch.invocations} == {"ok"}
    assert seen == [str(i) for i in range(6)]
    # a re-sent burst is answered from the ledger: the callable is not called again
    again = client.score(reqs)
    assert again.deduplicated == 7 and again.invocations == [] and len(seen) == 6
    client.check()
    client.close()


def test_lambda_backend_refuses_callables_and_builds_without_them():
    with pytest.raises(ValueError, match=r"^a Python callable reward cannot run on AWS Lambda: "
                                         r"deploy it .* or use reward\.backend=local$"):
        build_reward_client(LAMBDA, "rollarc-reward", functions={"my.reward": lambda item: 0})
    for functions in (None, {}):
        client = build_reward_client(LAMBDA, "rollarc-reward", functions=functions)
        try:
            assert isinstance(client, LambdaRewardClient)
            assert client.function_name == "rollarc-reward"
        finally:
            client.close()
    with pytest.raises(ValueError, match="reward.backend: unknown backend 'sqs'"):
        build_reward_client(LAMBDA | {"backend": "sqs"}, "rollarc-reward")
