"""The reward handler (the Lambda function) and the local reward client."""

from __future__ import annotations

import json

from resources.reward_client import LocalRewardClient
from tasks.records import ScoreRequest
from tasks.rewards import SCHEMA_VERSION, handler


def _req(i, fn="tasks.rewards.env_return", rewards=(-0.1, 1.0), success=True):
    return ScoreRequest(id=str(i), idempotency_key=f"k{i}", reward_fn=fn, env_name="frozenlake",
                        env_rewards=list(rewards), responses=["x", "right"],
                        info={"success": success, "format_errors": 1})


def test_handler_scores_each_item_and_isolates_failures():
    event = {"schema_version": SCHEMA_VERSION,
             "items": [_req(0).to_json(), _req(1, fn="tasks.rewards.nope").to_json(),
                       _req(2, fn="tasks.rewards.success_only", success=False).to_json()]}
    out = handler(json.loads(json.dumps(event)))
    r = {x["id"]: x for x in out["results"]}
    assert r["0"]["score"] == 0.9 and r["0"]["details"]["success"] is True
    assert r["1"]["score"] is None and "nope" in r["1"]["error"]
    assert r["2"]["score"] == 0.0


def test_handler_rejects_unknown_schema_version():
    out = handler({"schema_version": 99, "items": []})
    assert "schema_version" in out["error"]


def test_local_client_batches_and_keeps_order():
    client = LocalRewardClient(max_batch=2)
    res = client.score([_req(i) for i in range(5)])
    assert [r.id for r in res] == ["0", "1", "2", "3", "4"]
    assert client.invocations == 3 and all(r.score == 0.9 for r in res)
