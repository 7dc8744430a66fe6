"""Workers joining and leaving a run, and the run's watchdogs.

:class:`WorkerChanges` is an extension of one :class:`flows.training.run.TrainingRun` (as
``distributed``'s scheduler extensions are of the scheduler): it takes the changes the
scheduler announces (:mod:`resources.membership`), and every second runs the watchdogs — turns
overdue, cancellations that never came back, joined workers without weights, the environment
pool's scaler, pools without a worker. The decisions are the run core's
(:mod:`flows.training.core`); this carries them out on the run's parts.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from flows.training import checkpoints
from flows.training.core import RestoreTrainer
from flows.training.rollout import RolloutDriver, TurnOutcome
from resources.membership import Change, WorkerChange
from resources.pools import Tag

if TYPE_CHECKING:
    from distributed import Future

    from flows.config import TrainConfig
    from flows.training.core import RunCore
    from flows.training.env_scaler import EnvPoolScaler
    from flows.training.events import Abandoned, Event, EventLoop
    from flows.training.reward_bursts import RewardBursts
    from flows.training.shards import RolloutShards
    from flows.training.trainer_handle import TrainerHandle
    from flows.training.weights import WeightLoads
    from resources.cluster import ClusterHandle
    from resources.membership import MembershipWatch

logger = logging.getLogger(__name__)

WATCHDOG_EVERY_S = 1.0


class ChangingRun(Protocol):
    """The parts of a run that workers joining and leaving change
    (:class:`flows.training.run.TrainingRun` has them all)."""

    cfg: TrainConfig
    cluster: ClusterHandle
    run_dir: Path
    membership: MembershipWatch
    core: RunCore
    abandoned: Abandoned
    driver: RolloutDriver
    drivers: list[RolloutDriver]
    shards: RolloutShards
    rewards: RewardBursts
    trainer: TrainerHandle
    weights: WeightLoads
    scaler: EnvPoolScaler | None

    @property
    def version(self) -> int: ...

    @property
    def elapsed_s(self) -> float: ...

    def rollout_slots(self) -> int: ...

    def event_loops(self) -> list[EventLoop]: ...

    def handle(self, ev: Event) -> None: ...

    def trainer_futures_lost(self) -> list[Future]: ...

    def on_turn_outcome(self, out: TurnOutcome) -> None: ...


class WorkerChanges:
    def __init__(self, run: ChangingRun):
        self.run = run
        self.log: list[dict] = []  # every change: when, worker, pool, what (summary.json)
        self._next_watchdog = 0.0
        self._restored_from: int | None = None  # a restore's checkpoint, until the next step

    def wake(self) -> bool:
        """The event loop stops waiting: a worker came or went, or a watchdog is due."""
        run = self.run
        return (run.membership.pending() or time.perf_counter() >= self._next_watchdog
                or run.shards.changes_pending())

    def waiting(self) -> bool:
        """Work is held back until a pool gets a worker again (or the trainer comes back)."""
        return bool(self.missing_pools()) or any(d.waiting for d in self.run.drivers)

    def missing_pools(self) -> list[Tag]:
        """The tags no serving worker carries now. A joining inference worker does not count
        until it has loaded the weights: turns cannot go to it, so a joiner that never loads
        must not hide an empty pool from cluster.pool_empty_timeout_s."""
        run = self.run
        return [tag for tag in Tag if not (
            run.trainer.worker is not None if tag is Tag.TRAINER
            else run.driver.pool_workers.has(str(tag)))]

    def restored_from(self) -> int | None:
        """The checkpoint version of a trainer restore since the last call (a metrics field)."""
        found, self._restored_from = self._restored_from, None
        return found

    def poll(self) -> None:
        """The changes announced since, then the watchdogs when they are due."""
        run = self.run
        for change in run.membership.take():
            if change.change is Change.LEFT:
                self._left(change)
            else:
                self._joined(change)
        self._shard_changes()
        now = time.perf_counter()
        if now < self._next_watchdog:
            return
        self._next_watchdog = now + WATCHDOG_EVERY_S
        for driver in run.drivers:
            run.abandoned.cancel(driver.overdue(run.cfg.rollout.turn_timeout_s))
        for ev, ago in run.abandoned.overdue(run.event_loops()):
            logger.warning("%s was cancelled %.0f s ago and has not come back: taken as lost",
                           ev.future.key, ago)
            run.handle(ev)
        run.weights.load_joiners(run.version)
        if run.scaler is not None:
            run.scaler.step(now)
        run.core.watch_pools(self.missing_pools(), now)
        for k, missing in run.shards.missing_pools().items():
            run.core.watch_pools(missing, now, f" on rollout shard {k}")

    def note(self, what: str, worker: str, detail: str = "", pool: str | None = None) -> None:
        pool = pool or self.run.cluster.worker_pool.get(worker, "?")
        logger.warning("worker %s (%s) %s%s", worker, pool, what, f": {detail}" if detail else "")
        self.log.append({"at_s": round(self.run.elapsed_s, 3), "worker": worker,
                         "pool": pool, "change": what, "detail": detail})

    def serving(self, worker: str, tags: dict[str, float], version: int,
                pool: str | None) -> None:
        """An inference worker that joined holds the weights of ``version``: it gets work (on
        a further shard, whose ``pool`` is given, its shard's pool workers took it already)."""
        if pool is None:
            self.run.driver.pool_workers.add(worker, list(tags))
        self.note("serving", worker, f"loaded v{version}", pool)

    # -- changes ---------------------------------------------------------------------------
    def _left(self, change: WorkerChange) -> None:
        run, worker = self.run, change.address
        tags = run.cluster.remove_worker(worker)
        if not tags:
            return  # not one of the run's workers
        run.driver.pool_workers.remove(worker)
        if run.scaler is not None and worker in run.scaler.retired:  # drained, not lost
            self.note("retired", worker)
        else:
            self.note("left", worker, ", ".join(sorted(tags)))
            run.core.worker_lost(change.at)
            self._rollout_worker_lost(run.driver, worker)
            run.abandoned.cancel(run.rewards.worker_lost(worker))
            if worker == run.trainer.worker:
                self._trainer_lost()
        run.core.pool_slots = run.rollout_slots()

    def _joined(self, change: WorkerChange) -> None:
        run = self.run
        worker, tags = change.address, {t: n for t, n in change.tags.items() if n > 0}
        if worker in run.cluster.worker_tags:
            return
        if tags:
            run.cluster.add_worker(worker, change.name, tags)
        else:  # it may advertise its hardware: then it gets its pool's tags
            tags = run.cluster.adopt(worker)
            if not tags:
                return
        self.note("joined", worker, ", ".join(sorted(tags)))
        run.core.pool_slots = run.rollout_slots()
        if run.trainer.inference_tag(tags) is not None:  # gets work once it holds the weights
            run.weights.joined(worker, tags, run.version)
        else:
            run.driver.pool_workers.add(worker, list(tags))
        if str(Tag.TRAINER) in tags and run.trainer.worker is None:
            self._restore(run.core.trainer_joined(
                worker, checkpoints.latest(run.run_dir) is not None))

    def _shard_changes(self) -> None:
        """Workers that left or joined a further rollout shard (see flows.training.shards)."""
        run = self.run
        for shard, change in run.shards.membership_changes():
            worker = change.address
            self.note(change.change.value, worker, f"rollout shard {shard.index}",
                      shard.cluster.worker_pool.get(worker, "?"))
            if change.change is Change.LEFT:
                self._rollout_worker_lost(shard.driver, worker)
            elif worker in shard.joining:  # gets work once it loaded the weights
                load = run.shards.load_on(shard, worker)
                if load is not None:  # else with the next version
                    run.weights.load({worker: load}, shard.events)
            run.core.pool_slots = run.rollout_slots()

    def _rollout_worker_lost(self, driver: RolloutDriver, worker: str) -> None:
        """A worker of ``driver``'s shard left (already off its pool_workers): its turns are
        abandoned (their trajectories restart or drop), its weight loads given up."""
        futures, out = driver.worker_lost(worker)
        self.run.abandoned.cancel(futures)
        self.run.on_turn_outcome(out)
        self.run.weights.worker_left(worker)

    def _trainer_lost(self) -> None:
        """The trainer's worker left: its train step and checkpoints are abandoned, the batch
        in training dropped; the trainer is rebuilt from the newest checkpoint on another
        worker carrying the tag, now or when one joins."""
        run = self.run
        run.trainer.lost()
        run.abandoned.cancel(run.trainer_futures_lost())
        run.weights.trainer_lost()
        spare = run.cluster.workers_with(Tag.TRAINER)
        self._restore(run.core.trainer_lost(spare[0] if spare else None,
                                            checkpoints.latest(run.run_dir) is not None))

    def _restore(self, instructions: list) -> None:
        for ins in instructions:
            if not isinstance(ins, RestoreTrainer):
                continue
            run = self.run
            found = checkpoints.latest(run.run_dir)
            restored = 0 if found is None else json.loads(
                (found / checkpoints.DRIVER_STATE).read_text())["version"]
            run.trainer.restore(ins.worker, None if found is None else
                                str(found / checkpoints.TRAINER_STATE), ins.version)
            self._restored_from = restored
            self.note("restored the trainer", ins.worker,
                      f"from the checkpoint of v{restored}, numbering on from v{ins.version}")
            # joined inference workers waiting for weights get the restored trainer's
            run.weights.publish(ins.version)
