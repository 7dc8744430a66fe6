"""The reward-scoring AWS Lambda handler (aws-lambda-powertools v3).

Event (schema version 1)::

    {"schema_version": 1, "items": [{"id", "idempotency_key", "reward_fn", "env_name",
                                     "env_rewards", "responses", "info"}, ...]}

Response: ``{"schema_version": 1, "results": [{"id", "idempotency_key", "score", "details"}
| {"id", "idempotency_key", "score": null, "error"}]}``, one result per item, so one bad
trajectory does not fail its batch. A malformed event gets ``{"error": {"type", "field",
"message"}, "results": []}`` naming the first bad field; retrying it would not help, so it is not
raised as a function error. The handler is a pure function of its event: re-running it (an SDK
re-send, an async retry) is harmless, and the caller applies each idempotency key's reward once.

``reward_fn`` is resolved only inside the modules listed in ``ROLLARC_REWARD_MODULES`` (default
``tasks.rewards,tasks.reward_models``): an event must not be able to call arbitrary code.
Deployed by ``resources/lambda/template.yaml``; run locally by ``resources/lambda_emulator.py``
and in-process by the ``local`` reward backend.
"""

from __future__ import annotations

import os
import time
from typing import Any, Literal

from aws_lambda_powertools import Logger, Metrics
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.parser import ValidationError, parse
from aws_lambda_powertools.utilities.typing import LambdaContext
from pydantic import BaseModel, ConfigDict, Field

from tasks.components import resolve

SCHEMA_VERSION = 1
DEFAULT_REWARD_MODULES = "tasks.rewards,tasks.reward_models"

logger = Logger(service=os.environ.get("POWERTOOLS_SERVICE_NAME", "rollarc-reward"))
metrics = Metrics(namespace=os.environ.get("POWERTOOLS_METRICS_NAMESPACE", "RollArc"),
                  service=os.environ.get("POWERTOOLS_SERVICE_NAME", "rollarc-reward"))


class ScoreItem(BaseModel):
    """One finished trajectory to score (see :class:`tasks.records.ScoreRequest`)."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1)
    idempotency_key: str = Field(min_length=1, max_length=512)
    reward_fn: str = Field(min_length=1, max_length=256)
    env_name: str
    env_rewards: list[float]
    responses: list[str]
    info: dict[str, Any]


class ScoreEvent(BaseModel):
    """A batch of trajectories to score."""

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1]
    items: list[ScoreItem]


def allowed_reward_modules() -> tuple[str, ...]:
    raw = os.environ.get("ROLLARC_REWARD_MODULES", DEFAULT_REWARD_MODULES)
    return tuple(m.strip() for m in raw.split(",") if m.strip())


def resolve_reward(path: str):
    """The reward function at ``path``, which must live in an allowed module."""
    module = path.rpartition(".")[0]
    if module not in allowed_reward_modules():
        raise PermissionError(f"reward_fn {path!r} is outside the allowed modules "
                              f"{list(allowed_reward_modules())} (ROLLARC_REWARD_MODULES)")
    return resolve(path)


def _init() -> None:
    """Cold-start set-up (Lambda's init phase): optionally load the reward model now."""
    if os.environ.get("ROLLARC_PRELOAD_REWARD_MODEL") == "1":
        from tasks.reward_models import embedding_model

        embedding_model()


_init()


def _malformed(exc: ValidationError) -> dict[str, Any]:
    err = exc.errors()[0]
    field = ".".join(str(p) for p in err["loc"]) or "<event>"
    return {"schema_version": SCHEMA_VERSION, "results": [],
            "error": {"type": "ValidationError", "field": field,
                      "message": f"{field}: {err['msg']}"}}


def score_item(item: ScoreItem) -> dict[str, Any]:
    """Score one item; an exception becomes this item's error, not the batch's."""
    base = {"id": item.id, "idempotency_key": item.idempotency_key}
    try:
        score, details = resolve_reward(item.reward_fn)(item.model_dump())
        score = float(score)
        if score != score or score in (float("inf"), float("-inf")):
            raise ValueError(f"{item.reward_fn} returned a non-finite score {score}")
        return base | {"score": score, "details": details}
    except Exception as exc:  # per item: the rest of the batch is still scored
        logger.warning("item failed", extra={"id": item.id, "reward_fn": item.reward_fn,
                                             "error": f"{type(exc).__name__}: {exc}"})
        return base | {"score": None, "error": f"{type(exc).__name__}: {exc}"}


def handle(event: Any) -> dict[str, Any]:
    """Validate and score one event (the handler's pure core; the ``local`` backend calls it
    in-process)."""
    try:
        batch = parse(event=event, model=ScoreEvent)
    except ValidationError as exc:
        return _malformed(exc)
    return {"schema_version": SCHEMA_VERSION, "results": [score_item(i) for i in batch.items]}


@logger.inject_lambda_context(clear_state=True)
@metrics.log_metrics(capture_cold_start_metric=True)
def lambda_handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    t0 = time.perf_counter()
    response = handle(event)
    if "error" in response:
        logger.error("malformed event", extra={"error": response["error"]})
        metrics.add_metric(name="MalformedEvents", unit=MetricUnit.Count, value=1)
        return response
    results = response["results"]
    failed = sum(r["score"] is None for r in results)
    metrics.add_metric(name="ScoredItems", unit=MetricUnit.Count, value=len(results) - failed)
    metrics.add_metric(name="FailedItems", unit=MetricUnit.Count, value=failed)
    metrics.add_metric(name="BatchSize", unit=MetricUnit.Count, value=len(results))
    # EMF holds at most 100 values per metric: the batch's scores up to that
    for r in results[:100]:
        if r["score"] is not None:
            metrics.add_metric(name="Score", unit=MetricUnit.NoUnit, value=r["score"])
    latency_ms = (time.perf_counter() - t0) * 1000
    metrics.add_metric(name="HandlerLatency", unit=MetricUnit.Milliseconds, value=latency_ms)
    logger.info("scored batch", extra={"items": len(results), "failed": failed,
                                       "latency_ms": round(latency_ms, 2)})
    return response
