"""The run core: a training run's decisions, without Dask.

Events go in as method calls — a batch trained or lost, a trajectory scored or dropped, a worker
lost, the trainer lost, time passing with a pool empty — and instructions come out as small
records, the way ``distributed``'s worker state machine takes stimuli and returns instructions.
:class:`flows.training.run.TrainingRun` carries them out on Dask; the simulator
(:mod:`flows.simulation.simulator`) carries out the same ones on its virtual clock, so the two
can never decide differently. The core holds the trajectory ledger, the group collector and the
env-task draw; it knows nothing of futures, workers' addresses or clocks other than the ``now``
it is given.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from flows.config.derived import batch_trajectories
from flows.training.lifecycle import DropReason, RunFailing, TrajectoryLedger, TrajState
from flows.training.orchestration import (
    AdmissionState,
    GroupCollector,
    GroupDraw,
    admission_room,
    admission_state,
    groups_to_cut,
)
from resources.pools import Tag
from tasks.records import TrainSample, Trajectory


class PoolLost(RunFailing):
    """A pool had no worker for longer than ``cluster.pool_empty_timeout_s``."""


# -- instructions ----------------------------------------------------------------------------
@dataclass(frozen=True)
class StartGroup:
    """Start ``env_task.group_size`` trajectories of one group."""
    group_id: str
    env_task: object  # flows.config.EnvTaskConfig
    seed: int


@dataclass(frozen=True)
class Train:
    """Run one train step on ``samples`` at policy version ``version``."""
    version: int
    samples: list[TrainSample]
    trajectories: list[Trajectory]
    staleness: list[int]
    stale_dropped: int


@dataclass(frozen=True)
class Publish:
    """Load the weights of ``version`` on every inference worker."""
    version: int


@dataclass(frozen=True)
class StopRollout:
    """The last step is trained: admit nothing more; what is in flight ends."""


@dataclass(frozen=True)
class Checkpoint:
    """Write a periodic checkpoint of ``version`` (no train step starts meanwhile)."""
    version: int


@dataclass(frozen=True)
class RestoreTrainer:
    """Rebuild the trainer on ``worker`` from the newest checkpoint (``None``: from the initial
    weights, nothing trained yet), numbering on from ``version``."""
    worker: str
    version: int


@dataclass(frozen=True)
class Recovered:
    """The first step cut after a worker was lost has trained: the run made progress again."""
    seconds: float


Instruction = StartGroup | Train | Publish | StopRollout | Checkpoint | RestoreTrainer | Recovered


class RunCore:
    """The decisions of one run of ``cfg`` (a :class:`flows.config.TrainConfig`)."""

    def __init__(self, cfg, ledger: TrajectoryLedger | None = None,
                 draw: GroupDraw | None = None, max_steps: int | None = None):
        self.cfg = cfg
        self.max_steps = cfg.trainer.max_steps if max_steps is None else max_steps
        self.ledger = ledger or TrajectoryLedger()
        self.collector = GroupCollector()
        self.draw = draw or GroupDraw(cfg.env_tasks, random.Random(cfg.seed))
        self.batch_trajectories = batch_trajectories(cfg)
        self.version = 0
        self.pool_slots = 1
        self.stopping = False
        self.training: list[int] | None = None  # the running step's trajectories
        self.checkpoints_in_flight = 0
        self.loads_in_flight = 0
        self.trainer_present = True
        self.staleness_hist: Counter[int] = Counter()  # of trained trajectories
        self.recoveries_s: list[float] = []
        self._lost_at: float | None = None  # a worker left, and no batch was cut since
        self._recovering_since: float | None = None  # the cut after a loss, until it trains
        self._empty_since: dict[Tag, float] = {}
        self._ending_since: float | None = None

    # -- state ---------------------------------------------------------------------------
    @property
    def trainer_busy(self) -> bool:
        """A train step or a checkpoint runs on the trainer: no new step starts."""
        return self.training is not None or self.checkpoints_in_flight > 0

    @property
    def finished_training(self) -> bool:
        return self.version >= self.max_steps

    def admission(self) -> AdmissionState:
        return admission_state(self.cfg, self.ledger.rolling_out, self.ledger.unconsumed,
                               self.pool_slots, self.trainer_busy, self.loads_in_flight > 0,
                               self.stopping)

    # -- rollout ------------------------------------------------------------------------------
    def admit(self) -> list[StartGroup]:
        """Whole groups, while they fit in the room admission control gives; their groups are
        open in the collector from now on."""
        out = []
        for gid, env_task, seed in self.draw.take(admission_room(self.admission())):
            self.collector.open_group(gid, env_task.name, env_task.group_size)
            out.append(StartGroup(gid, env_task, seed))
        return out

    def scored(self, traj: Trajectory) -> None:
        """A member was scored (the ledger has it in a group): its group may complete."""
        self._drop(self.collector.add(traj), DropReason.GROUP_INCOMPLETE)

    def member_lost(self, group_id: str) -> None:
        """A member was dropped before it was scored (the ledger has it dropped): a group left
        with fewer than two members is dropped too."""
        self._drop(self.collector.drop_member(group_id), DropReason.GROUP_INCOMPLETE)

    def _drop(self, trajs: list[Trajectory], reason: DropReason, detail: str = "") -> None:
        for t in trajs:
            self.ledger.drop(int(t.traj_id), reason, detail)

    # -- training -----------------------------------------------------------------------------
    def cut(self) -> Train | None:
        """A batch to train, when the trainer is free and enough groups completed. Stale
        members are dropped, never trained on."""
        if self.trainer_busy or not self.trainer_present or self.finished_training:
            return None
        scoring = (self.ledger.count(TrajState.AWAITING_SCORE)
                   + self.ledger.count(TrajState.SCORING))
        n = groups_to_cut(self.cfg.mode, self.collector.ready_groups,
                          self.cfg.trainer.groups_per_step, self.ledger.rolling_out, scoring,
                          self.collector.open_groups)
        if n is None:
            return None
        d = self.collector.take_batch(n, self.version, self.cfg.rollout.max_staleness)
        self._drop(d.stale, DropReason.STALE)
        self._drop(d.orphaned, DropReason.GROUP_INCOMPLETE)
        if not d.samples:
            return None
        self.training = [int(t.traj_id) for t in d.trajectories]
        for tid in self.training:
            self.ledger.transition(tid, TrajState.TRAINING)
        self.staleness_hist.update(d.staleness)
        # the first batch cut after a worker was lost: its step is the run making progress
        self._recovering_since, self._lost_at = self._lost_at, None
        return Train(self.version, d.samples, d.trajectories, d.staleness, len(d.stale))

    def trained(self, version: int, now: float) -> list[Instruction]:
        """The running step trained and published ``version``."""
        self.version = version
        for tid in self.training or ():
            self.ledger.transition(tid, TrajState.TRAINED)
        self.training = None
        out: list[Instruction] = []
        if self._recovering_since is not None:
            self.recoveries_s.append(now - self._recovering_since)
            out.append(Recovered(self.recoveries_s[-1]))
            self._recovering_since = None
        if self.finished_training:
            self.stopping = True
            out.append(StopRollout())
        out.append(Publish(version))
        if self.checkpoint_due():
            out.append(Checkpoint(version))
        return out

    def train_lost(self, reason: DropReason, detail: str) -> None:
        """The running step will not train (its worker lost, the run interrupted)."""
        for tid in self.training or ():
            self.ledger.drop(tid, reason, detail)
        self.training = None

    def checkpoint_due(self) -> bool:
        """After the first step and every ``trainer.checkpoint_every`` steps, but the last
        (the run saves its final weights): the first makes the trainer's loss survivable from
        the start."""
        every = self.cfg.trainer.checkpoint_every
        return bool(every) and (self.version % every == 0 or self.version == 1) and (
            not self.finished_training and self.trainer_present)

    # -- faults ----------------------------------------------------------------------------
    def worker_lost(self, now: float) -> None:
        """A worker left: the recovery is timed from the first loss until the step cut after it
        trains."""
        if self._lost_at is None:
            self._lost_at = now

    def trainer_lost(self, spare: str | None, has_checkpoint: bool) -> list[Instruction]:
        """The trainer's worker left: the batch in training is dropped, checkpoints in flight
        abandoned; the trainer is rebuilt on ``spare`` (a worker carrying the tag), or on the
        next one to join (:meth:`trainer_joined`)."""
        self.trainer_present = False
        self.checkpoints_in_flight = 0
        self.train_lost(DropReason.TRAINER_LOST, "the trainer's worker left")
        return [] if spare is None else self.trainer_joined(spare, has_checkpoint)

    def trainer_joined(self, worker: str, has_checkpoint: bool) -> list[Instruction]:
        """A worker carrying the trainer's tag is there while the trainer is lost."""
        if self.trainer_present:
            return []
        if not has_checkpoint and self.version > 0:
            raise RunFailing(f"the trainer's worker was lost at policy version {self.version} "
                             "and the run has no checkpoint to rebuild it from (set "
                             "trainer.checkpoint_every)")
        self.trainer_present = True
        return [RestoreTrainer(worker, self.version)]

    def watch_pools(self, missing: list[Tag], now: float, where: str = "") -> None:
        """The tags no serving worker carries now: one missing longer than
        ``cluster.pool_empty_timeout_s`` stops the run rather than let it wait for ever."""
        limit = self.cfg.cluster.pool_empty_timeout_s
        for tag in Tag:
            key = (tag, where)
            if tag not in missing:
                self._empty_since.pop(key, None)
                continue
            since = self._empty_since.setdefault(key, now)
            if now - since > limit:
                raise PoolLost(f"no worker has advertised {tag}{where} for {now - since:.0f} s "
                               f"(cluster.pool_empty_timeout_s={limit:g}) at policy version "
                               f"{self.version}")

    def end_overdue(self, now: float) -> bool:
        """After the last train step, the work in flight has ``rollout.end_timeout_s`` to
        finish; True once that is over (the caller cancels what is left)."""
        if not self.finished_training:
            return False
        if self._ending_since is None:
            self._ending_since = now
        return now - self._ending_since > self.cfg.rollout.end_timeout_s

    def end(self, detail: str = "") -> None:
        """The run ended: trajectories left unfinished or untrained are dropped as
        ``run_ended`` (evaluation episodes too)."""
        for evaluation in (False, True):
            for tid in self.ledger.live(evaluation):
                self.ledger.drop(tid, DropReason.RUN_ENDED, detail)

    # -- resuming ----------------------------------------------------------------------------
    def state(self) -> dict:
        return {"version": self.version, "draw": self.draw.state()}

    def restore(self, state: dict) -> None:
        self.version = int(state["version"])
        self.draw.restore(state["draw"])

