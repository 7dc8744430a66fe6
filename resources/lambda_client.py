"""The ``lambda`` reward backend: boto3 ``lambda.invoke`` against AWS or the local emulation.

The botocore ``Config`` is chosen on purpose (see ``LIBRARY-FACTS.md`` §2):

- ``retries={"mode": "standard"}``: botocore re-sends throttles (429) and transport errors
  itself with jittered backoff; ``total_max_attempts`` bounds it;
- ``read_timeout`` above the function's timeout: otherwise a long call times out in the SDK and
  is re-sent while the first still runs, so the function runs twice;
- ``max_pool_connections`` as large as the concurrency, so concurrent invokes do not queue for a
  connection.

On top of botocore, the client retries what botocore gave up on, each a bounded number of times:
a throttle that outlasted botocore's attempts (a throttled call did not run: safe), and a
``FunctionError`` (the function ran and raised). After that the trajectories come back with an
error and the flow drops them with that reason; nothing is scored 0 silently. Every throttle is
counted, whichever layer retried it (a ``needs-retry`` hook sees each attempt botocore makes), and
every call is recorded (:class:`InvocationRecord`): latency, batch size, payload, retries,
throttles, cold start (the ``Init Duration`` of the ``REPORT`` line in the log tail).

A burst of finished trajectories is packed into invocations under the 6 MB synchronous payload
limit and fanned out over up to ``concurrency`` concurrent calls (:func:`chunk_size`); a 413
splits the batch and sends both halves.
"""

from __future__ import annotations

import base64
import json
import logging
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from resources.reward_client import (
    ScoreLedger,
    apply_results,
    chunk_size,
    event_of,
    pack,
    results_of,
    split_known,
)
from tasks.records import InvocationRecord, ScoreBatch, ScoreRequest, ScoreResult

logger = logging.getLogger(__name__)

_INIT_RE = re.compile(r"Init Duration: ([\d.]+) ms")
SYNC_PAYLOAD_LIMIT = 6 * 1024 * 1024


