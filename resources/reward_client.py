"""What every reward backend shares, and the ``local`` backend.

A client (:class:`tasks.scoring.RewardClient`) scores a batch of :class:`ScoreRequest` and
returns a :class:`ScoreBatch`: one :class:`ScoreResult` per request, in order, plus a record of
every call it made. Failures come back as results with ``error`` set (``"<reason>: <message>"``),
never as silent zeros, and a trajectory's reward is applied once per idempotency key (the
:class:`ScoreLedger`), however often its batch was sent. Backends:

- ``local`` (:class:`LocalRewardClient`): the deployed handler's core, in-process, with the
  same JSON round trip;
- ``lambda`` (:class:`resources.lambda_client.LambdaRewardClient`): boto3 against AWS Lambda or
  the local emulation of its Invoke API.

:func:`resources.reward_backends.build_reward_client` picks one; this module imports neither it
nor the ``lambda`` backend, which builds on the helpers here.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from tasks.records import InvocationRecord, ScoreBatch, ScoreRequest, ScoreResult
from tasks.reward_service import SCHEMA_VERSION, RewardFn, handle


def chunk_size(n: int, concurrency: int, min_batch: int, batch_max: int) -> int:
    """Items per invocation for a burst of ``n``: spread over up to ``concurrency`` concurrent
    calls, but not below ``min_batch`` (a call's overhead wants amortising) nor above
    ``batch_max``."""
    if n <= 0:
        return 0
    return max(1, min(batch_max, max(min_batch, math.ceil(n / concurrency)), n))


def pack(requests: list[ScoreRequest], size: int, max_payload_bytes: int) -> list[list[ScoreRequest]]:
    """Consecutive chunks of at most ``size`` requests whose event stays under
    ``max_payload_bytes`` (a single request over the limit gets a chunk of its own, and the
    service's 413 reports it)."""
    chunks: list[list[ScoreRequest]] = []
    cur: list[ScoreRequest] = []
    base = cur_bytes = len(json.dumps(event_of([])))
    for r in requests:
        b = len(json.dumps(r.to_json())) + 2  # the item and its separator
        if cur and (len(cur) >= size or cur_bytes + b > max_payload_bytes):
            chunks.append(cur)
            cur, cur_bytes = [], base
        cur.append(r)
        cur_bytes += b
    if cur:
        chunks.append(cur)
    return chunks


def event_of(chunk: list[ScoreRequest]) -> dict[str, Any]:
    return {"schema_version": SCHEMA_VERSION, "items": [r.to_json() for r in chunk]}


def results_of(chunk: list[ScoreRequest], response: Any) -> list[ScoreResult]:
    """Per-request results of a handler response (matched by idempotency key)."""
    if not isinstance(response, dict):
        return [ScoreResult(r.id, None, error="reward_bad_response: not a JSON object")
                for r in chunk]
    if "error" in response:  # the whole event was rejected: retrying cannot help
        err = response["error"]
        msg = err.get("message", err) if isinstance(err, dict) else err
        return [ScoreResult(r.id, None, error=f"reward_bad_event: {msg}") for r in chunk]
    by_key = {r.get("idempotency_key"): r for r in response.get("results", [])
              if isinstance(r, dict)}
    out = []
    for req in chunk:
        r = by_key.get(req.idempotency_key)
        if r is None:
            out.append(ScoreResult(req.id, None, error="reward_missing_result: no result for "
                                                       f"{req.idempotency_key}"))
        elif r.get("score") is None:
            out.append(ScoreResult(req.id, None, error=f"reward_item_error: {r.get('error')}"))
        else:
            out.append(ScoreResult(req.id, float(r["score"]), r.get("details") or {}))
    return out


class ScoreLedger:
    """Scores applied so far, by idempotency key (bounded, oldest forgotten first): a key scored
    twice (a re-sent invocation, a re-run task) is applied once."""

    def __init__(self, capacity: int = 100_000):
        self.capacity = capacity
        self._scores: OrderedDict[str, ScoreResult] = OrderedDict()
        self._lock = threading.Lock()
        self.duplicates = 0

    def get(self, key: str) -> ScoreResult | None:
        with self._lock:
            return self._scores.get(key)

    def apply(self, key: str, result: ScoreResult) -> ScoreResult:
        """Record ``result`` for ``key`` unless one is recorded already; return the recorded."""
        if result.score is None:
            return result
        with self._lock:
            if key in self._scores:
                self.duplicates += 1
                return self._scores[key]
            self._scores[key] = result
            while len(self._scores) > self.capacity:
                self._scores.popitem(last=False)
            return result

    def __len__(self) -> int:
        return len(self._scores)


def split_known(ledger: ScoreLedger, requests: list[ScoreRequest]
                ) -> tuple[dict[int, ScoreResult], list[tuple[int, ScoreRequest]]]:
    """Requests already in the ledger (answered from it) and the rest, by position."""
    known: dict[int, ScoreResult] = {}
    todo: list[tuple[int, ScoreRequest]] = []
    for i, r in enumerate(requests):
        hit = ledger.get(r.idempotency_key)
        if hit is not None:
            known[i] = ScoreResult(r.id, hit.score, hit.details)
        else:
            todo.append((i, r))
    return known, todo


def apply_results(ledger: ScoreLedger, n: int, known: dict[int, ScoreResult],
                  todo: list[tuple[int, ScoreRequest]], results: list[ScoreResult],
                  records: list[InvocationRecord]) -> ScoreBatch:
    """The batch in request order: the ledger's results for known keys, and the new results
    (one per ``todo`` entry, in order) applied to the ledger once per key."""
    out = dict(known)
    for (i, req), res in zip(todo, results, strict=True):
        out[i] = ledger.apply(req.idempotency_key, res)
    return ScoreBatch([out[i] for i in range(n)], records, len(known))


class LocalRewardClient:
    """Runs the deployed handler's core (:func:`tasks.reward_service.handle`) in-process,
    through a JSON round trip; for runs without a Lambda endpoint. ``functions`` are reward
    callables by name that need no deployment (see ``handle``)."""

    def __init__(self, batch_max: int = 32, min_batch: int = 1,
                 max_payload_bytes: int = 6_000_000,
                 functions: Mapping[str, RewardFn] | None = None):
        self.batch_max, self.min_batch = batch_max, min_batch
        self.max_payload_bytes = max_payload_bytes
        self.functions = dict(functions or {})
        self.ledger = ScoreLedger()

    def check(self) -> None:
        """Nothing to reach: the rewards resolve per item, and a bad one fails that item."""

    def close(self) -> None:
        """Nothing to release."""

    def score(self, requests: list[ScoreRequest]) -> ScoreBatch:
        known, todo = split_known(self.ledger, requests)
        reqs = [r for _, r in todo]
        size = chunk_size(len(reqs), 1, self.min_batch, self.batch_max)
        results: list[ScoreResult] = []
        records: list[InvocationRecord] = []
        for chunk in pack(reqs, size, self.max_payload_bytes):  # chunks keep the order of reqs
            payload = json.dumps(event_of(chunk))
            t = time.perf_counter()
            response = json.loads(json.dumps(handle(json.loads(payload), self.functions)))
            results.extend(results_of(chunk, response))
            records.append(InvocationRecord(
                "local", len(chunk), len(payload), time.perf_counter() - t,
                "bad_event" if "error" in response else "ok"))
        return apply_results(self.ledger, len(requests), known, todo, results, records)
