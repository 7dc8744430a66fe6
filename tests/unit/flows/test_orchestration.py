"""Pure orchestration decisions: admission, collector batching, staleness, routing."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from flows.training.orchestration import (
    AdmissionState,
    GroupCollector,
    GroupDraw,
    PoolWorkers,
    admission_room,
    groups_to_cut,
)
from resources.pools import Tag
from tasks.records import Trajectory


def _state(**kw):
    base = dict(mode="async", rolling_out=0, unconsumed=0, batch_trajectories=32,
                window_batches=1, spare_trajectories=16, max_in_flight=96, pool_slots=64,
                trainer_busy=False, weights_syncing=False, stopping=False)
    return AdmissionState(**(base | kw))


def test_async_admission_bounded_by_window_in_flight_and_pool_slots():
    assert admission_room(_state()) == 48  # one batch of 32 + 16 spare
    assert admission_room(_state(window_batches=2)) == 64  # capped by the pools' 64 slots
    assert admission_room(_state(unconsumed=40, rolling_out=10)) == 8
    assert admission_room(_state(unconsumed=60)) == 0
    assert admission_room(_state(max_in_flight=16)) == 16
    assert admission_room(_state(pool_slots=8, window_batches=4)) == 8
    assert admission_room(_state(stopping=True)) == 0
    # async keeps admitting while the trainer trains and weights sync
    assert admission_room(_state(trainer_busy=True, weights_syncing=True)) == 48


def test_sync_admission_is_a_barrier():
    assert admission_room(_state(mode="sync")) == 32
    assert admission_room(_state(mode="sync", unconsumed=1)) == 0
    assert admission_room(_state(mode="sync", trainer_busy=True)) == 0
    assert admission_room(_state(mode="sync", weights_syncing=True)) == 0


def test_batch_cut_async_takes_first_completed_sync_waits_for_all():
    assert groups_to_cut("async", 3, 4, rolling_out=20, scoring=0, open_groups=5) is None
    assert groups_to_cut("async", 5, 4, rolling_out=20, scoring=3, open_groups=5) == 4
    assert groups_to_cut("sync", 4, 4, rolling_out=1, scoring=0, open_groups=0) is None
    assert groups_to_cut("sync", 4, 4, rolling_out=0, scoring=2, open_groups=0) is None
    assert groups_to_cut("sync", 4, 4, rolling_out=0, scoring=0, open_groups=1) is None
    assert groups_to_cut("sync", 4, 4, rolling_out=0, scoring=0, open_groups=0) == 4
    assert groups_to_cut("sync", 0, 4, rolling_out=0, scoring=0, open_groups=0) is None


def _traj(tid, gid, reward, versions):
    n = len(versions)
    return Trajectory(
        traj_id=str(tid), group_id=gid, env_name="e", seed=0,
        token_ids=np.arange(n + 2), loss_mask=np.array([False, False] + [True] * n),
        behaviour_logprobs=np.zeros(n + 2, dtype=np.float32),
        versions=np.array([-1, -1] + versions), env_rewards=[reward], responses=[], info={},
        num_turns=1, truncated=False, context_truncated=False, reward=reward)


def test_collector_cuts_batches_from_completed_groups_without_waiting_for_stragglers():
    c = GroupCollector()
    for g in ("a", "b", "c"):
        c.open_group(g, "e", 2)
    c.add(_traj(0, "a", 1.0, [0]))  # a waits for a straggler
    c.add(_traj(1, "b", 1.0, [0]))
    c.add(_traj(2, "b", 0.0, [0]))
    c.add(_traj(3, "c", 0.0, [0]))
    c.add(_traj(4, "c", 1.0, [0]))
    assert c.ready_groups == 2 and c.open_groups == 1
    d = c.take_batch(2, trainer_version=0, max_staleness=2)
    assert {t.group_id for t in d.trajectories} == {"b", "c"}
    assert sorted(s.advantage for s in d.samples) == pytest.approx([-1, -1, 1, 1], abs=1e-4)
    assert c.ready_groups == 0 and c.open_groups == 1


def test_stale_trajectories_are_dropped_not_trained():
    c = GroupCollector()
    c.open_group("a", "e", 3)
    c.add(_traj(0, "a", 1.0, [5, 5]))
    c.add(_traj(1, "a", 0.0, [2, 6]))  # oldest token v2: staleness 7 - 2 = 5
    c.add(_traj(2, "a", 0.5, [6]))
    d = c.take_batch(1, trainer_version=7, max_staleness=2)
    assert [t.traj_id for t in d.stale] == ["1"]
    assert {t.traj_id for t in d.trajectories} == {"0", "2"}
    assert max(d.staleness) <= 2


def test_group_left_too_small_by_stale_drops_is_dropped_as_incomplete():
    c = GroupCollector()
    c.open_group("a", "e", 2)
    c.add(_traj(0, "a", 1.0, [9]))
    c.add(_traj(1, "a", 0.0, [1]))  # stale
    d = c.take_batch(1, trainer_version=9, max_staleness=2)
    assert [t.traj_id for t in d.stale] == ["1"] and [t.traj_id for t in d.orphaned] == ["0"]
    assert not d.samples


def test_group_left_with_one_member_is_dropped_whole():
    c = GroupCollector()
    c.open_group("a", "e", 2)
    assert c.add(_traj(0, "a", 1.0, [0])) == []
    orphans = c.drop_member("a")
    assert c.ready_groups == 0 and [t.traj_id for t in orphans] == ["0"]


def test_router_prefers_affinity_then_least_loaded():
    r = PoolWorkers({"GPU_BANDWIDTH": ["w1", "w2"]})
    r.started("w1")
    assert r.choose("GPU_BANDWIDTH") == "w2"
    assert r.choose("GPU_BANDWIDTH", prefer="w1") == "w1"
    assert r.choose("GPU_BANDWIDTH", prefer="elsewhere") == "w2"
    with pytest.raises(LookupError):
        r.choose("TRAINER")


def test_length_aware_placement_keeps_short_turns_on_fast_gpus_and_splits_long_ones():
    from collections import Counter

    from flows.training.lengths import ResponseLengths
    from flows.training.turn_placement import plan_turn
    from resources.catalog import CATALOG
    from resources.device_model import DeviceModel, model_spec
    from resources.pools import Tag

    m = model_spec("dense-8b")
    devices = {"h800": DeviceModel(m, CATALOG["H800"]), "h20": DeviceModel(m, CATALOG["H20"])}
    common = dict(devices=devices, compute=["h800"], bandwidth=["h20"], cache_at="h20",
                  sticky="h20")
    # the decode pool is busy and the compute pool idle: a short turn stays on the compute GPU
    busy = Counter({"h800": 1, "h20": 64})
    short = plan_turn(**common, load=busy, prompt=200, context=1000, expected_response=20)
    assert (short.prefill_worker, short.decode_worker) == ("h800", "h800")
    assert short.decode_tag is Tag.GPU_COMPUTE
    # both pools equally loaded: a long turn is split, prefill on H800 and decode on H20
    even = Counter({"h800": 30, "h20": 30})
    long = plan_turn(**common, load=even, prompt=8000, context=4000, expected_response=2000)
    assert (long.prefill_worker, long.decode_worker) == ("h800", "h20")
    assert (long.prefill_tag, long.decode_tag) == (Tag.GPU_COMPUTE, Tag.GPU_BANDWIDTH)
    # nothing known about the env task's responses yet: today's split
    first = plan_turn(**common, load=busy, prompt=200, context=1000, expected_response=None)
    assert (first.prefill_worker, first.decode_worker, first.estimate_s) == ("h800", "h20", None)
    lengths = ResponseLengths()
    assert lengths.expected("a") is None
    lengths.record("a", 10)
    lengths.record("a", 30)
    assert lengths.expected("a") == 20


def test_group_draw_state_round_trips_through_json():
    from flows.config import load_config

    tasks = load_config().env_tasks
    a = GroupDraw(tasks, random.Random(3))
    a.take(20)  # leaves a drawn env task waiting for room
    state = json.loads(json.dumps(a.state()))
    b = GroupDraw(tasks, random.Random(99))
    b.restore(state)
    assert [(g, t.name, s) for g, t, s in a.take(40)] == [(g, t.name, s) for g, t, s in
                                                          b.take(40)]


def test_score_bursts_group_by_reward_function_in_order_and_cut_at_the_task_size():
    from flows.training.orchestration import score_bursts

    trajs = [_traj(i, "g", 0.0, [0]) for i in range(5)]
    for t, env in zip(trajs, ["a", "b", "a", "a", "a"], strict=True):
        t.env_name = env
    bursts = score_bursts(trajs, {"a": "f1", "b": "f2"}, per_task=3)
    assert [(f, [t.traj_id for t in b]) for f, b in bursts] == [
        ("f1", ["0", "2", "3"]), ("f1", ["4"]), ("f2", ["1"])]
    assert score_bursts([], {"a": "f1"}, per_task=3) == []


def test_split_placement_keeps_decode_on_the_cache_and_prefill_beside_it_when_it_can():
    from flows.training.turn_placement import place_turn

    workers = PoolWorkers({"GPU_COMPUTE": ["c1", "both"], "GPU_BANDWIDTH": ["b1", "both"]})
    workers.started("c1")  # c1 is busier than "both"
    # decode stays on the worker holding the trajectory's cache; prefill joins it there
    plan = place_turn(workers, None, decode_worker="both", kv_at="both", prompt=0, context=0,
                      expected=None)
    assert (plan.prefill_worker, plan.decode_worker) == ("both", "both")
    assert (plan.prefill_tag, plan.decode_tag) == (Tag.GPU_COMPUTE, Tag.GPU_BANDWIDTH)
    # a fresh trajectory: the least-loaded of each pool ("b1" before "both" on a tie by name)
    plan = place_turn(workers, None, decode_worker=None, kv_at=None, prompt=0, context=0,
                      expected=None)
    assert plan.decode_worker == "b1" and plan.prefill_worker == "both"
