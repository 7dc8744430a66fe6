"""Reward functions and the reward handler.

Reward functions are pure: one JSON-able request in, a score and details out. ``handler`` is the
function deployed to AWS Lambda (and called in-process by the ``local`` backend): it takes a batch
event as JSON and returns one result per item, so one bad item does not fail its batch.
"""

from __future__ import annotations

from typing import Any

from tasks.components import resolve

SCHEMA_VERSION = 1


def env_return(item: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """Rule-based verifier: the environment's own return (success pays 1, format errors cost
    their penalty), with the success flag as a detail."""
    rewards = [float(r) for r in item["env_rewards"]]
    return sum(rewards), {"success": bool(item["info"].get("success", False)),
                          "format_errors": int(item["info"].get("format_errors", 0))}


def success_only(item: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """1 for success, 0 otherwise; ignores format penalties."""
    ok = bool(item["info"].get("success", False))
    return float(ok), {"success": ok}


def handler(event: dict[str, Any], context: Any = None) -> dict[str, Any]:
    """Score a batch: ``{"schema_version": 1, "items": [{id, reward_fn, ...}]}``."""
    if event.get("schema_version") != SCHEMA_VERSION:
        return {"error": f"schema_version must be {SCHEMA_VERSION}", "results": []}
    results = []
    for item in event.get("items", []):
        try:
            fn = resolve(item["reward_fn"])
            score, details = fn(item)
            results.append({"id": item["id"], "score": float(score), "details": details})
        except Exception as exc:  # per item: the rest of the batch is still scored
            results.append({"id": item.get("id"), "score": None,
                            "error": f"{type(exc).__name__}: {exc}"})
    return {"schema_version": SCHEMA_VERSION, "results": results}


def score(client, requests: list) -> list:
    """The ``score`` task: one call of a reward client for a batch of finished trajectories."""
    return client.score(requests)
