"""The roofline cost model routes prefill to compute-strong and decode to bandwidth-strong pools."""

from __future__ import annotations

from flows.config import load_config
from flows.config.derived import effective_pools
from resources.affinity import Objective, Workload, pool_tags, route, stage_time
from resources.catalog import CATALOG, get_profile
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
