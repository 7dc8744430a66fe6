"""The reward service's pure core: the event schema and the scoring of one event.

Event (schema version 1)::

    {"schema_version": 1, "items": [{"id", "idempotency_key", "reward_fn", "env_name",
                                     "env_rewards", "responses", "info"}, ...]}

Response: ``{"schema_version": 1, "results": [{"id", "idempotency_key", "score", "details"}
| {"id", "idempotency_key", "score": null, "error"}]}``, one result per item, so one bad
trajectory does not fail its batch. A malformed event gets ``{"error": {"type", "field",
"message"}, "results": []}`` naming the first bad field; retrying it would not help, so it is
answered rather than raised. Scoring is a pure function of the event: re-running it (an SDK
re-send, an async retry) is harmless, and the caller applies each idempotency key's reward once.

``reward_fn`` is resolved only inside the modules listed in ``ROLLARC_REWARD_MODULES`` (default
``tasks.rewards,tasks.reward_models,tasks.hc_pinn.verify``): an event must not be able to call
arbitrary code. A caller may also pass reward callables by name (the in-process ``local``
backend does), which are looked up first.

This module depends on pydantic only, so the client side and the config check import it without
the Lambda tooling; the Lambda entry point (powertools logging and metrics) is
:mod:`resources.lambda_handler`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tasks.components import resolve

SCHEMA_VERSION = 1
DEFAULT_REWARD_MODULES = "tasks.rewards,tasks.reward_models,tasks.hc_pinn.verify"

RewardFn = Callable[[dict[str, Any]], tuple[float, dict[str, Any]]]

logger = logging.getLogger(__name__)


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
    """The modules a ``reward_fn`` may name, read per call so a function's environment rules."""
    raw = os.environ.get("ROLLARC_REWARD_MODULES", DEFAULT_REWARD_MODULES)
    return tuple(m.strip() for m in raw.split(",") if m.strip())


def resolve_reward(path: str) -> RewardFn:
    """The reward function at ``path``, which must live in an allowed module."""
    module = path.rpartition(".")[0]
    if module not in allowed_reward_modules():
        raise PermissionError(f"reward_fn {path!r} is outside the allowed modules "
                              f"{list(allowed_reward_modules())} (ROLLARC_REWARD_MODULES)")
    return resolve(path)


def _malformed(exc: ValidationError) -> dict[str, Any]:
    err = exc.errors()[0]
    field = ".".join(str(p) for p in err["loc"]) or "<event>"
    return {"schema_version": SCHEMA_VERSION, "results": [],
            "error": {"type": "ValidationError", "field": field,
                      "message": f"{field}: {err['msg']}"}}


def score_item(item: ScoreItem, functions: Mapping[str, RewardFn] | None = None
               ) -> dict[str, Any]:
    """Score one item; an exception becomes this item's error, not the batch's."""
    base = {"id": item.id, "idempotency_key": item.idempotency_key}
    try:
        fn = functions.get(item.reward_fn) if functions else None
        if fn is None:
            fn = resolve_reward(item.reward_fn)
        score, details = fn(item.model_dump())
        score = float(score)
        if score != score or score in (float("inf"), float("-inf")):
            raise ValueError(f"{item.reward_fn} returned a non-finite score {score}")
        return base | {"score": score, "details": details}
    except Exception as exc:  # per item: the rest of the batch is still scored
        error = f"{type(exc).__name__}: {exc}"
        logger.warning("item failed", extra={"id": item.id, "reward_fn": item.reward_fn,
                                             "error": error})
        return base | {"score": None, "error": error}


def handle(event: Any, functions: Mapping[str, RewardFn] | None = None) -> dict[str, Any]:
    """Validate and score one event. ``functions`` are reward callables by name, consulted
    before the allow-listed modules: how a reward that was never deployed runs in-process."""
    try:
        batch = ScoreEvent.model_validate(event)
    except ValidationError as exc:
        return _malformed(exc)
    return {"schema_version": SCHEMA_VERSION,
            "results": [score_item(i, functions) for i in batch.items]}
