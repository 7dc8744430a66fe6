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

import json
import logging
import random
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from distributed import Future

from flows.config import ConfigError, TrainConfig, reward_callables
from flows.config.choices import Placement, RewardBackend
from flows.config.derived import (
    effective_pools,
    emulation,
    is_emulated,
    pool_hardware,
    reward_client_settings,
    trainer_gpus,
    trainer_hparams,
)
from flows.monitoring.metrics import MetricSink, ProgressLine, batch_metrics, perf_metrics
from flows.monitoring.monitor import StageSpans
from flows.training import checkpoints, core, report
from flows.training.core import PoolLost, RunCore
from flows.training.env_scaler import env_scaler_for
from flows.training.evaluation import Evaluator
from flows.training.events import Abandoned, Event, EventLoop, FutureKind, cancel
from flows.training.launch import worker_devices
from flows.training.lifecycle import DropReason, TrajectoryLedger, Transition
from flows.training.orchestration import GroupDraw, Router
from flows.training.reward_bursts import RewardDispatcher
from flows.training.rollout import RolloutDriver, TurnOutcome
from flows.training.shards import RolloutShards
from flows.training.trainer_handle import TRAINER_CALL_TIMEOUT_S, TrainerHandle
from flows.training.weights import WeightLoads
from flows.training.worker_changes import WorkerChanges
from resources.catalog import HardwareProfile, get_profile
from resources.cluster import ClusterHandle
from resources.emulated import device_of, sequence_lengths
from resources.membership import MembershipWatch
from resources.placement import PlacementRecorder
from resources.pools import Tag
from resources.worker import RollArcWorkerPlugin
from tasks.records import TrainBatch, TrainStats, Trajectory
from tasks.stages import Stages

logger = logging.getLogger(__name__)

