"""The roofline cost model routes prefill to compute-strong and decode to bandwidth-strong pools."""

from __future__ import annotations

import pytest

from flows.config import load_config
from flows.config.derived import effective_pools
from resources.affinity import (
    SPLIT_MARGIN,
    Home,
    Objective,
    PoolEngine,
    TrajectoryShape,
    Workload,
    pool_tags,
    route,
    stage_time,
    trajectory_affinity,
)
from resources.catalog import CATALOG, get_profile
from resources.device_model import DeviceModel, model_spec
from resources.pools import PoolSpec, Role, Stage, Tag

W = Workload()


def _pools(compute="H800", bandwidth="H20"):
    return [PoolSpec(name="a", profile=compute, role=Role.INFERENCE),
            PoolSpec(name="b", profile=bandwidth, role=Role.INFERENCE),
            PoolSpec(name="env", profile="CPU", role=Role.ENV),
            PoolSpec(name="trainer", profile="H800", role=Role.TRAIN)]


def test_catalog_has_required_profiles():
    for name in ("H800", "H20", "H100", "H200", "A100", "CPU"):
        p = get_profile(name)
        assert p.peak_flops > 0 and p.mem_bandwidth > 0 and p.price_per_hour > 0


def test_prefill_is_compute_bound_and_decode_bandwidth_bound():
    h800, h20 = CATALOG["H800"], CATALOG["H20"]
    assert stage_time(Stage.PREFILL, h800, W) < stage_time(Stage.PREFILL, h20, W)
    assert stage_time(Stage.DECODE, h20, W) < stage_time(Stage.DECODE, h800, W)


def test_route_by_profile_and_swap_moves_stages():
    for objective in Objective:
        r = route(_pools("H800", "H20"), W, objective)
        assert r == {Stage.PREFILL: "a", Stage.DECODE: "b"}
        swapped = route(_pools("H20", "H800"), W, objective)
        assert swapped == {Stage.PREFILL: "b", Stage.DECODE: "a"}


def test_one_device_kind_colocates():
    r = route(_pools("H100", "H100"), W)
    assert r[Stage.PREFILL] == r[Stage.DECODE]
    tags = pool_tags(_pools("H100", "H100"), r)
    assert {Tag.GPU_COMPUTE, Tag.GPU_BANDWIDTH} <= set(tags[r[Stage.PREFILL]])


def test_monolithic_is_one_pool_with_every_tag():
    cfg = load_config(overrides=["placement=monolithic"])
    pools = effective_pools(cfg)
    # one pool carries every hardware tag; reward bursts keeps its own pool
    assert [p.role for p in pools] == [Role.ALL, Role.SERVERLESS]
    assert pools[0].workers == sum(p.workers for p in cfg.cluster.pools
                                   if p.role is not Role.SERVERLESS)
    r = route(pools, W)
    assert set(r.values()) == {pools[0].name}
    tags = pool_tags(pools, r)
    assert set(tags[pools[0].name]) == set(Tag) - {Tag.SERVERLESS}
    assert tags["reward"] == [Tag.SERVERLESS]


def test_default_config_tags():
    cfg = load_config()
    pools = effective_pools(cfg)
    tags = pool_tags(pools, route(pools, cfg.affinity.workload, cfg.affinity.objective))
    assert tags == {"compute": [Tag.GPU_COMPUTE], "bandwidth": [Tag.GPU_BANDWIDTH],
                    "env": [Tag.CPU_ENV], "trainer": [Tag.TRAINER], "reward": [Tag.SERVERLESS]}


# -- hardware affinity per trajectory ----------------------------------------------------------
def _engines(compute_gpus: int, bandwidth_gpus: int, compute_load: int = 0,
             bandwidth_load: int = 0):
    m = model_spec("dense-8b")
    return (PoolEngine(DeviceModel(m, CATALOG["H800"], compute_gpus), compute_load),
            PoolEngine(DeviceModel(m, CATALOG["H20"], bandwidth_gpus), bandwidth_load))


# SWE-like: a 3k-token task, 2k new tokens a turn, 30-token actions, 12 turns (contexts to ~27k)
PREFILL_HEAVY = dict(prompt_tokens=3000, turn_tokens=2000, response_tokens=30, turns=12)
# GEM-math-like: a short question, two turns of 8k-token chains of thought
DECODE_HEAVY = dict(prompt_tokens=600, turn_tokens=60, response_tokens=8000, turns=2)


@pytest.mark.parametrize("gpus", [(2, 4), (1, 4), (4, 8)])
def test_prefill_heavy_trajectories_go_to_the_compute_pool(gpus):
    decision = trajectory_affinity(TrajectoryShape(**PREFILL_HEAVY), *_engines(*gpus))
    assert decision.best.home is Home.COMPUTE
    # per dollar the H20s' prefill costs more than twice the H800s' at catalog prices
    assert decision.option(Home.BANDWIDTH).dollars > 1.5 * decision.option(Home.COMPUTE).dollars


@pytest.mark.parametrize("gpus", [(2, 4), (1, 4), (4, 8), (1, 1)])
def test_decode_heavy_trajectories_go_to_the_bandwidth_pool(gpus):
    decision = trajectory_affinity(TrajectoryShape(**DECODE_HEAVY), *_engines(*gpus))
    assert decision.best.home is Home.BANDWIDTH
    assert decision.option(Home.COMPUTE).dollars > 2 * decision.option(Home.BANDWIDTH).dollars


def test_split_where_both_a_long_prefill_and_a_long_response_pay_for_the_kv_moves():
    shape = TrajectoryShape(prompt_tokens=6000, turn_tokens=4000, response_tokens=1500, turns=3)
    decision = trajectory_affinity(shape, *_engines(2, 4))
    assert decision.best.home is Home.SPLIT
    whole = min(decision.option(Home.COMPUTE).score, decision.option(Home.BANDWIDTH).score)
    assert decision.option(Home.SPLIT).score < (1 - SPLIT_MARGIN) * whole
    # a trajectory whose KV is on a compute engine keeps its whole turns there
    assert decision.choose((Home.COMPUTE,)).home is Home.COMPUTE


def test_a_saturated_compute_engine_sends_prefill_heavy_trajectories_elsewhere():
    shape = TrajectoryShape(**PREFILL_HEAVY)
    idle = trajectory_affinity(shape, *_engines(2, 4))
    busy = trajectory_affinity(shape, *_engines(2, 4, compute_load=80))
    assert idle.best.home is Home.COMPUTE and busy.best.home is not Home.COMPUTE
    c_idle, c_busy = idle.option(Home.COMPUTE), busy.option(Home.COMPUTE)
    # its work costs the same per dollar; it finishes later, behind the engine's queue
    assert c_busy.dollars == pytest.approx(c_idle.dollars)
    assert c_busy.queue > 2 and c_busy.seconds > 2 * c_idle.seconds
    # more turns in flight than an engine's KV memory holds at this shape: a memory queue too
    compute, _ = _engines(2, 4)
    held = sum(n + c + r for n, c, r in shape.turn_work()) / shape.turns
    assert 1 < compute.slots(held) < 80


def test_turn_work_grows_the_context_by_each_turn():
    work = TrajectoryShape(100, 20, 10, 3).turn_work()
    assert work == [(100, 0, 10), (20, 110, 10), (20, 140, 10)]
    assert TrajectoryShape(100, 20, 10, 0.2).turn_work() == [(100, 0, 10)]
