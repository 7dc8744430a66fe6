"""The run core (flows/training/core.py): a run's decisions as events in, instructions out,
without Dask — admission, batch cuts, a worker or the trainer lost, an empty pool, the end."""

from __future__ import annotations

import numpy as np
import pytest

from flows.config import load_config
from flows.training.core import (
    Checkpoint,
    PoolLost,
    Publish,
    Recovered,
    RestoreTrainer,
    RunCore,
    StartGroup,
    StopRollout,
    Train,
)
from flows.training.lifecycle import DropReason, RunFailing, TrajState
from resources.pools import Tag
from tasks.records import Trajectory


def _core(*overrides) -> RunCore:
    core = RunCore(load_config(overrides=["trainer.groups_per_step=2", "trainer.max_steps=3",
                                          *overrides]))
    core.pool_slots = 64
    return core


def _finish(core: RunCore, group: StartGroup, version: int = 0,
            members: int | None = None) -> list[int]:
    """The members of ``group`` (all by default) rolled out, scored, in their group; their ids
    (ids are numbered in the order trajectories start)."""
    ids = []
    for i in range(group.env_task.group_size if members is None else members):
        tid = len(core.ledger.live()) + core.ledger.summary()["trained"] + sum(
            core.ledger.summary()["dropped"].values())
        core.ledger.admit(tid)
        for state in (TrajState.ROLLING_OUT, TrajState.AWAITING_SCORE, TrajState.SCORING,
                      TrajState.IN_GROUP):
            core.ledger.transition(tid, state)
        core.scored(Trajectory(
            traj_id=str(tid), group_id=group.group_id, env_name=group.env_task.name, seed=0,
            token_ids=np.arange(4), loss_mask=np.array([False, False, True, True]),
            behaviour_logprobs=np.zeros(4, np.float32), versions=np.array([-1, -1, version,
                                                                           version]),
            env_rewards=[], responses=[], info={}, num_turns=1, truncated=False,
            context_truncated=False, reward=float(i)))
        ids.append(tid)
    return ids


def _one_step(core: RunCore, now: float = 0.0) -> tuple[Train, list]:
    for group in core.admit()[:2]:
        _finish(core, group, core.version)
    batch = core.cut()
    assert batch is not None
    return batch, core.trained(core.version + 1, now)


def test_admission_opens_whole_groups_and_a_batch_is_cut_once_enough_groups_completed():
    core = _core()
    groups = core.admit()
    assert groups and all(isinstance(g, StartGroup) for g in groups)
    assert core.collector.open_groups == len(groups)
    assert core.cut() is None  # nothing completed yet
    _finish(core, groups[0])
    assert core.cut() is None  # one group of the two a step takes
    _finish(core, groups[1])
    batch = core.cut()
    assert batch.version == 0 and len(batch.samples) == 16 and core.trainer_busy
    assert all(core.ledger.state(int(t.traj_id)) is TrajState.TRAINING
               for t in batch.trajectories)
    assert core.cut() is None  # one step at a time


def test_a_trained_step_publishes_its_weights_checkpoints_on_cadence_and_the_last_stops():
    core = _core("trainer.checkpoint_every=2")
    seen = []
    for _ in range(3):
        _, instructions = _one_step(core)
        seen.append([type(i) for i in instructions])
    # v1 (the first step: the trainer's loss survivable from the start), v2; not the last
    assert seen == [[Publish, Checkpoint], [Publish, Checkpoint], [StopRollout, Publish]]
    assert core.stopping and core.admit() == [] and core.cut() is None
    assert core.ledger.summary()["trained"] == 3 * 16


def test_a_stale_member_is_dropped_never_trained():
    core = _core("rollout.max_staleness=2", "trainer.max_steps=10")
    core.version = 5
    old, fresh = core.admit()[:2]
    _finish(core, old, version=2)
    _finish(core, fresh, version=5)
    batch = core.cut()
    assert batch.stale_dropped == 8 and len(batch.samples) == 8
    assert {t.group_id for t in batch.trajectories} == {fresh.group_id}
    assert core.ledger.summary()["dropped"] == {DropReason.STALE: 8}


