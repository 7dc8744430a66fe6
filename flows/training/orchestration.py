"""Orchestration decisions as pure functions and small state machines, without Dask.

- :func:`admission_room` — admission control (how many more trajectories may start now);
- :func:`groups_to_cut` — when to cut a train batch and how many groups it takes;
- :class:`GroupCollector` — the streaming collector: groups fill as trajectories finish, and a
  batch is cut from whichever groups completed first; stale trajectories are dropped, counted;
- :func:`staleness` — trainer version at the step that trains a trajectory minus its oldest
  token version;
- :class:`PoolWorkers` — which worker of a pool gets the next task (KV and environment affinity, then
  least in-flight work);
- :func:`pick_shard` — which rollout shard (``cluster.shards``) a new group goes to;
- :func:`sample_env_task`, :func:`decode_seed` — the mix draw and the per-turn sampling seed.

The trajectory state machine that keeps the accounts is :mod:`flows.training.lifecycle`.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from flows.config.choices import Mode
from flows.config.derived import batch_trajectories
from tasks.losses import group_advantages
from tasks.records import TrainSample, Trajectory


@dataclass(frozen=True)
class AdmissionState:
    mode: Mode
    rolling_out: int  # trajectories admitted and not yet finished
    unconsumed: int  # admitted and not yet trained or dropped (rolling out + waiting)
    batch_trajectories: int  # trajectories in one train batch
    window_batches: int  # async: batches admitted beyond the one being trained
    spare_trajectories: int  # async: admitted beyond the window, so no batch waits for the last
    max_in_flight: int  # cap on trajectories rolling out at once
    pool_slots: int  # fewest slots of any pool a turn passes through
    trainer_busy: bool
    weights_syncing: bool
    stopping: bool


def admission_state(cfg, rolling_out: int, unconsumed: int, pool_slots: int,
                    trainer_busy: bool, weights_syncing: bool, stopping: bool) -> AdmissionState:
    """The admission state of a run of ``cfg`` (a :class:`flows.config.TrainConfig`): what the
    Dask flow and the simulator both ask :func:`admission_room` with."""
    ro = cfg.rollout
    return AdmissionState(
        mode=cfg.mode, rolling_out=rolling_out, unconsumed=unconsumed,
        batch_trajectories=batch_trajectories(cfg), window_batches=ro.window_batches,
        spare_trajectories=ro.spare_groups * max(t.group_size for t in cfg.env_tasks),
        max_in_flight=ro.max_in_flight, pool_slots=pool_slots, trainer_busy=trainer_busy,
        weights_syncing=weights_syncing, stopping=stopping)


def admission_room(s: AdmissionState) -> int:
    """How many more trajectories may start now (whole groups are admitted while they fit).

    async: at most ``window_batches`` batches (+ a few spare groups) admitted-but-not-consumed,
    which keeps staleness near ``window_batches`` while the spares let a batch be cut from the
    groups that finish first; and at most ``max_in_flight`` and ``pool_slots`` trajectories
    rolling out — the per-pool backpressure Dask does not give resource-restricted tasks (each
    rolling-out trajectory holds at most one task of a pool at a time).
    sync: one batch at a time, only when the previous one was trained and its weights are live.
    """
    if s.stopping:
        return 0
    if s.mode == Mode.SYNC:
        if s.unconsumed or s.trainer_busy or s.weights_syncing:
            return 0
        return s.batch_trajectories
    return max(0, min(s.window_batches * s.batch_trajectories + s.spare_trajectories - s.unconsumed,
                      s.max_in_flight - s.rolling_out, s.pool_slots - s.rolling_out))


def groups_to_cut(mode: Mode, ready_groups: int, groups_per_step: int, rolling_out: int,
                  scoring: int, open_groups: int) -> int | None:
    """How many completed groups the next train batch takes, or None to wait.

    async: the first ``groups_per_step`` groups to complete, whoever is still rolling out.
    sync: the barrier — everything admitted for this batch, once all of it is scored.
    """
    if mode == Mode.SYNC:
        if rolling_out or scoring or open_groups or not ready_groups:
            return None
        return ready_groups
    return groups_per_step if ready_groups >= groups_per_step else None


def staleness(trainer_version: int, traj: Trajectory) -> int:
    return trainer_version - traj.oldest_version


@dataclass
class _Group:
    group_id: str
    env_name: str
    size: int
    order: int  # when it was opened
    members: list[Trajectory] = field(default_factory=list)
    dropped: int = 0

    @property
    def complete(self) -> bool:
        return len(self.members) + self.dropped >= self.size


@dataclass
class BatchDecision:
    samples: list[TrainSample]
    trajectories: list[Trajectory]
    stale: list[Trajectory]
    staleness: list[int]
    orphaned: list[Trajectory]  # fresh, but their group lost too many members to stale drops


class GroupCollector:
    """Assembles groups as trajectories finish; cuts batches without waiting for stragglers."""

    def __init__(self, normalise_std: bool = True):
        self._open: dict[str, _Group] = {}
        self._ready: OrderedDict[str, _Group] = OrderedDict()
        self.normalise_std = normalise_std
        self._opened = 0

    def open_group(self, group_id: str, env_name: str, size: int) -> None:
        self._open[group_id] = _Group(group_id, env_name, size, self._opened)
        self._opened += 1

    def add(self, traj: Trajectory) -> list[Trajectory]:
        """A scored member arrived. Returns the members of a group completed too small to
        compare (the others failed): the caller drops them."""
        g = self._open[traj.group_id]
        g.members.append(traj)
        return self._promote(g)

    def drop_member(self, group_id: str) -> list[Trajectory]:
        """A member was dropped before it was scored; returns orphans as :meth:`add` does."""
        g = self._open[group_id]
        g.dropped += 1
        return self._promote(g)

    def _promote(self, g: _Group) -> list[Trajectory]:
        if not g.complete:
            return []
        del self._open[g.group_id]
        if len(g.members) >= 2:
            self._ready[g.group_id] = g
            return []
        return list(g.members)

    @property
    def ready_groups(self) -> int:
        return len(self._ready)

    @property
    def ready_trajectories(self) -> int:
        return sum(len(g.members) for g in self._ready.values())

    @property
    def open_groups(self) -> int:
        return len(self._open)

    @property
    def open_members(self) -> int:
        """Finished trajectories waiting for the rest of their group."""
        return sum(len(g.members) for g in self._open.values())

    def take_batch(self, groups: int, trainer_version: int, max_staleness: int) -> BatchDecision:
        """Cut a batch of the first ``groups`` completed groups.

        Members staler than ``max_staleness`` are dropped, never trained on; a group left with
        fewer than two members cannot give relative advantages and its rest is dropped too.
        """
        picked = [self._ready.popitem(last=False)[1] for _ in range(min(groups, len(self._ready)))]
        samples, kept, stale, ages, orphaned = [], [], [], [], []
        # which groups is decided by completion; their order in the batch is not, so that the
        # trainer's seeded minibatches do not depend on timing
        for g in sorted(picked, key=lambda g: g.order):
            members = sorted(g.members, key=lambda t: int(t.traj_id))
            fresh = [t for t in members if staleness(trainer_version, t) <= max_staleness]
            stale.extend(t for t in members if staleness(trainer_version, t) > max_staleness)
            if len(fresh) < 2:
                orphaned.extend(fresh)
                continue
            ages.extend(staleness(trainer_version, t) for t in fresh)
            adv = group_advantages([t.reward for t in fresh], self.normalise_std)
            for t, a in zip(fresh, adv, strict=True):
                samples.append(TrainSample(t.token_ids, t.loss_mask, t.behaviour_logprobs, a,
                                           t.virtual_tokens, t.virtual_response_tokens))
                kept.append(t)
        return BatchDecision(samples, kept, stale, ages, orphaned)


class PoolWorkers:
    """The workers of each pool (by resource tag) and their tasks in flight: chooses the worker
    that gets the next task. Pure: the caller reports submissions and completions."""

    def __init__(self, workers_by_tag: dict[str, list[str]]):
        self.workers_by_tag = {k: list(v) for k, v in workers_by_tag.items()}
        self.load: Counter[str] = Counter()

    def choose(self, tag: str, prefer: str | None = None) -> str:
        pool = self.workers_by_tag.get(tag) or []
        if not pool:
            raise LookupError(f"no worker advertises {tag}")
        if prefer in pool:
            return prefer
        return min(zip(map(self.load.__getitem__, pool), pool, strict=True))[1]  # (load, name)

    def has(self, tag: str) -> bool:
        return bool(self.workers_by_tag.get(tag))

    def add(self, worker: str, tags: list[str]) -> None:
        """A worker joined (or came back): it takes work of ``tags`` from now on."""
        for tag in tags:
            pool = self.workers_by_tag.setdefault(tag, [])
            if worker not in pool:
                pool.append(worker)
                pool.sort()

    def remove(self, worker: str) -> list[str]:
        """A worker left: no more work goes to it. The tags it served."""
        served = [tag for tag, pool in self.workers_by_tag.items() if worker in pool]
        for tag in served:
            self.workers_by_tag[tag].remove(worker)
        self.load.pop(worker, None)
        return served

    def started(self, worker: str) -> None:
        self.load[worker] += 1

    def finished(self, worker: str) -> None:
        if worker in self.load:  # a removed worker's count is gone with it
            self.load[worker] -= 1


def pick_shard(rolling_out: list[int], slots: list[int]) -> int:
    """The rollout shard (``cluster.shards``) a new group goes to: the one with the most free
    room (its pool slots minus its trajectories rolling out), ties to the lowest index. Room
    may be negative (a shard that lost workers); the emptiest shard still wins."""
    if not rolling_out or len(rolling_out) != len(slots):
        raise ValueError(f"one count per shard: rolling_out={rolling_out}, slots={slots}")
    room = [s - r for r, s in zip(rolling_out, slots, strict=True)]
    return room.index(max(room))


def env_pool_change(busy: float, workers: int, draining: int, min_workers: int,
                    max_workers: int, high: float, low: float) -> int:
    """The adaptive environment pool: +1 (add a worker) when the environment work fills more
    than ``high`` of the pool's slots, -1 (drain one) below ``low`` of them, else 0. ``busy`` is
    the mean number of environment steps running, over the pool's slots; a pool still draining
    a worker changes nothing until that worker is gone."""
    if draining:
        return 0
    if busy > high and workers < max_workers:
        return 1
    if busy < low and workers > min_workers:
        return -1
    return 0


def sample_env_task(weights: list[float], rng: random.Random) -> int:
    """Index of the env task of the next group, drawn by the mix weights."""
    return rng.choices(range(len(weights)), weights=weights, k=1)[0]


class GroupDraw:
    """Draws the next groups of the mix: each group's env task by the mix weights, then its
    seed, from one random stream. A drawn env task whose group does not fit the room is kept
    for the next call, so the sequence of groups does not depend on how room arrives."""

    def __init__(self, env_tasks: list, rng: random.Random):
        self.env_tasks, self.rng = env_tasks, rng
        self._weights = [t.weight for t in env_tasks]
        self._next = None
        self.groups = 0

    def take(self, room: int) -> list[tuple[str, object, int]]:
        """(group id, env task, seed) of the whole groups that fit in ``room`` trajectories."""
        out = []
        while True:
            if self._next is None:
                self._next = self.env_tasks[sample_env_task(self._weights, self.rng)]
            env_task = self._next
            if env_task.group_size > room:
                return out
            room -= env_task.group_size
            self._next = None
            out.append((f"{env_task.name}.{self.groups}", env_task,
                        self.rng.randrange(env_task.seed_range)))
            self.groups += 1

    def state(self) -> dict:
        """JSON-able: the random stream, the groups drawn, the env task kept for later."""
        version, internal, gauss = self.rng.getstate()
        return {"rng": [version, list(internal), gauss], "groups": self.groups,
                "next": None if self._next is None else self.env_tasks.index(self._next)}

    def restore(self, state: dict) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.groups = int(state["groups"])
        self._next = None if state["next"] is None else self.env_tasks[state["next"]]


def decode_seed(*parts) -> int:
    """The sampling seed of one turn (run seed, trajectory, turn, attempt): the same in the Dask
    flow and the reference loop, whatever worker or batch the turn runs in."""
    h = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFF_FFFF


def min_max_staleness(window_batches: int) -> int:
    """The staleness async admission produces by design: a trajectory admitted while the
    trainer is at v may be trained up to ``window_batches`` steps later, and its first turn may
    still run on v - 1 weights while v is being loaded (one step of sync lag)."""
    return window_batches + 1


def score_bursts(trajectories: list[Trajectory], function_of: dict[str, str],
                 per_task: int) -> list[tuple[str, list[Trajectory]]]:
    """The score tasks that finished trajectories make: grouped by their reward function
    (``function_of`` an env task's), in the order they finished, cut at ``per_task``
    (``reward.batch_max`` x ``reward.concurrency``: what one task's client sends at once)."""
    by_function: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        by_function.setdefault(function_of[t.env_name], []).append(t)
    return [(function, trajs[i:i + per_task]) for function, trajs in by_function.items()
            for i in range(0, len(trajs), per_task)]
