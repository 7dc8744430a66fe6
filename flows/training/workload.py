"""Workload shapes: the lengths each turn has on an emulated production engine. Pure.

An env task's ``shape`` gives per-turn distributions of the *virtual* prompt tokens (the first
turn's task prompt, then each later turn's observation or tool output, so the context grows with
the turn as agent contexts do) and of the virtual response tokens. :func:`turn_shape` draws them
from the run seed, the trajectory, the turn and the attempt, so a rerun sees the same lengths and
no two turns share a draw. The ``emulated`` backend (:mod:`resources.emulated`) makes the tiny
policy's real tokens stand for them; the ``hf`` backend ignores them.
"""

from __future__ import annotations

import math
import random

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tasks.records import TurnShape


class LengthDist(BaseModel):
    """Lognormal token counts: ``median x exp(N(0, sigma))``, clipped to ``[min, max]``
    (``sigma: 0`` is a constant). ``p99 / median = exp(2.33 sigma)``: sigma 1 is a 10x tail."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    median: float = Field(gt=0, description="Median tokens")
    sigma: float = Field(default=0.0, ge=0, description="Log-space spread (0: constant)")
    min: int = Field(default=1, ge=1, description="Fewest tokens")
    max: int = Field(default=1_000_000, ge=1, description="Most tokens")

    @model_validator(mode="after")
    def _ordered(self) -> LengthDist:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) exceeds max ({self.max})")
        return self

    def sample(self, rng: random.Random) -> int:
        x = self.median * math.exp(rng.gauss(0.0, self.sigma)) if self.sigma else self.median
        return int(min(self.max, max(self.min, round(x))))

    @property
    def mean(self) -> float:
        """The unclipped mean, ``median x exp(sigma^2 / 2)``."""
        return self.median * math.exp(self.sigma**2 / 2)


class TurnShapeConfig(BaseModel):
    """An env task's turn lengths on emulated devices (``env_tasks.N.shape``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt_tokens: LengthDist = Field(description="The first turn's prompt (system + task)")
    turn_tokens: LengthDist = Field(description="Each later turn's new tokens (observation, "
                                    "tool output)")
    response_tokens: LengthDist = Field(description="Tokens generated per turn")


def turn_shape(shape: TurnShapeConfig | None, seed: int, traj_id: int, turn: int,
               attempt: int = 0) -> TurnShape | None:
    """The virtual lengths of one turn (None without a shape: the real lengths count)."""
    if shape is None:
        return None
    rng = random.Random(f"shape/{seed}/{traj_id}/{turn}/{attempt}")
    prompt = (shape.prompt_tokens if turn == 0 else shape.turn_tokens).sample(rng)
    return TurnShape(prompt, shape.response_tokens.sample(rng))
