"""One training run on a Dask cluster: set up, train, save, summarise.

The run's decisions are the run core's (:mod:`flows.training.core`): :class:`TrainingRun` feeds
it what happens on Dask — futures finishing, workers joining and leaving, time passing — and
carries out its instructions there. Each part has its own module: trajectories roll out as Dask
graphs (:mod:`flows.training.rollout`), their states are one state machine
(:mod:`flows.training.lifecycle`), finished ones are scored in bursts
(:mod:`flows.training.reward_bursts`), trained (:mod:`flows.training.trainer_handle`), their
weights loaded (:mod:`flows.training.weights`), checkpointed (:mod:`flows.training.checkpoints`)
and evaluated (:mod:`flows.training.evaluation`); what is reported is
:mod:`flows.training.report`. :mod:`flows.reference` is the same recipe in one process.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from distributed import Future

from flows.config import TrainConfig
from flows.monitoring.metrics import MetricSink, ProgressLine
from flows.monitoring.monitor import StageSpans
from flows.training import checkpoints, core, report, stopping
from flows.training.core import PoolLost, RunCore
from flows.training.env_scaler import env_scaler_for
from flows.training.evaluation import Evaluator
from flows.training.events import Abandoned, Event, EventLoop, FutureKind, RunClock
from flows.training.launch import (
    check_run_inputs,
    colocated_train_s,
    require_pools,
    reward_settings,
    worker_devices,
    worker_plugin,
)
from flows.training.lifecycle import DropReason, TrajectoryLedger, Transition
from flows.training.orchestration import PoolWorkers
from flows.training.reward_bursts import RewardBursts
from flows.training.rollout import RolloutDriver, TurnOutcome
from flows.training.shards import RolloutShards
from flows.training.train_steps import TrainSteps
from flows.training.trainer_handle import TRAINER_CALL_TIMEOUT_S, TrainerHandle
from flows.training.weights import WeightLoads
from flows.training.worker_changes import WorkerChanges
from resources.cluster import ClusterHandle
from resources.membership import MembershipWatch
from resources.placement import install_recorder
from resources.pools import Tag
from tasks.records import Trajectory
from tasks.stages import Stages

logger = logging.getLogger(__name__)

LIVE_EVERY_S = 0.5
# a future given up on (cancelled) that has not come back this long after is resolved as lost
ABANDON_GRACE_S = 30.0

__all__ = ["PoolLost", "TrainingRun"]


class TrainingRun:
    """Wires the cluster, the rollout driver, reward bursts, the trainer and the run core."""

    def __init__(self, cfg: TrainConfig, cluster: ClusterHandle, run_dir: Path, sink: MetricSink,
                 reward_endpoint: str | None = None, stages: Stages | None = None,
                 on_transition: Callable[[Transition, TrajectoryLedger], None] | None = None,
                 publish_live: Callable[[dict], None] | None = None,
                 shards: Sequence[ClusterHandle] = ()):
        """``shards``: the further rollout shards' clusters of ``cluster.shards``
        (:func:`flows.training.shards.start_rollout_shards`); ``cluster`` is shard 0."""
        check_run_inputs(cfg, 1 + len(shards), reward_endpoint)
        self.cfg, self.cluster, self.run_dir, self.sink = cfg, cluster, run_dir, sink
        self.publish_live = publish_live  # the dashboard page's figures, every LIVE_EVERY_S
        # workers joining and leaving from now on; and those that did before (between runs)
        self.membership = MembershipWatch(cluster.client)
        cluster.refresh()
        require_pools(cluster)
        self.stages = stages or Stages()
        self.reward_cfg = reward_settings(cfg, reward_endpoint)
        self.client, self.run_id = cluster.client, run_dir.name
        self.core = RunCore(cfg, TrajectoryLedger(on_transition))
        ledger = self.core.ledger
        pool_workers = PoolWorkers({str(t): cluster.workers_with(t) for t in Tag})
        self.events = EventLoop(self.client)
        self.abandoned = Abandoned(ABANDON_GRACE_S)
        self.spans = StageSpans(self.run_id)  # Fine Performance Metrics by env task and stage
        key_tag = f"@{uuid.uuid4().hex[:6]}"  # ends every key: runs on one cluster never share
        self.driver = RolloutDriver(self.client, cfg, pool_workers, ledger, self.stages,
                                    self.run_id, devices=worker_devices(cfg, cluster),
                                    spans=self.spans, key_tag=key_tag)
        # shard 0 (this driver, this loop) and the further shards of cluster.shards, if any
        self.shards = RolloutShards(list(shards), cfg, ledger, self.stages, self.run_id,
                                    key_tag, self.driver, self.events, cluster,
                                    lambda c: worker_devices(cfg, c), self.spans)
        self.drivers = self.shards.drivers
        self.core.pool_slots = self.rollout_slots()
        self.rewards = RewardBursts(self.client, cfg, pool_workers, ledger, self.stages,
                                    self.run_id, self.core.batch_trajectories,
                                    spans=self.spans, key_tag=key_tag)
        self.trainer = TrainerHandle(self.client, cluster, self.stages, self.spans, key_tag)
        self.changes = WorkerChanges(self)  # workers joining and leaving; the watchdogs
        self.weights = WeightLoads(self.core, self.trainer, self.events, self.abandoned,
                                   self.shards, self.changes.serving)
        self.steps = TrainSteps(self.core, self.trainer, self.events, self.abandoned,
                                self.weights, self.rewards, sink, lambda: self.elapsed_s,
                                self.changes.restored_from, colocated_train_s(cfg))
        self.checkpoints = checkpoints.Checkpointer(
            run_dir, cfg.trainer.keep_checkpoints, self.trainer, self.core,
            lambda fut: self.events.track(fut, FutureKind.CHECKPOINT))
        self.scaler = env_scaler_for(cfg, cluster, self.driver)
        self.evaluator = Evaluator(cfg.env_tasks, cfg.eval.every_steps, cfg.eval.episodes,
                                   cfg.trainer.max_steps)
        self.clock = RunClock()
        self._live_sent = 0.0
        self._end_detail = ""  # the drop detail of what the end's time limit cut
        self._interrupted = False  # an interrupt waits for the event loop's next pass

    @property
    def version(self) -> int:
        return self.core.version

    @property
    def ledger(self) -> TrajectoryLedger:
        return self.core.ledger

    def on_batch(self, callback: Callable[[int, list[Trajectory]], None]) -> None:
        """Call ``callback(version, trajectories)`` as each batch is cut (``version``: the one
        its step will publish)."""
        self.steps.batch_callbacks.append(callback)

    def rollout_slots(self) -> int:
        """Slots of the smallest rollout pool (a rolling-out trajectory holds at most one task of
        each at a time; at least 1, so that admission goes on while a pool is refilled); with
        rollout shards, the sum of each shard's."""
        return self.shards.slots()

    # -- recipe -----------------------------------------------------------------------------
    def setup(self) -> None:
        """Install the worker state, resume if asked, and load the trainer's weights
        everywhere (version-stamped) before the first rollout."""
        cfg = self.cfg
        install_recorder(self.client, stream=cfg.metrics.task_stream)
        plugin = worker_plugin(cfg, self.reward_cfg)
        self.client.register_plugin(plugin)
        if cfg.trainer.resume_from:
            self._restore_driver(checkpoints.resume(cfg, self.trainer))
            logger.info("resumed at policy version %d", self.version)
        timeout = cfg.cluster.startup_timeout_s
        versions = self.weights.worker_versions
        for w, f in self.trainer.sync_weights(self.version).items():
            versions[w] = f.result(timeout=timeout)
        # the plugin, then the weights, on the further shards
        versions |= self.shards.setup(plugin, self.trainer.snapshot, timeout)

    @property
    def elapsed_s(self) -> float:
        """Training wall time: from the first :meth:`train` call, pauses not counted."""
        return self.clock.elapsed_s

    def train(self, progress: ProgressLine, until: int | None = None) -> bool:
        """The event loop: until ``trainer.max_steps`` steps are trained and nothing is left in
        flight (True), or until policy version ``until`` is reached (False: the work in flight
        carries on, and the next call takes it up). An interrupt meanwhile raises
        KeyboardInterrupt at the loop's next pass (:func:`stopping.interrupts_between_batches`)."""
        self._interrupted = False
        with stopping.interrupts_between_batches(self._interrupt):
            return self._loop(progress, until)

    def _interrupt(self) -> None:
        self._interrupted = True

    def _loop(self, progress: ProgressLine, until: int | None) -> bool:
        self.clock.start()
        self._handlers = {
            FutureKind.TURN: self._on_turn, FutureKind.SCORE: self._on_score,
            FutureKind.TRAIN: lambda ev: self._on_train(ev, progress),
            FutureKind.LOAD_WEIGHTS: self.weights.on_load,
            FutureKind.TIME_SHARE: self.weights.on_time_share,
            FutureKind.CHECKPOINT: lambda ev: self.checkpoints.on_checkpoint(
                ev, self.abandoned.lost(ev)),
            FutureKind.PUBLISH: self.weights.on_publish}
        while True:
            if self._interrupted:  # between two batches: the bookkeeping is whole
                raise KeyboardInterrupt
            if until is not None and self.version >= until and not self.driver.stopping:
                self._send_live(force=True)
                self.clock.pause()
                return False
            for fut in self.rewards.flush():
                self.events.track(fut, FutureKind.SCORE)
            if (batch := self.core.cut()) is not None:
                self.steps.submit(batch)
            for group in self.core.admit():  # after a batch was cut: its room refilled at once
                self._start_group(group)
            for fut in self.driver.flush():  # every turn made ready since: new, next, retried
                self.events.track(fut, FutureKind.TURN)
            self.shards.flush()
            if all(loop.empty() for loop in self.event_loops()) and not self.changes.waiting():
                if not self.core.finished_training:
                    raise RuntimeError(
                        f"stalled at policy version {self.version}: nothing in flight and "
                        f"nothing admissible (rollout.max_in_flight={self.cfg.rollout.max_in_flight},"
                        f" pool slots={self.core.pool_slots})")
                break
            # workers that left since: their futures are given up before any result is fetched
            self.changes.poll()
            for ev in self.shards.next_batch(wake=self.changes.wake):
                self.handle(ev)
            self.changes.poll()
            for driver in self.drivers:
                driver.tasks.prune_closing()
            self._send_live()
            if self.core.end_overdue(time.perf_counter()):
                self._end_detail = stopping.cut_the_end(
                    self.event_loops(), self.drivers, self.cfg.rollout.end_timeout_s,
                    self.changes.missing_pools())
                break
        for driver in self.drivers:
            driver.tasks.wait_closing()
        self.core.end(self._end_detail)
        self._send_live(force=True)
        return True

    def handle(self, ev: Event) -> None:
        """A finished (or given-up) future, to the handler of its kind."""
        self._handlers[ev.kind](ev)
        self.abandoned.settled(ev.future.key)

    def event_loops(self) -> list[EventLoop]:
        return self.shards.loops

    def trainer_futures_lost(self) -> list[Future]:
        """The trainer's worker left: its train step and checkpoints in flight, given up."""
        return self.steps.lost() + self.checkpoints.abandon()

    def abort(self, reason: DropReason = DropReason.INTERRUPTED) -> None:
        """Stop at once (an interrupt); the cluster stays usable (:func:`stopping.abort`)."""
        stopping.abort(reason, self.drivers, self.event_loops(), self.steps, self.checkpoints,
                       self.ledger)
        self._send_live(force=True)

    def _send_live(self, force: bool = False) -> None:
        now = time.perf_counter()
        if self.publish_live is None or (not force and now - self._live_sent < LIVE_EVERY_S):
            return
        self._live_sent = now
        self.publish_live(report.live_figures(self))

    def release(self) -> None:
        """The run is over: stop watching the clusters' workers (the next run watches afresh)."""
        self.membership.close()
        self.shards.close()

    def save(self) -> str:
        return self.trainer.save(str(self.run_dir.resolve()), self.version)

    def summary(self) -> report.RunSummary:
        return report.summary(self)

    # -- instructions -----------------------------------------------------------------------
    def _start_group(self, group: core.StartGroup) -> None:
        self.shards.start_group(group.group_id, group.env_task, group.seed)

    def _carry_out(self, instructions: list[core.Instruction]) -> None:
        """The core's instructions after a step trained."""
        for ins in instructions:
            if isinstance(ins, core.StopRollout):
                for driver in self.drivers:
                    driver.stop(DropReason.RUN_ENDED)
            elif isinstance(ins, core.Publish):
                self.weights.publish(ins.version)
            elif isinstance(ins, core.Checkpoint):
                self.checkpoints.start(ins.version, self.driver_state())

    # -- completions ------------------------------------------------------------------------
    def _on_turn(self, ev: Event) -> None:
        driver = self.shards.driver(ev.shard)
        self.on_turn_outcome(driver.on_turn(ev.future, ev.result if ev.ok else None))

    def on_turn_outcome(self, out: TurnOutcome) -> None:
        for rec, traj in out.finished:
            if rec.evaluation:
                self._on_eval_episode(rec.eval_round, traj)
            else:
                self.rewards.queue(traj)
        for rec in out.dropped:
            if rec.evaluation:
                self._on_eval_episode(rec.eval_round, None)
            elif not self.driver.stopping:  # once stopping, its group ends with the run
                self.core.member_lost(rec.group_id)

    def _on_score(self, ev: Event) -> None:
        outcome = self.rewards.on_scored(ev.future, ev.result)
        for t in outcome.scored:
            self.core.scored(t)
        for t in outcome.dropped:
            self.core.member_lost(t.group_id)

    def _on_train(self, ev: Event, progress: ProgressLine) -> None:
        instructions = self.steps.on_done(ev)
        if instructions is None:  # lost with the trainer's worker
            return
        progress.update(self.steps.last_metrics, [t.name for t in self.cfg.env_tasks])
        self._carry_out(instructions)
        if self.evaluator.due(self.version):
            for ep in self.evaluator.start(self.version):
                self.driver.start(ep.group_id, ep.env_task, ep.seed, eval_round=ep.round_id)

    def _on_eval_episode(self, round_id: int, traj: Trajectory | None) -> None:
        metrics = self.evaluator.on_episode(round_id, traj)
        if metrics is not None:
            self.sink.log(metrics | {"perf/elapsed_s": self.elapsed_s})

    # -- checkpoints ------------------------------------------------------------------------
    def checkpoint_now(self) -> Path:
        """A checkpoint of the current version, written before returning (a graceful stop)."""
        return self.checkpoints.now(self.version, self.driver_state(), TRAINER_CALL_TIMEOUT_S)

    def driver_state(self) -> dict:
        """What the driver needs to continue a run exactly: the env-task sampler, the
        trajectory ids, the training time so far."""
        return self.core.state() | self.driver.state() | {"elapsed_s": self.elapsed_s}

    def _restore_driver(self, state: dict) -> None:
        self.core.restore(state)
        if "elapsed_s" in state:  # a periodic checkpoint's: the trajectory ids, the time
            self.driver.restore(state)
            self.clock.before_s = float(state["elapsed_s"])