class LambdaRewardClient:
    """Scores trajectories by invoking a Lambda function (RequestResponse)."""

    def __init__(self, function_name: str, region: str = "us-east-1",
                 endpoint_url: str | None = None, concurrency: int = 16, batch_max: int = 32,
                 min_batch: int = 4, max_payload_bytes: int = SYNC_PAYLOAD_LIMIT - 64 * 1024,
                 read_timeout_s: float = 130.0, connect_timeout_s: float = 5.0,
                 sdk_max_attempts: int = 3, throttle_retries: int = 8,
                 function_error_retries: int = 2, backoff_base_s: float = 0.05,
                 backoff_max_s: float = 5.0, dummy_credentials: bool = False):
        self.function_name = function_name
        self.concurrency, self.batch_max, self.min_batch = concurrency, batch_max, min_batch
        self.max_payload_bytes = max_payload_bytes
        self.throttle_retries, self.function_error_retries = throttle_retries, function_error_retries
        self.backoff_base_s, self.backoff_max_s = backoff_base_s, backoff_max_s
        self.config = Config(
            region_name=region,
            retries={"mode": "standard", "total_max_attempts": sdk_max_attempts},
            read_timeout=read_timeout_s, connect_timeout=connect_timeout_s,
            max_pool_connections=concurrency, tcp_keepalive=True)
        # The emulation accepts any signature; without an endpoint the usual AWS credential
        # chain (environment, profile, instance role) applies.
        creds = ({"aws_access_key_id": "emulated", "aws_secret_access_key": "emulated"}
                 if dummy_credentials else {})
        self._lambda = boto3.session.Session().client(
            "lambda", endpoint_url=endpoint_url, config=self.config, **creds)
        self._lambda.meta.events.register("needs-retry.lambda.Invoke", self._on_attempt)
        self._attempt = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="invoke")
        self.ledger = ScoreLedger()

    def _on_attempt(self, response=None, caught_exception=None, **kwargs) -> None:
        """Called by botocore after every attempt, before it decides to retry: count the
        throttles it would otherwise retry out of sight. Returns None (botocore decides)."""
        if response is not None and response[0].status_code == 429:
            self._attempt.throttles = getattr(self._attempt, "throttles", 0) + 1

    def check(self) -> None:
        """Fail fast on a wrong function name, region or endpoint: a ``DryRun`` invoke."""
        try:
            self._lambda.invoke(FunctionName=self.function_name, InvocationType="DryRun")
        except (ClientError, BotoCoreError) as exc:
            raise RuntimeError(f"reward function {self.function_name!r} is not invocable: "
                               f"{exc}") from exc

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._lambda.close()

    # -- scoring -----------------------------------------------------------------------------
    def score(self, requests: list[ScoreRequest]) -> ScoreBatch:
        known, todo = split_known(self.ledger, requests)
        reqs = [r for _, r in todo]
        size = chunk_size(len(reqs), self.concurrency, self.min_batch, self.batch_max)
        chunks = pack(reqs, size, self.max_payload_bytes) if reqs else []
        results: list[ScoreResult] = []
        records: list[InvocationRecord] = []
        # chunks keep the order of ``reqs``; map() keeps the order of chunks
        for res, recs in self._pool.map(self._score_chunk, chunks):
            results.extend(res)
            records.extend(recs)
        return apply_results(self.ledger, len(requests), known, todo, results, records)

    def _backoff(self, attempt: int) -> None:
        # full jitter (AWS Architecture Blog, "Exponential Backoff and Jitter")
        time.sleep(random.uniform(0, min(self.backoff_max_s, self.backoff_base_s * 2 ** attempt)))

    def _score_chunk(self, chunk: list[ScoreRequest]
                     ) -> tuple[list[ScoreResult], list[InvocationRecord]]:
        """Invoke for one chunk, with the client's own bounded retries; a 413 splits it."""
        payload = json.dumps(event_of(chunk)).encode()
        records: list[InvocationRecord] = []
        throttled = errored = 0
        while True:
            status, body, rec = self._invoke(payload, len(chunk))
            rec.attempt = len(records)
            records.append(rec)
            if status == "TooManyRequestsException" and throttled < self.throttle_retries:
                throttled += 1  # throttled calls did not run: retrying is safe
                self._backoff(throttled)
                continue
            if status == "RequestTooLargeException" and len(chunk) > 1:
                half = len(chunk) // 2
                a, ra = self._score_chunk(chunk[:half])
                b, rb = self._score_chunk(chunk[half:])
                return a + b, records + ra + rb
            if status == "function_error" and errored < self.function_error_retries:
                errored += 1
                self._backoff(errored)
                continue
            break
        if status == "ok" or status == "bad_event":
            return results_of(chunk, body), records
        if status == "function_error":
            err = body if isinstance(body, dict) else {}
            reason = (f"reward_function_error: {err.get('errorType', 'Unhandled')}: "
                      f"{err.get('errorMessage', '')}"[:500])
        else:
            reason = f"reward_call_failed: {status}: {body}"[:500]
        logger.warning("scoring %d trajectories failed after %d calls: %s", len(chunk),
                       len(records), reason)
        return [ScoreResult(r.id, None, error=reason) for r in chunk], records

    def _invoke(self, payload: bytes, batch_size: int):
        """One ``invoke`` call (botocore's retries included): (status, body, record)."""
        self._attempt.throttles = 0
        t = time.perf_counter()
        sdk_retries, cold, init_ms = 0, False, None
        try:
            resp = self._lambda.invoke(FunctionName=self.function_name,
                                       InvocationType="RequestResponse", LogType="Tail",
                                       Payload=payload)
            sdk_retries = resp["ResponseMetadata"].get("RetryAttempts", 0)
            raw = resp["Payload"].read()
            log = base64.b64decode(resp.get("LogResult") or b"").decode(errors="replace")
            m = _INIT_RE.search(log)
            cold, init_ms = m is not None, float(m.group(1)) if m else None
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = None
            if resp.get("FunctionError"):
                status = "function_error"
            elif isinstance(body, dict) and "error" in body:
                status = "bad_event"
            else:
                status = "ok"
        except ClientError as exc:
            status = exc.response.get("Error", {}).get("Code", "ClientError")
            body = exc.response.get("Error", {}).get("Message", str(exc))
            sdk_retries = exc.response.get("ResponseMetadata", {}).get("RetryAttempts", 0)
        except BotoCoreError as exc:  # connection refused, read timeout after all attempts
            status, body = type(exc).__name__, str(exc)
        rec = InvocationRecord(self.function_name, batch_size, len(payload),
                               time.perf_counter() - t, status, sdk_retries,
                               self._attempt.throttles, cold, init_ms)
        return status, body, rec
