"""The emulated trainer: real training steps on a production trainer pool's clock.

:class:`EmulatedTrainer` wraps the real trainer (the tokens and gradients are real): each step
takes the device-model time of a training step over the batch's virtual tokens and loss
positions (:func:`resources.emulated.train_step_seconds`) on the trainer pool's GPUs, with the
trainer's ``ppo_epochs`` passes and ``minibatches`` optimizer steps per pass
(:meth:`resources.device_model.DeviceModel.train_step_time`); exporting weights waits a weight
broadcast. Waits are sleeps multiplied by ``engine.time_scale``.

The real step (and the real export) runs inside the device time, not before it: each sleeps
what is left of the scaled device time once the real work is done. The tiny policy's step on the
CPU is emulation, not work the production trainer does; added to the device time, it would
lengthen every emulated step by its CPU seconds divided by ``time_scale`` (0.3-2 s of CPU on 2
cores is 1.5-10 emulated seconds at ``time_scale`` 0.2). A step whose real work outlasts its
device time takes the real time (``train/seconds`` says so).
"""

from __future__ import annotations

import time

from resources.device_model import DeviceModel
from resources.emulated import train_step_seconds
from tasks.records import TrainBatch, TrainStats


class EmulatedTrainer:
    """A :class:`tasks.trainer.Trainer` whose steps and weight exports take device-model time
    on the trainer pool's GPUs (real steps run within it: the tokens and gradients are real)."""

    def __init__(self, inner, device: DeviceModel, time_scale: float = 1.0, ppo_epochs: int = 1,
                 minibatches: int = 1):
        self.inner, self.device, self.time_scale = inner, device, time_scale
        self.ppo_epochs, self.minibatches = ppo_epochs, minibatches
        self.busy_s = 0.0  # unscaled seconds of emulated work

    def step_seconds(self, batch: TrainBatch) -> float:
        """Unscaled device seconds of one training step over ``batch``."""
        return train_step_seconds(self.device, batch.samples, self.ppo_epochs,
                                  self.minibatches)

    @property
    def version(self) -> int:
        return self.inner.version

    def _spend(self, seconds: float, since: float) -> None:
        """``seconds`` of device time for work whose real part began at ``since``
        (``time.perf_counter``): sleep what is left of the scaled time."""
        self.busy_s += seconds
        time.sleep(max(0.0, seconds * self.time_scale - (time.perf_counter() - since)))

    def train_step(self, batch: TrainBatch) -> TrainStats:
        t0 = time.perf_counter()
        stats = self.inner.train_step(batch)
        self._spend(self.step_seconds(batch), t0)
        stats.seconds = time.perf_counter() - t0
        return stats

    def export_weights(self):
        t0 = time.perf_counter()
        snapshot = self.inner.export_weights()
        self._spend(self.device.weight_broadcast_time(), t0)
        return snapshot

    def save_checkpoint(self, run_dir: str) -> str:
        return self.inner.save_checkpoint(run_dir)

    def load_checkpoint(self, path: str) -> int:
        return self.inner.load_checkpoint(path)
