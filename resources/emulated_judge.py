"""A model-based reward's GPU time, on emulated devices.

:class:`JudgedRewardClient` wraps a reward client: each call is scored for real, then waits a
reward model's prefill over the batch's virtual tokens, either on a serverless GPU instance of
its own (billed per call) or queued on one dedicated
:class:`resources.emulated_engine.EmulatedEngine` that every call shares.
:class:`JudgeEmulation` (``reward.judge``) says which model, GPUs and how many.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from resources.device_model import DeviceModel, ModelName
from resources.emulated_engine import EmulatedEngine


class JudgeEmulation(BaseModel):
    """A reward model's GPUs (``reward.judge``): with ``reward.backend: lambda`` each invocation
    runs on a serverless GPU instance of its own (elastic: as many as calls in flight); with
    ``local`` every call queues on one dedicated engine of ``gpus`` devices on the reward
    worker, whose utilisation is then measured."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: ModelName = Field(default="dense-8b", description="The reward model (device-model "
                             "preset or Hugging Face config.json)")
    profile: str = Field(default="H800", description="GPUs the reward model runs on")
    gpus: int = Field(default=1, ge=1, description="Devices per engine (serverless: per "
                      "instance; local: the dedicated pool)")


class JudgedRewardClient:
    """A :class:`tasks.scoring.RewardClient` whose calls also take a reward model's time: one
    prefill over the batch's virtual tokens, on a serverless instance of its own
    (``dedicated=False``) or on the one dedicated engine every call shares."""

    def __init__(self, inner, device: DeviceModel, time_scale: float, dedicated: bool):
        self.inner, self.device, self.time_scale = inner, device, time_scale
        self.engine = EmulatedEngine(device, time_scale) if dedicated else None
        self.billed_s = 0.0  # serverless GPU seconds (unscaled) paid for
        self.ledger = inner.ledger

    def check(self) -> None:
        self.inner.check()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.inner.close()

    def score(self, requests):
        batch = self.inner.score(requests)
        tokens = sum(r.virtual_tokens for r in requests)
        if self.engine is not None:
            self.engine.prefill(tokens)
        else:
            seconds = self.device.prefill_time(tokens)
            self.billed_s += seconds
            time.sleep(seconds * self.time_scale)
        return batch

    def stats(self) -> dict[str, Any]:
        if self.engine is not None:
            return {"dedicated_busy_s": self.engine.stats.busy_s,
                    "gpus": self.device.gpus, "profile": self.device.hw.name}
        return {"serverless_billed_s": self.billed_s, "gpus": self.device.gpus,
                "profile": self.device.hw.name}
