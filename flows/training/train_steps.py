"""The run's train steps on the trainer's worker: submitted one at a time as the run core cuts
batches, each result recorded as the step's metrics row, given up with the trainer's worker.

The core decides when a step starts and what follows one (:mod:`flows.training.core`);
:class:`TrainSteps` submits it, keeps the step in flight, and turns its result into the core's
instructions and a metrics row.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from distributed import Future

from flows.monitoring.metrics import MetricSink, batch_metrics, perf_metrics
from flows.monitoring.step_timings import StepLog, trajectory_key
from flows.training import core
from flows.training.events import Abandoned, Event, EventLoop, FutureKind
from flows.training.lifecycle import DropReason
from flows.training.reward_bursts import RewardBursts
from flows.training.trainer_handle import TrainerHandle
from flows.training.weights import WeightLoads
from tasks.records import TrainBatch, TrainSample, TrainStats, Trajectory

logger = logging.getLogger(__name__)


class TrainSteps:
    """The step in flight, the windows the trainer trained in, the last metrics row."""

    def __init__(self, run_core: core.RunCore, trainer: TrainerHandle, events: EventLoop,
                 abandoned: Abandoned, weights: WeightLoads, rewards: RewardBursts,
                 sink: MetricSink, elapsed_s: Callable[[], float],
                 restored_from: Callable[[], int | None],
                 colocated_train_s: Callable[[list[TrainSample]], float] | None = None):
        """``restored_from()``: the checkpoint version of a trainer restore since the last step
        (None: none). ``colocated_train_s``: monolithic on emulated devices, the device time of a
        train step on the engines' GPUs, which it time-shares (None: the trainer has its own
        GPUs)."""
        self.core, self.trainer, self.events, self.abandoned = run_core, trainer, events, abandoned
        self.weights, self.rewards, self.sink = weights, rewards, sink
        self.elapsed_s, self.colocated_train_s = elapsed_s, colocated_train_s
        # called with (the version the step will publish, its trajectories) as a batch is cut
        self.batch_callbacks: list[Callable[[int, list[Trajectory]], None]] = []
        self.windows: list[tuple[float, float]] = []  # (submitted, recorded) of every step
        self.batch_info: dict = {}  # the batch's metrics, for the row of its step
        self.last_metrics: dict = {}
        self.timings = StepLog()  # each step's cut, end and trajectories: its critical path
        self.restored_from = restored_from
        self.future: Future | None = None
        self._submitted_at = 0.0

    def submit(self, batch: core.Train) -> None:
        """The core's ``Train``: the step on the trainer's worker (and, colocated, the engines
        yielding their GPUs to it)."""
        self.future = self.events.track(
            self.trainer.train(TrainBatch(batch.samples, batch.version)), FutureKind.TRAIN)
        if self.colocated_train_s is not None:
            self.weights.time_share(batch.version, self.colocated_train_s(batch.samples))
        for callback in self.batch_callbacks:
            callback(batch.version + 1, batch.trajectories)  # as train/step will name it
        self._submitted_at = time.perf_counter()
        self.timings.cut(batch.version + 1, [trajectory_key(t.traj_id, t.attempt)
                                             for t in batch.trajectories], time.time())
        self.batch_info = batch_metrics(batch.trajectories, batch.staleness,
                                        batch.stale_dropped)

    def on_done(self, ev: Event) -> list[core.Instruction] | None:
        """A step's future came back: the core's instructions, or None when the step was lost
        with the trainer's worker (its batch is dropped; the worker's departure, an event of
        its own, rebuilds the trainer). A trainer failure ends the run loudly."""
        self.future = None
        if ev.future.key in self.abandoned:  # given up when the worker left (dropped then)
            return None
        if self.abandoned.lost(ev):
            self.core.train_lost(DropReason.TRAINER_LOST, "the train step's result was lost")
            return None
        if ev.future.status != "finished":
            raise RuntimeError(f"{ev.future.key} failed: {ev.future.exception()!r}")
        return self.record(ev.result)

    def record(self, stats: TrainStats) -> list[core.Instruction]:
        """A step's result: the new version and its metrics row; the core's instructions (not
        carried out yet)."""
        now = time.perf_counter()
        self.windows.append((self._submitted_at, now))
        self.timings.trained(time.time())
        instructions = self.core.trained(stats.policy_version, now)
        faults = {}
        for ins in instructions:
            if isinstance(ins, core.Recovered):
                faults["faults/recovery_s"] = ins.seconds
        if (restored := self.restored_from()) is not None:
            faults["train/restored_from"] = restored
        metrics = {"train/step": self.core.version, **stats.log("train"), **self.batch_info,
                   **perf_metrics(self.elapsed_s(), self.core.ledger.summary()),
                   **self.rewards.metrics(), **faults}
        self.sink.log(metrics)
        self.last_metrics = metrics
        return instructions

    def finish(self, reason: DropReason, timeout: float) -> None:
        """An interrupted run: the step in flight is let finish and recorded (so that the
        trainer and the metrics agree on the version), or its batch dropped with ``reason``."""
        running, self.future = self.future, None
        if running is None:
            return
        try:
            self.record(running.result(timeout=timeout))
        except Exception as exc:  # cancelled before it started, failed, or too slow
            logger.warning("the train step in flight did not finish: %s", exc)
            self.core.train_lost(reason, f"{exc!r}"[:200])

    def lost(self) -> list[Future]:
        """The trainer's worker left: the step in flight, given up."""
        running, self.future = self.future, None
        return [running] if running is not None else []