def test_a_group_that_lost_members_below_two_is_dropped_whole():
    core = _core()
    groups = core.admit()
    group = groups[0]
    _finish(core, group, members=1)  # one scored; the rest lost mid-turn
    for _ in range(group.env_task.group_size - 1):
        core.member_lost(group.group_id)
    assert core.ledger.summary()["dropped"] == {DropReason.GROUP_INCOMPLETE: 1}
    assert core.collector.open_groups == len(groups) - 1 and core.collector.ready_groups == 0


def test_a_worker_lost_times_the_recovery_to_the_step_cut_after_it():
    core = _core()
    for group in core.admit()[:2]:
        _finish(core, group)
    core.worker_lost(now=10.0)
    core.worker_lost(now=11.0)  # a second loss before the cut: timed from the first
    assert core.cut() is not None
    assert Recovered(5.0) in core.trained(1, now=15.0)
    assert core.recoveries_s == [5.0]
    _, again = _one_step(core, now=20.0)
    assert not any(isinstance(i, Recovered) for i in again)


def test_the_trainer_lost_mid_step_drops_its_batch_and_is_rebuilt_on_a_spare():
    core = _core()
    _one_step(core)
    for group in core.admit()[:2]:
        _finish(core, group, core.version)
    batch = core.cut()
    core.checkpoints_in_flight = 1
    assert core.trainer_lost(spare="tcp://spare", has_checkpoint=True) == [
        RestoreTrainer("tcp://spare", 1)]
    assert len(batch.trajectories) == 16
    assert core.ledger.summary()["dropped"] == {DropReason.TRAINER_LOST: 16}
    assert not core.trainer_busy and core.trainer_present


def test_without_a_spare_batches_wait_for_a_trainer_to_join():
    core = _core()
    core.trainer_lost(spare=None, has_checkpoint=False)  # at v0: the initial weights do
    for group in core.admit()[:2]:
        _finish(core, group)
    assert core.cut() is None  # no trainer: the completed groups wait
    assert core.trainer_joined("tcp://new", has_checkpoint=False) == [RestoreTrainer("tcp://new", 0)]
    assert core.trainer_joined("tcp://other", has_checkpoint=False) == []  # already back
    assert core.cut() is not None


def test_the_trainer_lost_after_training_without_a_checkpoint_fails_the_run_loudly():
    core = _core("trainer.checkpoint_every=0")
    _one_step(core)
    with pytest.raises(RunFailing, match="no checkpoint to rebuild it from"):
        core.trainer_lost(spare="tcp://spare", has_checkpoint=False)


def test_a_weight_load_in_flight_holds_sync_admission_back():
    core = _core("mode=sync")
    _one_step(core)
    core.loads_in_flight = 1
    assert core.admit() == []
    core.loads_in_flight = 0
    assert core.admit()


def test_a_pool_empty_longer_than_its_timeout_stops_the_run():
    core = _core("cluster.pool_empty_timeout_s=30")
    core.watch_pools([Tag.CPU_ENV], now=0.0)
    core.watch_pools([Tag.CPU_ENV], now=29.0)
    core.watch_pools([], now=29.5)  # a worker came back: the clock restarts
    core.watch_pools([Tag.CPU_ENV], now=40.0)
    core.watch_pools([Tag.CPU_ENV], now=70.0)
    with pytest.raises(PoolLost, match="CPU_ENV for 31 s"):
        core.watch_pools([Tag.CPU_ENV], now=71.0)
    core.watch_pools([Tag.CPU_ENV], now=0.0, where=" on rollout shard 1")  # a clock of its own


def test_the_end_waits_rollout_end_timeout_after_the_last_step_then_drops_what_is_left():
    core = _core("trainer.max_steps=1", "rollout.end_timeout_s=20")
    assert not core.end_overdue(now=0.0)  # not trained yet
    _one_step(core)
    core.ledger.admit(1000)  # still rolling out after the last step
    core.ledger.transition(1000, TrajState.ROLLING_OUT)
    live = core.ledger.live()
    assert not core.end_overdue(now=100.0)
    assert not core.end_overdue(now=120.0)
    assert core.end_overdue(now=120.5)
    core.end("cut at the end")
    assert live and not core.ledger.live()
    assert core.ledger.summary()["dropped"] == {DropReason.RUN_ENDED: len(live)}


def test_its_state_resumes_the_draw_and_version():
    a = _core()
    a.admit()
    b = _core()
    b.restore(a.state() | {"version": 7})
    assert b.version == 7 and [g.seed for g in b.admit()] == [g.seed for g in a.admit()]
