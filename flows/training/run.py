"""One training run on a Dask cluster: set up, train, save, summarise.

:class:`TrainingRun` wires the parts and runs one event loop on the driver. Each part has its
own module: trajectories roll out as Dask graphs (:mod:`flows.training.rollout`), their states and
accounts are one state machine (:mod:`flows.training.lifecycle`), finished ones are scored in bursts
(:mod:`flows.training.reward_bursts`), grouped and cut into batches (:mod:`flows.training.orchestration`), trained
(:mod:`flows.training.trainer_handle`) and evaluated (:mod:`flows.training.evaluation`); metrics are pure
functions (:mod:`flows.monitoring.metrics`). Every decision is a pure function of :mod:`flows.training.orchestration`.
:mod:`flows.reference` is the same recipe in one process, without Dask.
"""

from __future__ import annotations

import json
import logging
import random
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

from distributed import Future

from flows.config import ConfigError, TrainConfig, reward_callables
from flows.config.choices import Placement, RewardBackend
from flows.config.derived import (
    batch_trajectories,
    device_model,
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
from flows.training import checkpoints
from flows.training.env_scaler import EnvPoolScaler
from flows.training.evaluation import Evaluator
from flows.training.events import Event, EventLoop, FutureKind, cancel
from flows.training.lifecycle import DropReason, RunFailing, TrajectoryLedger, TrajState, Transition
from flows.training.orchestration import (
    AdmissionState,
    GroupCollector,
    GroupDraw,
    Router,
    admission_room,
    admission_state,
    groups_to_cut,
)
from flows.training.reward_bursts import RewardDispatcher
from flows.training.rollout import RolloutDriver, TurnOutcome
from flows.training.shards import RolloutShards
from flows.training.trainer_handle import TRAINER_CALL_TIMEOUT_S, TrainerHandle
from flows.training.turn_placement import Dispatch
from resources.catalog import HardwareProfile, get_profile
from resources.cluster import ClusterHandle
from resources.device_model import DeviceModel
from resources.emulated import device_of, sequence_lengths
from resources.membership import Change, MembershipWatch, WorkerChange
from resources.placement import PlacementRecorder, placement_snapshot, task_stream_snapshot
from resources.pools import Tag
from resources.worker import RollArcWorkerPlugin, worker_report
from tasks.records import TrainBatch, TrainStats, Trajectory
from tasks.stages import Stages

logger = logging.getLogger(__name__)

LIVE_EVERY_S = 0.5
TRAIN_STEP_GRACE_S = 120  # an interrupted run waits this long for its running train step
IN_FLIGHT_STATES = (TrajState.ADMITTED, TrajState.ROLLING_OUT, TrajState.AWAITING_SCORE,
                    TrajState.SCORING, TrajState.IN_GROUP, TrajState.TRAINING)
WATCHDOG_EVERY_S = 1.0
# a future given up on (cancelled) that has not come back this long after is resolved as lost
# without it, so that nothing waits on a cancellation that never arrives
ABANDON_GRACE_S = 30.0


class PoolLost(RunFailing):
    """A pool had no worker for longer than ``cluster.pool_empty_timeout_s``."""


class TrainingRun:
    """Wires the cluster, the rollout driver, reward dispatch, the collector and the trainer."""

    def __init__(self, cfg: TrainConfig, cluster: ClusterHandle, run_dir: Path, sink: MetricSink,
                 reward_endpoint: str | None = None, stages: Stages | None = None,
                 on_transition: Callable[[Transition, TrajectoryLedger], None] | None = None,
                 publish_live: Callable[[dict], None] | None = None,
                 shards: Sequence[ClusterHandle] = ()):
        """``shards``: the further rollout shards' clusters of ``cluster.shards``
        (:func:`flows.training.shards.start_rollout_shards`); ``cluster`` is shard 0."""
        self.cfg, self.cluster, self.run_dir, self.sink = cfg, cluster, run_dir, sink
        if cfg.cluster.shards != 1 + len(shards):
            raise ConfigError(f"cluster.shards: {cfg.cluster.shards} shards configured, the run "
                              f"was given {1 + len(shards)} clusters (Session.start starts them)")
        self.shards: RolloutShards | None = None
        # the live figures of the dashboard page, sent at most every LIVE_EVERY_S
        self.publish_live = publish_live
        if cfg.reward.backend == RewardBackend.LAMBDA and cfg.reward.emulator.enabled and not reward_endpoint:
            raise ValueError("reward.emulator.enabled: pass the running emulation's URL as "
                             "reward_endpoint (flows.training.launch.start_reward_service starts it)")
        # workers joining and leaving from now on; and those that did before (between runs)
        self.membership = MembershipWatch(cluster.client)
        cluster.refresh()
        for tag in Tag:
            if not cluster.workers_with(tag):
                raise RuntimeError(f"no worker advertises the resource {tag}; start workers with "
                                   f"--resources \"{tag}=<slots>\"")
        self.stages = stages or Stages()
        # the reward config the workers' clients are built from, endpoint resolved
        self.reward_cfg = reward_client_settings(cfg.reward, reward_endpoint)
        if cfg.reward.judge is not None:  # its profile resolved here, config overrides included
            self.reward_cfg["judge_hardware"] = get_profile(
                cfg.reward.judge.profile, cfg.affinity.profiles).model_dump()
        self.client = cluster.client
        self.run_id = run_dir.name
        self.version = 0
        self.draw = GroupDraw(cfg.env_tasks, random.Random(cfg.seed))
        self.batch_trajectories = batch_trajectories(cfg)
        router = Router({str(t): cluster.workers_with(t) for t in Tag})
        self.ledger = TrajectoryLedger(on_transition)
        self.events = EventLoop(self.client)
        self.spans = StageSpans(self.run_id)  # Fine Performance Metrics by env task and stage
        # ends every task key: runs on one cluster (a notebook's) never share a key
        key_tag = f"@{uuid.uuid4().hex[:6]}"
        self.driver = RolloutDriver(self.client, cfg, router, self.ledger, self.stages,
                                    self.run_id, devices=self._worker_devices(), spans=self.spans,
                                    key_tag=key_tag)
        if shards:
            self.shards = RolloutShards(list(shards), cfg, self.ledger, self.stages, self.run_id,
                                        key_tag, self.driver, self.events, cluster,
                                        self._worker_devices, self.spans)
            logger.info("rollout over %d shards (schedulers): %s", cfg.cluster.shards,
                        [c.client.scheduler.address for c in (cluster, *shards)])
            if cfg.cluster.adaptive_env.enabled:
                logger.warning("cluster.adaptive_env scales shard 0's environment pool only")
        # every shard's rollout driver, shard 0's (self.driver) first
        self.drivers = [self.driver] if self.shards is None else self.shards.drivers
        # a rolling-out trajectory holds at most one task of each pool at a time
        self.pool_slots = self._pool_slots()
        self.rewards = RewardDispatcher(self.client, cfg, router, self.ledger, self.stages,
                                        self.run_id, self.batch_trajectories, spans=self.spans,
                                        key_tag=key_tag)
        self.collector = GroupCollector()
        self.trainer = TrainerHandle(self.client, cluster, self.stages, self.spans, key_tag)
        self.scaler = self._env_scaler()
        self.evaluator = Evaluator(cfg.env_tasks, cfg.eval.every_steps, cfg.eval.episodes,
                                   cfg.trainer.max_steps)
        self.loads_pending = 0
        # monolithic on emulated devices: training time-shares the engines' GPUs
        self.colocated_device = None
        if cfg.placement == Placement.MONOLITHIC and is_emulated(cfg.engine):
            profile, _ = pool_hardware(cfg)[effective_pools(cfg)[0].name]
            self.colocated_device = device_of(HardwareProfile(**profile), trainer_gpus(cfg),
                                              cfg.engine.device)
            if self.shards is not None:
                logger.warning("cluster.shards: training time-shares the GPUs of shard 0's "
                               "engines only")
        self.train_submitted_at = 0.0
        self.train_windows: list[tuple[float, float]] = []
        self.batch_info: dict = {}
        self.last_metrics: dict = {}
        self.staleness_hist: Counter[int] = Counter()  # of trained trajectories
        self.worker_versions: dict[str, int] = {}  # the version each inference worker loaded
        # called with (train step, trajectories) for each batch cut
        self.batch_callbacks: list[Callable[[int, list[Trajectory]], None]] = []
        self.t0: float | None = None
        self._paused_at: float | None = None
        self._live_sent = 0.0
        self._elapsed_before = 0.0  # training time of the run this one resumes
        self._train_future: Future | None = None
        self._publishing: Future | None = None  # weights on their way to the other shards
        self._training_ids: list[int] = []  # the batch of the running train step
        # periodic checkpoints being written: key -> (future, directory, driver state, started)
        self._checkpointing: dict[str, tuple[Future, Path, dict, float]] = {}
        self.checkpoint_s: list[float] = []  # each periodic checkpoint, submitted to written
        # futures given up on (a lost worker, a watchdog) -> when (perf_counter)
        self._abandoned: dict[str, float] = {}
        self._pinned: dict[str, tuple[str, Future]] = {}  # load/time-share key -> worker
        self._joining: dict[str, dict[str, float]] = {}  # inference workers loading weights
        # the last step was trained (its time): what is in flight has rollout.end_timeout_s
        self._ending_since: float | None = None
        self._end_detail = ""  # the drop detail of what the end's time limit cut
        self._empty_since: dict[Tag, float] = {}
        self._next_watchdog = 0.0
        # a worker left (its time), until the next batch cut, whose step then ends the recovery
        self._lost_at: float | None = None
        self._recovering_since: float | None = None
        self.recoveries_s: list[float] = []  # from a worker's loss to a step cut after it
        self.worker_changes: list[dict] = []
        self._restored_from: int | None = None

    def _env_scaler(self) -> EnvPoolScaler | None:
        """cluster.adaptive_env on the embedded cluster: the environment pool's scaler."""
        c = self.cfg.cluster.adaptive_env
        if not c.enabled:
            return None
        if self.cluster.cluster is None:
            logger.warning("cluster.adaptive_env needs the embedded cluster: ignored")
            return None
        env_workers = self.cluster.workers_with(Tag.CPU_ENV)
        pool = self.cluster.worker_pool[env_workers[0]]
        router = self.driver.router

        def names(address: str) -> str:
            return str(self.client.scheduler_info(n_workers=-1)["workers"][address]["name"])

        return EnvPoolScaler(
            c, self.cluster.cluster, pool, lambda: self.driver.env_seconds,
            lambda: {w: self.cluster.worker_tags[w][str(Tag.CPU_ENV)]
                     for w in router.workers_by_tag.get(str(Tag.CPU_ENV), [])
                     if self.cluster.worker_pool.get(w) == pool},
            self.driver.holds, router.remove, names)

    def _pool_slots(self) -> int:
        """Slots of the smallest rollout pool: a rolling-out trajectory holds at most one task
        of each at a time (at least 1, so that admission goes on while a pool is refilled);
        with rollout shards, the sum of each shard's."""
        if self.shards is not None:
            return self.shards.slots()
        return max(1, min(self.cluster.slots(t) for t in (Tag.GPU_COMPUTE, Tag.GPU_BANDWIDTH,
                                                           Tag.CPU_ENV)))

    def _worker_devices(self, cluster: ClusterHandle | None = None
                        ) -> dict[str, DeviceModel] | None:
        """rollout.dispatch=length_aware: each inference worker's engine (of ``cluster``,
        default shard 0's) as the device model sees it (None: the split, also when a worker's
        pool is unknown)."""
        cfg, cluster = self.cfg, cluster or self.cluster
        if cfg.rollout.dispatch is Dispatch.SPLIT:
            return None
        hardware, model = pool_hardware(cfg), device_model(cfg)
        devices = {}
        for tag in (Tag.GPU_COMPUTE, Tag.GPU_BANDWIDTH):
            for w in cluster.workers_with(tag):
                pool = cluster.worker_pool.get(w)
                if pool not in hardware:
                    logger.warning("worker %s is in no configured pool: turns are split", w)
                    return None
                profile, gpus = hardware[pool]
                devices[w] = DeviceModel(model, HardwareProfile(**profile), gpus,
                                         cfg.engine.device.mfu, cfg.engine.device.mbu)
        return devices

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
            self.version = self.trainer.resume(cfg.trainer.resume_from)
            driver_state = Path(cfg.trainer.resume_from).parent / checkpoints.DRIVER_STATE
            if driver_state.is_file():  # a periodic checkpoint: continue exactly
                self._restore_driver(json.loads(driver_state.read_text()))
            else:  # a final checkpoint: new group seeds, not a replay of the first run's
                self.draw = GroupDraw(cfg.env_tasks, random.Random(f"{cfg.seed}/{self.version}"))
            logger.info("resumed at policy version %d", self.version)
        timeout = self.cfg.cluster.startup_timeout_s
        for w, f in self.trainer.sync_weights(self.version).items():
            self.worker_versions[w] = f.result(timeout=timeout)
        if self.shards is not None:  # the plugin, then the weights, on the further shards
            self.worker_versions |= self.shards.setup(plugin, self.trainer.snapshot, timeout)

    @property
    def trainer_busy(self) -> bool:
        """A train step or a checkpoint is running on the trainer (no new step starts)."""
        return self._train_future is not None or bool(self._checkpointing)

    @property
    def elapsed_s(self) -> float:
        """Training wall time: from the first :meth:`train` call, pauses between calls not
        counted."""
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
        self._handlers = handlers = {FutureKind.TURN: self._on_turn, FutureKind.SCORE: self._on_score,
                    FutureKind.TRAIN: lambda ev: self._on_train(ev, progress),
                    FutureKind.LOAD_WEIGHTS: self._on_load,
                    FutureKind.TIME_SHARE: self._on_time_share,
                    FutureKind.CHECKPOINT: self._on_checkpoint,
                    FutureKind.PUBLISH: self._on_publish}
        while True:
            if until is not None and self.version >= until and not self.driver.stopping:
                self._send_live(force=True)
                self._paused_at = time.perf_counter()
                return False
            for fut in self.rewards.flush():
                self.events.track(fut, FutureKind.SCORE)
            self._maybe_train()
            self._admit()  # after a batch was cut: its room is refilled at once
            for fut in self.driver.flush():  # every turn made ready since: new, next, retried
                self.events.track(fut, FutureKind.TURN)
            if self.shards is not None:
                self.shards.flush()
            if self._events_empty() and not self._waiting_for_workers():
                if self.version < self.cfg.trainer.max_steps:
                    raise RuntimeError(
                        f"stalled at policy version {self.version}: nothing in flight and "
                        f"nothing admissible (rollout.max_in_flight={self.cfg.rollout.max_in_flight},"
                        f" pool slots={self.pool_slots})")
                break
            # workers that left since: their futures are given up before any result is fetched
            self._membership_and_watchdogs()
            for ev in self._next_batch():
                handlers[ev.kind](ev)
                self._abandoned.pop(ev.future.key, None)
            self._membership_and_watchdogs()
            for driver in self.drivers:
                driver.prune_closing()
            self._send_live()
            if self._end_overdue():
                break
        for driver in self.drivers:
            driver.wait_closing()
        # finished-but-untrained trajectories at the end are dropped as run_ended (evaluation
        # episodes too, when the end's time ran out)
        for evaluation in (False, True):
            for tid in self.ledger.live(evaluation):
                self.ledger.drop(tid, DropReason.RUN_ENDED, self._end_detail)
        self._send_live(force=True)
        return True

    def _end_overdue(self) -> bool:
        """After the last train step, the work in flight has ``rollout.end_timeout_s`` to
        finish; then what is left is cancelled (its trajectories dropped as ``run_ended``,
        their environments closed) and named in the log, and the run ends."""
        if self.version < self.cfg.trainer.max_steps:
            return False
        now = time.perf_counter()
        if self._ending_since is None:
            self._ending_since = now
        limit = self.cfg.rollout.end_timeout_s
        if now - self._ending_since <= limit:
            return False
        loops = self._event_loops()
        kinds: Counter[str] = Counter()
        for loop in loops:
            kinds.update(loop.pending_kinds())
        waiting = sum(len(d._ready) for d in self.drivers)
        self._end_detail = (f"still in flight rollout.end_timeout_s={limit:g} s after the last "
                            f"train step")
        logger.warning("the run's end waited %.0f s (rollout.end_timeout_s) for %s and %d "
                       "trajectories waiting for a worker (missing pools: %s): cancelled",
                       now - self._ending_since, dict(kinds) or "nothing", waiting,
                       [str(t) for t in self._missing_pools()] or "none")
        cancel([f for loop in loops for f in loop.pending()])
        for driver in self.drivers:
            driver.close_all()
        return True

    def _event_loops(self) -> list[EventLoop]:
        """Shard 0's event loop, or every rollout shard's."""
        return [self.events] if self.shards is None else self.shards.loops

    def _events_empty(self) -> bool:
        return self.events.empty() if self.shards is None else self.shards.empty()

    def _next_batch(self) -> list[Event]:
        """The finished futures of every shard (shard 0's alone without shards)."""
        if self.shards is None:
            return self.events.next_batch(wake=self._wake)
        return self.shards.next_batch(wake=self._wake)

    def _stop_rollout(self, reason: DropReason = DropReason.RUN_ENDED) -> None:
        for driver in self.drivers:
            driver.stop(reason)

    def abort(self, reason: DropReason = DropReason.INTERRUPTED) -> None:
        """Stop at once (an interrupt): cancel the work in flight, close the live environment
        instances, drop every live trajectory with ``reason``. A train step already running
        is let finish and recorded, so that the trainer and the metrics agree on the version.
        The cluster stays usable."""
        self._stop_rollout(reason)
        running = self._train_future
        finishing = {running.key} if running is not None else set()
        finishing |= set(self._checkpointing)
        pending = self.events.pending() if self.shards is None else self.shards.pending()
        cancel([f for f in pending if f.key not in finishing])
        if running is not None:
            try:
                self._record_train(running.result(timeout=TRAIN_STEP_GRACE_S))
            except Exception as exc:  # cancelled before it started, failed, or too slow
                logger.warning("the train step in flight did not finish: %s", exc)
                self._drop_training(reason, f"{exc!r}"[:200])
            self._train_future = None
        for fut, directory, state, _ in self._checkpointing.values():  # let a periodic one land
            try:
                fut.result(timeout=TRAIN_STEP_GRACE_S)
                self._finish_checkpoint(directory, state)
            except Exception as exc:
                logger.warning("checkpoint %s not finished: %s", directory, exc)
        self._checkpointing.clear()
        for driver in self.drivers:
            driver.close_all()
        for driver in self.drivers:
            driver.wait_closing(timeout=30)
        for evaluation in (False, True):
            for tid in self.ledger.live(evaluation):
                self.ledger.drop(tid, reason)
        self._send_live(force=True)

    def live_figures(self) -> dict:
        """What the dashboard page shows besides the metric rows."""
        pools: Counter[str] = Counter()
        for w, n in self.driver.router.load.items():
            pools[self.cluster.worker_pool.get(w, w)] += max(n, 0)
        accounts = self.ledger.summary()
        states = {str(s): self.ledger.count(s) for s in IN_FLIGHT_STATES}
        states["trained"] = accounts["trained"]
        return {"states": states, "dropped": accounts["dropped"],
                "in_flight_per_pool": dict(sorted(pools.items())),
                "staleness_hist": {str(k): v for k, v in sorted(self.staleness_hist.items())},
                "worker_versions": {f"{self.cluster.worker_pool.get(w, '?')} {w}": v
                                    for w, v in sorted(self.worker_versions.items())},
                "policy_version": self.version}

    def _send_live(self, force: bool = False) -> None:
        now = time.perf_counter()
        if self.publish_live is None or (not force and now - self._live_sent < LIVE_EVERY_S):
            return
        self._live_sent = now
        self.publish_live(self.live_figures())

    def save(self) -> str:
        return self.trainer.save(str(self.run_dir.resolve()), self.version)

    # -- decisions --------------------------------------------------------------------------
    def _admission(self) -> AdmissionState:
        return admission_state(self.cfg, self.ledger.rolling_out, self.ledger.unconsumed,
                               self.pool_slots, self.trainer_busy, self.loads_pending > 0,
                               self.driver.stopping)

    def _admit(self) -> None:
        """Start whole groups while they fit in the room admission control gives."""
        for gid, env_task, seed in self.draw.take(admission_room(self._admission())):
            self.collector.open_group(gid, env_task.name, env_task.group_size)
            if self.shards is not None:  # the shard with the most free room
                self.shards.start_group(gid, env_task, seed)
                continue
            for _ in range(env_task.group_size):
                self.driver.start(gid, env_task, seed)

    def _maybe_train(self) -> None:
        if (self.trainer_busy or self.trainer.worker is None  # lost: batches wait for it
                or self.version >= self.cfg.trainer.max_steps):
            return
        scoring = (self.ledger.count(TrajState.AWAITING_SCORE)
                   + self.ledger.count(TrajState.SCORING))
        n = groups_to_cut(self.cfg.mode, self.collector.ready_groups,
                          self.cfg.trainer.groups_per_step, self.ledger.rolling_out, scoring,
                          self.collector.open_groups)
        if n is None:
            return
        d = self.collector.take_batch(n, self.version, self.cfg.rollout.max_staleness)
        self._drop(d.stale, DropReason.STALE)
        self._drop(d.orphaned, DropReason.GROUP_INCOMPLETE)
        if not d.samples:
            return
        self._train_future = self.events.track(
            self.trainer.train(TrainBatch(d.samples, self.version)), FutureKind.TRAIN)
        if self.colocated_device is not None:
            seconds = self.colocated_device.train_step_time(sequence_lengths(d.samples))
            for w, f in zip(self.trainer.inference_workers,
                            self.trainer.time_share(self.version, seconds), strict=True):
                self.events.track(f, FutureKind.TIME_SHARE)
                self._pinned[f.key] = (w, f)
        self._training_ids = [int(t.traj_id) for t in d.trajectories]
        # the first batch cut after a worker was lost: its step is the run making progress
        self._recovering_since, self._lost_at = self._lost_at, None
        for tid in self._training_ids:
            self.ledger.transition(tid, TrajState.TRAINING)
        self.staleness_hist.update(d.staleness)
        for callback in self.batch_callbacks:
            callback(self.version + 1, d.trajectories)  # as train/step will name it
        self.train_submitted_at = time.perf_counter()
        self.batch_info = batch_metrics(d.trajectories, d.staleness, len(d.stale))

    def _drop(self, trajs: list[Trajectory], reason: DropReason) -> None:
        for t in trajs:
            self.ledger.drop(int(t.traj_id), reason)

    def _group_lost_member(self, group_id: str) -> None:
        self._drop(self.collector.drop_member(group_id), DropReason.GROUP_INCOMPLETE)

    # -- workers joining and leaving, watchdogs ----------------------------------------------
    def _wake(self) -> bool:
        """The event loop stops waiting: a worker came or went, or a watchdog is due."""
        return (self.membership.pending() or time.perf_counter() >= self._next_watchdog
                or (self.shards is not None and self.shards.changes_pending()))

    def _waiting_for_workers(self) -> bool:
        """Work is held back until a pool gets a worker again (or the trainer comes back)."""
        return bool(self._missing_pools()) or any(d._ready for d in self.drivers)

    def _missing_pools(self) -> list[Tag]:
        """The tags no serving worker carries now. A joining inference worker does not count
        until it has loaded the weights: turns cannot go to it, so a joiner that never loads
        must not hide an empty pool from cluster.pool_empty_timeout_s."""
        return [tag for tag in Tag if not (
            self.trainer.worker is not None if tag is Tag.TRAINER
            else self.driver.router.has(str(tag)))]

    def _membership_and_watchdogs(self) -> None:
        for change in self.membership.take():
            if change.change is Change.LEFT:
                self._worker_left(change)
            else:
                self._worker_joined(change)
        if self.shards is not None:
            self._shard_membership()
        now = time.perf_counter()
        if now < self._next_watchdog:
            return
        self._next_watchdog = now + WATCHDOG_EVERY_S
        for driver in self.drivers:
            self._cancel(driver.overdue(self.cfg.rollout.turn_timeout_s))
        self._resolve_unanswered()
        self._load_joiners()
        if self.scaler is not None:
            self.scaler.step(now)
        missing = self._missing_pools()
        for tag in Tag:
            if tag not in missing:
                self._empty_since.pop(tag, None)
                continue
            since = self._empty_since.setdefault(tag, now)
            if now - since > self.cfg.cluster.pool_empty_timeout_s:
                self._stop_on_empty_pool(tag, now - since)
        if self.shards is not None:
            for k, tag, since in self.shards.empty_pools(now):
                if now - since > self.cfg.cluster.pool_empty_timeout_s:
                    self._stop_on_empty_pool(tag, now - since, f" on rollout shard {k}")

    def _load_joiners(self) -> None:
        """Every joining inference worker has a weight load on its way while weights exist: one
        that joined while none could be sent (the trainer lost), or whose load was lost, gets
        one now rather than with a next version that may never come (the end of the run)."""
        if self.trainer.snapshot is None or self.trainer.worker is None:
            return
        loading = {w for w, _ in self._pinned.values()}
        for worker in self._joining:
            if worker not in loading and worker in self.trainer.inference_workers:
                logger.warning("worker %s joined and has no weight load in flight: loading v%d",
                               worker, self.version)
                self._load_weights({worker: self.trainer.load_on(worker, self.version)})

    def _resolve_unanswered(self) -> None:
        """Futures given up on (cancelled) that did not come back within ABANDON_GRACE_S: the
        event loops stop waiting for them and their handlers take them as lost now."""
        now = time.perf_counter()
        late = {k for k, at in self._abandoned.items() if now - at > ABANDON_GRACE_S}
        if not late:
            return
        for ev in [ev for loop in self._event_loops() for ev in loop.forget(late)]:
            logger.warning("%s was cancelled %.0f s ago and has not come back: taken as lost",
                           ev.future.key, now - self._abandoned[ev.future.key])
            self._handlers[ev.kind](ev)
            self._abandoned.pop(ev.future.key, None)
        for key in late:  # came back meanwhile, or never tracked
            self._abandoned.pop(key, None)

    def _stop_on_empty_pool(self, tag: Tag, seconds: float, where: str = "") -> None:
        """Rather than wait for ever: the run stops (the caller writes a checkpoint when the
        trainer is there to write it)."""
        raise PoolLost(f"no worker has advertised {tag}{where} for {seconds:.0f} s "
                       f"(cluster.pool_empty_timeout_s={self.cfg.cluster.pool_empty_timeout_s:g})"
                       f" at policy version {self.version}")

    def _note_change(self, what: str, worker: str, detail: str = "",
                     pool: str | None = None) -> None:
        pool = pool or self.cluster.worker_pool.get(worker, "?")
        logger.warning("worker %s (%s) %s%s", worker, pool, what, f": {detail}" if detail else "")
        self.worker_changes.append({"at_s": round(self.elapsed_s, 3), "worker": worker,
                                    "pool": pool, "change": what, "detail": detail})

    def _cancel(self, futures: list[Future]) -> None:
        """Give up on ``futures``: they come back through the event loop as cancelled, and
        their handlers see their keys in ``_abandoned``."""
        if futures:
            now = time.perf_counter()
            self._abandoned.update((f.key, now) for f in futures)
            cancel(futures)

    def _worker_left(self, change: WorkerChange) -> None:
        worker = change.address
        tags = self.cluster.remove_worker(worker)
        if not tags:
            return  # not one of the run's workers
        if self.scaler is not None and worker in self.scaler.retired:  # drained, not lost
            self.driver.router.remove(worker)
            self._note_change("retired", worker)
            self.pool_slots = self._pool_slots()
            return
        self._note_change("left", worker, ", ".join(sorted(tags)))
        if self._lost_at is None:
            self._lost_at = change.at
        self.driver.router.remove(worker)
        self.trainer.inference_workers.pop(worker, None)
        self._joining.pop(worker, None)
        self._rollout_worker_lost(self.driver, worker)
        self._cancel(self.rewards.worker_lost(worker))
        if worker == self.trainer.worker:
            self._trainer_lost()
        self.pool_slots = self._pool_slots()

    def _shard_membership(self) -> None:
        """Workers that left or joined a further rollout shard (see flows.training.shards)."""
        for shard, change in self.shards.membership_changes():
            worker = change.address
            self._note_change(change.change.value, worker, f"rollout shard {shard.index}",
                              shard.cluster.worker_pool.get(worker, "?"))
            if change.change is Change.LEFT:
                self._rollout_worker_lost(shard.driver, worker)
            elif worker in shard.joining:  # gets work once it loaded the weights
                load = self.shards.load_on(shard, worker)
                if load is not None:  # else with the next version
                    self._load_weights({worker: load}, shard.events)
            self.pool_slots = self._pool_slots()

    def _rollout_worker_lost(self, driver: RolloutDriver, worker: str) -> None:
        """A worker of ``driver``'s shard left (already off its router): its turns are
        abandoned (their trajectories restart or drop), its weight loads given up."""
        self.worker_versions.pop(worker, None)
        futures, out = driver.worker_lost(worker)
        self._cancel(futures)
        self._on_turn_outcome(out)
        self._cancel([f for w, f in self._pinned.values() if w == worker])

    def _worker_joined(self, change: WorkerChange) -> None:
        worker, tags = change.address, {t: n for t, n in change.tags.items() if n > 0}
        if worker in self.cluster.worker_tags:
            return
        if tags:
            self.cluster.add_worker(worker, change.name, tags)
        else:  # it may advertise its hardware: then it gets its pool's tags
            tags = self.cluster.adopt(worker)
            if not tags:
                return
        self._note_change("joined", worker, ", ".join(sorted(tags)))
        self.pool_slots = self._pool_slots()
        inference = self.trainer.inference_tag(tags)
        if inference is not None:  # gets work once it has loaded the current weights
            self.trainer.inference_workers[worker] = inference
            self._joining[worker] = tags
            if self.trainer.snapshot is not None and self.trainer.worker is not None:
                self._load_weights({worker: self.trainer.load_on(worker, self.version)})
        else:
            self.driver.router.add(worker, list(tags))
        if str(Tag.TRAINER) in tags and self.trainer.worker is None:
            self._restore_trainer(worker)

    def _trainer_lost(self) -> None:
        """The trainer's worker left: its train step and checkpoint are abandoned, the batch
        in training dropped; the trainer is rebuilt from the newest checkpoint on another
        worker carrying the tag, now or when one joins."""
        self.trainer.worker = None
        self._cancel([f for f in (self._train_future,) if f is not None])
        self._cancel([fut for fut, *_ in self._checkpointing.values()])
        self._train_future = None
        self._checkpointing.clear()
        if self._publishing is not None:  # weights it was publishing for the other shards
            self._cancel([self._publishing])
            self._publishing = None
        # loads of weights published on it: a load that has not fetched them yet would wait
        # for ever on a publish that Dask can only recompute there; the restored trainer
        # publishes again to every inference worker
        self._cancel([f for _, f in self._pinned.values()])
        self._drop_training(DropReason.TRAINER_LOST, "the trainer's worker left")
        spare = self.cluster.workers_with(Tag.TRAINER)
        if spare:
            self._restore_trainer(spare[0])

    def _drop_training(self, reason: DropReason, detail: str) -> None:
        for tid in self._training_ids:
            self.ledger.drop(tid, reason, detail)
        self._training_ids = []

    def _restore_trainer(self, worker: str) -> None:
        found = checkpoints.latest(self.run_dir)
        if found is None and self.version > 0:
            raise RunFailing(f"the trainer's worker was lost at policy version {self.version} "
                             "and the run has no checkpoint to rebuild it from (set "
                             "trainer.checkpoint_every)")
        restored = 0 if found is None else json.loads(
            (found / checkpoints.DRIVER_STATE).read_text())["version"]
        self.trainer.restore(worker, None if found is None else
                             str(found / checkpoints.TRAINER_STATE), self.version)
        self._restored_from = restored
        self._note_change("restored the trainer", worker,
                          f"from the checkpoint of v{restored}, numbering on from "
                          f"v{self.version}")
        # joined inference workers waiting for weights get the restored trainer's
        self._load_weights(self.trainer.sync_weights(self.version))
        self._fan_out_weights()

    # -- completions ------------------------------------------------------------------------
    def _on_turn(self, ev: Event) -> None:
        driver = self.driver if ev.shard == 0 else self.shards.driver(ev.shard)
        self._on_turn_outcome(driver.on_turn(ev.future, ev.result if ev.ok else None))

    def _on_turn_outcome(self, out: TurnOutcome) -> None:
        for rec, traj in out.finished:
            if rec.evaluation:
                self._on_eval_episode(rec.eval_round, traj)
            else:
                self.rewards.queue(traj)
        for rec in out.dropped:
            if rec.evaluation:
                self._on_eval_episode(rec.eval_round, None)
            elif not self.driver.stopping:  # once stopping, its group ends with the run
                self._group_lost_member(rec.group_id)

    def _on_score(self, ev: Event) -> None:
        outcome = self.rewards.on_scored(ev.future, ev.result)
        for t in outcome.scored:
            self._drop(self.collector.add(t), DropReason.GROUP_INCOMPLETE)
        for t in outcome.dropped:
            self._group_lost_member(t.group_id)

    def _on_train(self, ev: Event, progress: ProgressLine) -> None:
        self._train_future = None
        if ev.future.key in self._abandoned:  # lost with the trainer's worker (dropped then)
            return
        if self._lost(ev):  # its result lost with the trainer's worker: the batch is
            # dropped; the worker's departure (an event of its own) rebuilds the trainer
            self._drop_training(DropReason.TRAINER_LOST, "the train step's result was lost")
            return
        if ev.future.status != "finished":  # a trainer failure ends the run loudly
            raise RuntimeError(f"{ev.future.key} failed: {ev.future.exception()!r}")
        self._record_train(ev.result)
        progress.update(self.last_metrics, [t.name for t in self.cfg.env_tasks])
        if self.version >= self.cfg.trainer.max_steps:
            self._stop_rollout()
        self._load_weights(self.trainer.sync_weights(self.version))
        self._fan_out_weights()
        if self.evaluator.due(self.version):
            for ep in self.evaluator.start(self.version):
                self.driver.start(ep.group_id, ep.env_task, ep.seed, eval_round=ep.round_id)
        self._maybe_checkpoint()

    def _record_train(self, stats: TrainStats) -> None:
        """A train step's result: the new version and its metrics row."""
        self.train_windows.append((self.train_submitted_at, time.perf_counter()))
        self.version = stats.policy_version
        for tid in self._training_ids:
            self.ledger.transition(tid, TrajState.TRAINED)
        self._training_ids = []
        faults = {}
        if self._recovering_since is not None:  # a worker's loss to this step, cut after it
            self.recoveries_s.append(time.perf_counter() - self._recovering_since)
            faults["faults/recovery_s"] = self.recoveries_s[-1]
            self._recovering_since = None
        if self._restored_from is not None:
            faults["train/restored_from"], self._restored_from = self._restored_from, None
        metrics = {"train/step": self.version, **stats.log("train"), **self.batch_info,
                   **perf_metrics(self.elapsed_s, self.ledger.summary()),
                   **self.rewards.metrics(), **faults}
        self.sink.log(metrics)
        self.last_metrics = metrics

    # -- checkpoints ------------------------------------------------------------------------
    def _maybe_checkpoint(self) -> None:
        """After the first step and every ``trainer.checkpoint_every`` steps: the trainer writes
        its checkpoint (no train step starts meanwhile, so it is of this version), then the
        driver its state. The first one makes the trainer's loss survivable from the start."""
        every = self.cfg.trainer.checkpoint_every
        if (not every or (self.version % every and self.version != 1)
                or self.version >= self.cfg.trainer.max_steps or self.trainer.worker is None):
            return
        directory = checkpoints.step_dir(self.run_dir, self.version)
        fut = self.trainer.checkpoint(str(directory), self.version)
        self._checkpointing[fut.key] = (fut, directory, self.driver_state(),
                                        time.perf_counter())
        self.events.track(fut, FutureKind.CHECKPOINT)

    def _on_checkpoint(self, ev: Event) -> None:
        entry = self._checkpointing.pop(ev.future.key, None)
        if entry is None or self._lost(ev):  # lost with the trainer's worker
            return
        _, directory, state, started = entry
        # the trainer's time on it: no train step starts meanwhile
        self.checkpoint_s.append(time.perf_counter() - started)
        if ev.future.status != "finished":
            raise RuntimeError(f"checkpoint {directory} failed: {ev.future.exception()!r}")
        self._finish_checkpoint(directory, state)

    def _finish_checkpoint(self, directory: Path, state: dict) -> None:
        checkpoints.write_json_atomic(directory / checkpoints.DRIVER_STATE, state)
        checkpoints.prune(self.run_dir, self.cfg.trainer.keep_checkpoints)
        logger.info("checkpoint at policy version %d: %s", state["version"], directory)

    def checkpoint_now(self) -> Path:
        """A checkpoint of the current version, written before returning (a graceful stop)."""
        directory = checkpoints.step_dir(self.run_dir, self.version)
        self.trainer.checkpoint(str(directory), self.version).result(
            timeout=TRAINER_CALL_TIMEOUT_S)
        self._finish_checkpoint(directory, self.driver_state())
        return directory

    def driver_state(self) -> dict:
        """What the driver needs to continue a run exactly: the env-task sampler, the
        trajectory ids, the training time so far."""
        return {"version": self.version, "draw": self.draw.state(),
                "next_trajectory": self.driver._next_id,
                "next_eval_trajectory": self.driver._next_eval_id,
                "elapsed_s": self.elapsed_s}

    def _restore_driver(self, state: dict) -> None:
        self.draw.restore(state["draw"])
        self.driver._next_id = int(state["next_trajectory"])
        self.driver._next_eval_id = int(state["next_eval_trajectory"])
        self._elapsed_before = float(state["elapsed_s"])

    def _load_weights(self, loads: dict[str, Future], events: EventLoop | None = None) -> None:
        for w, f in loads.items():
            (events or self.events).track(f, FutureKind.LOAD_WEIGHTS)
            self._pinned[f.key] = (w, f)
            self.loads_pending += 1

    def _fan_out_weights(self) -> None:
        """Rollout shards: the weights just published go to the further shards once they are
        ready (a PUBLISH event); counted as a load in flight until then."""
        if self.shards is not None:
            self._publishing = self.events.track(self.trainer.snapshot, FutureKind.PUBLISH)
            self.loads_pending += 1

    def _on_publish(self, ev: Event) -> None:
        self.loads_pending -= 1
        if self._publishing is ev.future:
            self._publishing = None
        if self._lost(ev):  # with the trainer's worker: the rebuilt trainer publishes again
            logger.warning("weights %s lost before reaching the rollout shards", ev.future.key)
            return
        if ev.future.status != "finished":
            raise RuntimeError(f"{ev.future.key} failed: {ev.future.exception()!r}")
        for events, loads in self.shards.load_weights(ev.result):
            self._load_weights(loads, events)

    def _lost(self, ev: Event) -> bool:
        """Given up on with a lost worker, or its result lost with one (a task that raised is
        not lost: it failed)."""
        return ev.future.key in self._abandoned or (ev.result is None
                                                    and ev.future.status != "error")

    def _on_load(self, ev: Event) -> None:
        self.loads_pending -= 1
        worker, _ = self._pinned.pop(ev.future.key)
        if self._lost(ev):  # its worker left
            return
        if ev.future.status != "finished":
            raise RuntimeError(f"weight load {ev.future.key} failed: {ev.future.exception()}")
        self.worker_versions[worker] = int(ev.result)
        tags = self._joining.pop(worker, None)
        if tags is not None:  # a joined inference worker holds the weights: give it work
            self.driver.router.add(worker, [t for t, n in tags.items() if n > 0])
            self._note_change("serving", worker, f"loaded v{int(ev.result)}")
        elif self.shards is not None and (shard := self.shards.loaded(worker)) is not None:
            self._note_change("serving", worker, f"loaded v{int(ev.result)}",
                              shard.cluster.worker_pool.get(worker, "?"))

    def _on_time_share(self, ev: Event) -> None:
        self._pinned.pop(ev.future.key, None)
        if self._lost(ev):
            return
        if ev.future.status != "finished":
            raise RuntimeError(f"{ev.future.key} failed: {ev.future.exception()!r}")

    def _on_eval_episode(self, round_id: int, traj: Trajectory | None) -> None:
        metrics = self.evaluator.on_episode(round_id, traj)
        if metrics is not None:
            self.sink.log(metrics | {"perf/elapsed_s": self.elapsed_s})

    # -- report -----------------------------------------------------------------------------
    def summary(self) -> dict:
        placement = self.client.run_on_scheduler(placement_snapshot)
        by_pool: dict[str, Counter] = defaultdict(Counter)
        for stage, per_worker in placement.items():
            for w, n in per_worker.items():
                by_pool[stage][self.cluster.worker_pool.get(w, w)] += n
        # a worker lost at the very end is skipped, not waited on
        reports = {w: r for w, r in self.client.run(worker_report, on_error="return").items()
                   if isinstance(r, dict)}
        live_envs = sum(r.get("envs", {}).get("live", 0) for r in reports.values())
        if self.shards is not None:
            live_envs += self.shards.live_envs()
        accounts = self.ledger.summary()
        turns = [t for d in self.drivers for t in d.turn_log]  # with metrics.task_stream
        n_turns = sum(d.turn_totals[0] for d in self.drivers)
        submitted: Counter[str] = Counter()
        truncated: Counter[str] = Counter()
        restarts: Counter[str] = Counter()
        for d in self.drivers:
            submitted.update(d.stage_submitted)
            truncated.update(d.truncated)
            restarts.update(d.restarts)
        t0 = self.t0 or 0.0
        if self.cfg.metrics.task_stream:
            stream = self.client.run_on_scheduler(task_stream_snapshot)
            (self.run_dir / "task_stream.json").write_text(json.dumps(
                {"tasks": stream, "turns": turns,
                 "workers": {a: self.cluster.worker_pool.get(a, a) for a in reports}}))
        return {
            "final_metrics": self.last_metrics,
            "policy_version": self.version,
            "trajectories": {k: accounts[k] for k in ("started", "finished", "trained",
                                                      "dropped")}
            | {"truncated": dict(truncated)},
            "drop_details": self.ledger.drop_details[:20],
            "evaluation": {"episodes_started": accounts["evaluation"]["started"],
                           "dropped": accounts["evaluation"]["dropped"],
                           "last": self.evaluator.last},
            "tasks_per_stage_per_pool": {k: dict(v) for k, v in sorted(by_pool.items())},
            "rollout_tasks_submitted": dict(submitted),
            "shards": [{"shard": 0, "rollout_tasks_submitted": dict(submitted)}]
            if self.shards is None else self.shards.summary(),
            "reward": self.rewards.stats.summary() | {
                "backend": self.cfg.reward.backend,
                "endpoint": self.reward_cfg["endpoint_url"] or "aws",
                "score_tasks": self.rewards.score_tasks,
                "lost": self.rewards.lost()},
            "live_env_instances_at_end": live_envs,
            "faults": {"worker_changes": self.worker_changes,
                       "recovery_s": [round(s, 3) for s in self.recoveries_s],
                       "restarted": dict(restarts),
                       "score_tasks_resent": sum(self.rewards.resent.values()),
                       "checkpoints": {"every": self.cfg.trainer.checkpoint_every,
                                       "written": len(self.checkpoint_s),
                                       "mean_s": round(sum(self.checkpoint_s)
                                                       / max(len(self.checkpoint_s), 1), 3)}},
            "env_pool": [] if self.scaler is None else [
                dict(h, at=round(h["at"] - t0, 2)) for h in self.scaler.history],
            "turns": {"count": n_turns,
                      "wall_s_mean": sum(d.turn_totals[1] for d in self.drivers)
                      / max(n_turns, 1),
                      "emulated_wait_s_mean": sum(d.turn_totals[2] for d in self.drivers)
                      / max(n_turns, 1)},
            "workers": {a: dict(r, pool=self.cluster.worker_pool.get(a, a))
                        for a, r in reports.items()},
            "train_windows_s": [(a - t0, b - t0) for a, b in self.train_windows],
            "elapsed_s": self.elapsed_s,
        }

