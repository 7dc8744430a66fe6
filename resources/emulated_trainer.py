"""The emulated trainer: real training steps on a production trainer pool's clock.

:class:`EmulatedTrainer` wraps the real trainer (the tokens and gradients are real): each step
runs, then waits the device-model time of a training step over the batch's virtual tokens
(:func:`resources.emulated.sequence_lengths`) on the trainer pool's GPUs, with the trainer's
``ppo_epochs`` passes and ``minibatches`` optimizer steps per pass
(:meth:`resources.device_model.DeviceModel.train_step_time`); exporting weights waits a weight
broadcast. Waits are sleeps multiplied by ``engine.time_scale``.
"""

from __future__ import annotations

import time

from resources.device_model import DeviceModel
from resources.emulated import sequence_lengths
from tasks.records import TrainBatch, TrainStats


class EmulatedTrainer:
    """A :class:`tasks.trainer.Trainer` whose steps and weight exports take device-model time
    on the trainer pool's GPUs (real steps run first: the tokens and gradients are real)."""

    def __init__(self, inner, device: DeviceModel, time_scale: float = 1.0, ppo_epochs: int = 1,
                 minibatches: int = 1):
        self.inner, self.device, self.time_scale = inner, device, time_scale
        self.ppo_epochs, self.minibatches = ppo_epochs, minibatches
        self.busy_s = 0.0  # unscaled seconds of emulated work

    def step_seconds(self, batch: TrainBatch) -> float:
        """Unscaled device seconds of one training step over ``batch``."""
        return self.device.train_step_time(sequence_lengths(batch.samples), self.ppo_epochs,
                                           self.minibatches)

    @property
    def version(self) -> int:
        return self.inner.version

    def _spend(self, seconds: float) -> None:
        self.busy_s += seconds
        time.sleep(seconds * self.time_scale)

    def train_step(self, batch: TrainBatch) -> TrainStats:
        stats = self.inner.train_step(batch)
        seconds = self.step_seconds(batch)
        self._spend(seconds)
        stats.seconds += seconds * self.time_scale
        return stats

    def export_weights(self):
        snapshot = self.inner.export_weights()
        self._spend(self.device.weight_broadcast_time())
        return snapshot

    def save_checkpoint(self, run_dir: str) -> str:
        return self.inner.save_checkpoint(run_dir)

    def load_checkpoint(self, path: str) -> int:
        return self.inner.load_checkpoint(path)
