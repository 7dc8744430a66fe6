"""The reward-client interface and its ``local`` backend.

A client scores a batch of :class:`ScoreRequest` and returns one :class:`ScoreResult` per request,
in order; failures come back as results with ``error`` set, never as silent zeros. The ``local``
backend calls the very handler that is deployed to AWS Lambda, in-process, with the same JSON.
"""

from __future__ import annotations

import json
from typing import Protocol

from tasks.records import ScoreRequest, ScoreResult
from tasks.rewards import SCHEMA_VERSION, handler


class RewardClient(Protocol):
    def score(self, requests: list[ScoreRequest]) -> list[ScoreResult]: ...


class LocalRewardClient:
    """Runs ``tasks.rewards.handler`` in-process, through a JSON round trip."""

    def __init__(self, max_batch: int = 64):
        self.max_batch = max_batch
        self.invocations = 0

    def score(self, requests: list[ScoreRequest]) -> list[ScoreResult]:
        out: list[ScoreResult] = []
        for i in range(0, len(requests), self.max_batch):
            chunk = requests[i : i + self.max_batch]
            event = json.loads(json.dumps(
                {"schema_version": SCHEMA_VERSION, "items": [r.to_json() for r in chunk]}))
            response = json.loads(json.dumps(handler(event, None)))
            self.invocations += 1
            by_id = {r["id"]: r for r in response.get("results", [])}
            for req in chunk:
                r = by_id.get(req.id)
                if r is None:
                    out.append(ScoreResult(req.id, None, error=response.get("error", "no result")))
                else:
                    out.append(ScoreResult(req.id, r.get("score"), r.get("details", {}),
                                           r.get("error")))
        return out