LIVE_EVERY_S = 0.5
TRAIN_STEP_GRACE_S = 120  # an interrupted run waits this long for its running train step
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
        if cfg.cluster.shards != 1 + len(shards):
            raise ConfigError(f"cluster.shards: {cfg.cluster.shards} shards configured, the run "
                              f"was given {1 + len(shards)} clusters (Session.start starts them)")
        if cfg.reward.backend == RewardBackend.LAMBDA and cfg.reward.emulator.enabled \
                and not reward_endpoint:
            raise ValueError("reward.emulator.enabled: pass the running emulation's URL as "
                             "reward_endpoint (flows.training.launch.start_reward_service starts it)")
        self.cfg, self.cluster, self.run_dir, self.sink = cfg, cluster, run_dir, sink
        self.publish_live = publish_live  # the dashboard page's figures, every LIVE_EVERY_S
        # workers joining and leaving from now on; and those that did before (between runs)
        self.membership = MembershipWatch(cluster.client)
        cluster.refresh()
        for tag in Tag:
            if not cluster.workers_with(tag):
                raise RuntimeError(f"no worker advertises the resource {tag}; start workers with "
                                   f"--resources \"{tag}=<slots>\"")
        self.stages = stages or Stages()
        self.reward_cfg = reward_client_settings(cfg.reward, reward_endpoint)
        if cfg.reward.judge is not None:  # its profile resolved here, config overrides included
            self.reward_cfg["judge_hardware"] = get_profile(
                cfg.reward.judge.profile, cfg.affinity.profiles).model_dump()
        self.client, self.run_id = cluster.client, run_dir.name
        self.core = RunCore(cfg, TrajectoryLedger(on_transition))
        ledger = self.core.ledger
        router = Router({str(t): cluster.workers_with(t) for t in Tag})
        self.events = EventLoop(self.client)
        self.abandoned = Abandoned(ABANDON_GRACE_S)
        self.spans = StageSpans(self.run_id)  # Fine Performance Metrics by env task and stage
        key_tag = f"@{uuid.uuid4().hex[:6]}"  # ends every key: runs on one cluster never share
        self.driver = RolloutDriver(self.client, cfg, router, ledger, self.stages, self.run_id,
                                    devices=worker_devices(cfg, cluster), spans=self.spans,
                                    key_tag=key_tag)
        # shard 0 (this driver, this loop) and the further shards of cluster.shards, if any
        self.shards = RolloutShards(list(shards), cfg, ledger, self.stages, self.run_id,
                                    key_tag, self.driver, self.events, cluster,
                                    lambda c: worker_devices(cfg, c), self.spans)
        if shards:
            logger.info("rollout over %d shards (schedulers): %s", cfg.cluster.shards,
                        [c.client.scheduler.address for c in (cluster, *shards)])
            if cfg.cluster.adaptive_env.enabled:
                logger.warning("cluster.adaptive_env scales shard 0's environment pool only")
        self.drivers = self.shards.drivers
        self.core.pool_slots = self.rollout_slots()
        self.rewards = RewardDispatcher(self.client, cfg, router, ledger, self.stages,
                                        self.run_id, self.core.batch_trajectories,
                                        spans=self.spans, key_tag=key_tag)
        self.trainer = TrainerHandle(self.client, cluster, self.stages, self.spans, key_tag)
        self.changes = WorkerChanges(self)  # workers joining and leaving; the watchdogs
        self.weights = WeightLoads(self.core, self.trainer, self.events, self.abandoned,
                                   self.shards, self.changes.serving)
        self.checkpoints = checkpoints.Checkpointer(
            run_dir, cfg.trainer.keep_checkpoints, self.trainer, self.core,
            lambda fut: self.events.track(fut, FutureKind.CHECKPOINT))
        self.scaler = env_scaler_for(cfg, cluster, self.driver)
        self.evaluator = Evaluator(cfg.env_tasks, cfg.eval.every_steps, cfg.eval.episodes,
                                   cfg.trainer.max_steps)
        # monolithic on emulated devices: training time-shares the engines' GPUs
        self.colocated_device = None
        if cfg.placement == Placement.MONOLITHIC and is_emulated(cfg.engine):
            profile, _ = pool_hardware(cfg)[effective_pools(cfg)[0].name]
            self.colocated_device = device_of(HardwareProfile(**profile), trainer_gpus(cfg),
                                              cfg.engine.device)
        self.batch_callbacks: list[Callable[[int, list[Trajectory]], None]] = []
        self.train_windows: list[tuple[float, float]] = []
        self.batch_info: dict = {}
        self.last_metrics: dict = {}
        self.t0: float | None = None
        self._paused_at: float | None = None
        self._elapsed_before = 0.0  # training time of the run this one resumes
        self._live_sent = self._train_submitted_at = 0.0
        self._train_future: Future | None = None
        self._end_detail = ""  # the drop detail of what the end's time limit cut

    @property
    def version(self) -> int:
        return self.core.version

    @property
    def ledger(self) -> TrajectoryLedger:
        return self.core.ledger

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
        self.client.register_plugin(PlacementRecorder(stream=cfg.metrics.task_stream))
        plugin = RollArcWorkerPlugin(
            policy=cfg.policy.model_dump(), backend=cfg.engine.backend,
            trainer=cfg.trainer.backend, loss=cfg.trainer.loss, seed=cfg.seed,
            hparams=trainer_hparams(cfg).model_dump(),
            reward=self.reward_cfg, reward_functions=reward_callables(cfg),
            pool_hardware=pool_hardware(cfg), default_pool=effective_pools(cfg)[0].name,
            trainer_gpus=trainer_gpus(cfg), emulation=emulation(cfg.engine),
            stragglers=cfg.faults.stragglers)
        self.client.register_plugin(plugin)
        if cfg.trainer.resume_from:
            version = self.trainer.resume(cfg.trainer.resume_from)
            state = Path(cfg.trainer.resume_from).parent / checkpoints.DRIVER_STATE
            if state.is_file():  # a periodic checkpoint: continue exactly
                self._restore_driver(json.loads(state.read_text()))
            else:  # a final checkpoint: new group seeds, not a replay of the first run's
                self.core.restore({"version": version, "draw": GroupDraw(
                    cfg.env_tasks, random.Random(f"{cfg.seed}/{version}")).state()})
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
        since = 0.0 if self.t0 is None else time.perf_counter() - self.t0
        return self._elapsed_before + since

    def train(self, progress: ProgressLine, until: int | None = None) -> bool:
        """The event loop: until ``trainer.max_steps`` steps are trained and nothing is left in
        flight (True), or until policy version ``until`` is reached (False: the work in flight
        carries on, and the next call takes it up)."""
        now = time.perf_counter()
        if self.t0 is None:
            self.t0 = now
        elif self._paused_at is not None:  # the pause between calls is not training time
            self.t0 += now - self._paused_at
        self._paused_at = None
        self._handlers = {
            FutureKind.TURN: self._on_turn, FutureKind.SCORE: self._on_score,
            FutureKind.TRAIN: lambda ev: self._on_train(ev, progress),
            FutureKind.LOAD_WEIGHTS: self.weights.on_load,
            FutureKind.TIME_SHARE: self.weights.on_time_share,
            FutureKind.CHECKPOINT: lambda ev: self.checkpoints.on_checkpoint(
                ev, self.abandoned.lost(ev)),
            FutureKind.PUBLISH: self.weights.on_publish}
        while True:
            if until is not None and self.version >= until and not self.driver.stopping:
                self._send_live(force=True)
                self._paused_at = time.perf_counter()
                return False
            for fut in self.rewards.flush():
                self.events.track(fut, FutureKind.SCORE)
            if (batch := self.core.cut()) is not None:
                self._train(batch)
            for group in self.core.admit():  # after a batch was cut: its room refilled at once
                self._start_group(group)
            for fut in self.driver.flush():  # every turn made ready since: new, next, retried
                self.events.track(fut, FutureKind.TURN)
            self.shards.flush()
            if self._events_empty() and not self.changes.waiting():
                if not self.core.finished_training:
                    raise RuntimeError(
                        f"stalled at policy version {self.version}: nothing in flight and "
                        f"nothing admissible (rollout.max_in_flight={self.cfg.rollout.max_in_flight},"
                        f" pool slots={self.core.pool_slots})")
                break
            # workers that left since: their futures are given up before any result is fetched
            self.changes.poll()
            for ev in self._next_batch():
                self.handle(ev)
            self.changes.poll()
            for driver in self.drivers:
                driver.prune_closing()
            self._send_live()
            if self.core.end_overdue(time.perf_counter()):
                self._cut_the_end()
                break
        for driver in self.drivers:
            driver.wait_closing()
        self.core.end(self._end_detail)
        self._send_live(force=True)
        return True

    def _cut_the_end(self) -> None:
        """The end's ``rollout.end_timeout_s`` is over: what is left is cancelled (its
        trajectories dropped as ``run_ended``, their environments closed) and named in the log."""
        loops = self.event_loops()
        kinds: Counter[str] = Counter()
        for loop in loops:
            kinds.update(loop.pending_kinds())
        limit = self.cfg.rollout.end_timeout_s
        self._end_detail = f"still in flight rollout.end_timeout_s={limit:g} s after the last " \
                           "train step"
        logger.warning("the run's end waited %g s (rollout.end_timeout_s) for %s and %d "
                       "trajectories waiting for a worker (missing pools: %s): cancelled",
                       limit, dict(kinds) or "nothing", sum(d.waiting for d in self.drivers),
                       [str(t) for t in self.changes.missing_pools()] or "none")
        cancel([f for loop in loops for f in loop.pending()])
        for driver in self.drivers:
            driver.close_all()

    def handle(self, ev: Event) -> None:
        """A finished (or given-up) future, to the handler of its kind."""
        self._handlers[ev.kind](ev)
        self.abandoned.settled(ev.future.key)

    def event_loops(self) -> list[EventLoop]:
        return self.shards.loops

    def _events_empty(self) -> bool:
        return all(loop.empty() for loop in self.event_loops())

    def _next_batch(self) -> list[Event]:
        return self.shards.next_batch(wake=self.changes.wake)

    def trainer_futures_lost(self) -> list[Future]:
        """The trainer's worker left: its train step and checkpoints in flight, given up."""
        futures = [f for f in (self._train_future,) if f is not None]
        self._train_future = None
        return futures + self.checkpoints.abandon()

    def abort(self, reason: DropReason = DropReason.INTERRUPTED) -> None:
        """Stop at once (an interrupt): cancel the work in flight, close the live environment
        instances, drop every live trajectory with ``reason``. A train step already running
        is let finish and recorded, so that the trainer and the metrics agree on the version.
        The cluster stays usable."""
        for driver in self.drivers:
            driver.stop(reason)
        running = self._train_future
        finishing = self.checkpoints.keys() | ({running.key} if running is not None else set())
        cancel([f for loop in self.event_loops() for f in loop.pending()
                if f.key not in finishing])
        if running is not None:
            try:
                self._record_train(running.result(timeout=TRAIN_STEP_GRACE_S))
            except Exception as exc:  # cancelled before it started, failed, or too slow
                logger.warning("the train step in flight did not finish: %s", exc)
                self.core.train_lost(reason, f"{exc!r}"[:200])
            self._train_future = None
        self.checkpoints.land(TRAIN_STEP_GRACE_S)
        for driver in self.drivers:
            driver.close_all()
        for driver in self.drivers:
            driver.wait_closing(timeout=30)
        for evaluation in (False, True):
            for tid in self.ledger.live(evaluation):
                self.ledger.drop(tid, reason)
        self._send_live(force=True)

    def _send_live(self, force: bool = False) -> None:
        now = time.perf_counter()
        if self.publish_live is None or (not force and now - self._live_sent < LIVE_EVERY_S):
            return
        self._live_sent = now
        self.publish_live(report.live_figures(self))

    def save(self) -> str:
        return self.trainer.save(str(self.run_dir.resolve()), self.version)

    def summary(self) -> dict:
        return report.summary(self)

    # -- instructions -----------------------------------------------------------------------
    def _start_group(self, group: core.StartGroup) -> None:
        self.shards.start_group(group.group_id, group.env_task, group.seed)

    def _train(self, batch: core.Train) -> None:
        self._train_future = self.events.track(
            self.trainer.train(TrainBatch(batch.samples, batch.version)), FutureKind.TRAIN)
        if self.colocated_device is not None:
            self.weights.time_share(batch.version, self.colocated_device.train_step_time(
                sequence_lengths(batch.samples)))
        for callback in self.batch_callbacks:
            callback(batch.version + 1, batch.trajectories)  # as train/step will name it
        self._train_submitted_at = time.perf_counter()
        self.batch_info = batch_metrics(batch.trajectories, batch.staleness,
                                        batch.stale_dropped)

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
        self._train_future = None
        if ev.future.key in self.abandoned:  # lost with the trainer's worker (dropped then)
            return
        if self.abandoned.lost(ev):  # its result lost with the trainer's worker: the batch is
            # dropped; the worker's departure (an event of its own) rebuilds the trainer
            self.core.train_lost(DropReason.TRAINER_LOST, "the train step's result was lost")
            return
        if ev.future.status != "finished":  # a trainer failure ends the run loudly
            raise RuntimeError(f"{ev.future.key} failed: {ev.future.exception()!r}")
        instructions = self._record_train(ev.result)
        progress.update(self.last_metrics, [t.name for t in self.cfg.env_tasks])
        self._carry_out(instructions)
        if self.evaluator.due(self.version):
            for ep in self.evaluator.start(self.version):
                self.driver.start(ep.group_id, ep.env_task, ep.seed, eval_round=ep.round_id)

    def _record_train(self, stats: TrainStats) -> list[core.Instruction]:
        """A train step's result: the new version, its metrics row; the core's instructions
        (not carried out yet)."""
        now = time.perf_counter()
        self.train_windows.append((self._train_submitted_at, now))
        instructions = self.core.trained(stats.policy_version, now)
        faults = {}
        for ins in instructions:
            if isinstance(ins, core.Recovered):
                faults["faults/recovery_s"] = ins.seconds
        if (restored := self.changes.restored_from()) is not None:
            faults["train/restored_from"] = restored
        metrics = {"train/step": self.version, **stats.log("train"), **self.batch_info,
                   **perf_metrics(self.elapsed_s, self.ledger.summary()),
                   **self.rewards.metrics(), **faults}
        self.sink.log(metrics)
        self.last_metrics = metrics
        return instructions

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
        self.driver.restore(state)
        self._elapsed_before = float(state["elapsed_s"])
