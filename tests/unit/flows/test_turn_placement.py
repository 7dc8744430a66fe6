"""Hardware affinity per env task (rollout.turn_placement=env_task): running length estimates,
the placement of each turn on the home its env task's estimate prices best, and the mapping a
run reports."""

from __future__ import annotations

import logging

import pytest

from flows.config import load_config
from flows.config.choices import TurnPlacement
from flows.training.lengths import PRIOR_WEIGHT, LengthEstimates, max_turns
from flows.training.orchestration import PoolWorkers
from flows.training.turn_placement import SETTLE_TRAJECTORIES, EnvTaskAffinity, place_turn
from resources.affinity import Home, TrajectoryShape
from resources.catalog import CATALOG
from resources.device_model import DeviceModel, model_spec
from resources.pools import Tag
from tests import ROOT

PAPER_MIX = ROOT / "config" / "bench" / "paper_mix.yaml"


def _paper_mix_affinity() -> tuple[EnvTaskAffinity, PoolWorkers]:
    """paper_mix's engines (2 H800 for compute, 4 H20 for bandwidth) and env task priors."""
    cfg = load_config(PAPER_MIX)
    m = model_spec(cfg.engine.device.model)
    devices = {"c": DeviceModel(m, CATALOG["H800"], 2), "b": DeviceModel(m, CATALOG["H20"], 4)}
    workers = PoolWorkers({str(Tag.GPU_COMPUTE): ["c"], str(Tag.GPU_BANDWIDTH): ["b"]})
    lengths = LengthEstimates.from_env_tasks(cfg.env_tasks)
    return EnvTaskAffinity(devices, lengths, cfg.engine.device.max_seqs), workers


def test_paper_mix_uses_env_task_placement():
    assert load_config(PAPER_MIX).rollout.turn_placement is TurnPlacement.ENV_TASK


def test_estimates_start_from_the_config_shape_and_the_environment_max_turns():
    cfg = load_config(PAPER_MIX)
    swe = next(t for t in cfg.env_tasks if t.name == "swe_like")
    assert max_turns(swe.env) == 10  # found inside the RemoteLatency wrapper
    est = LengthEstimates.from_env_tasks(cfg.env_tasks)
    shape = est.shape("swe_like")
    assert shape.turns == 10
    assert shape.prompt_tokens == pytest.approx(swe.shape.prompt_tokens.mean)
    assert shape.response_tokens == pytest.approx(swe.shape.response_tokens.mean)
    # without a shape nothing is known until turns are observed
    assert LengthEstimates().shape("anything") is None


def test_the_running_estimate_follows_observed_lengths():
    est = LengthEstimates({"t": TrajectoryShape(1000, 500, 100, 8)})
    version = est.of("t").version
    # the prior weighs PRIOR_WEIGHT observations: one observation moves the mean 1/(w+1) of the way
    est.record("t", 600, prompt=2000, first=True)
    shape = est.shape("t")
    assert shape.response_tokens == pytest.approx(100 + (600 - 100) / (PRIOR_WEIGHT + 1))
    assert shape.prompt_tokens == pytest.approx(1000 + (2000 - 1000) / (PRIOR_WEIGHT + 1))
    assert shape.turn_tokens == 500  # a first turn's prompt is not a later turn's
    est.record("t", 600, prompt=300)
    assert est.shape("t").turn_tokens < 500
    for _ in range(200):  # trajectories end after 2 turns from now on
        est.finished("t", 2)
    assert est.shape("t").turns == pytest.approx(2, abs=0.1)
    assert est.of("t").trajectories == 200 and est.of("t").version > version
    # length_aware's expected response is the plain mean of what was observed
    assert est.expected("t") == 600
    assert est.expected("unknown") is None


def test_env_task_placement_maps_prefill_heavy_to_compute_and_decode_heavy_to_bandwidth():
    affinity, workers = _paper_mix_affinity()
    swe = affinity.plan(workers, "swe_like", sticky=None, kv_at=None)
    assert (swe.prefill_worker, swe.decode_worker) == ("c", "c")
    assert (swe.prefill_tag, swe.decode_tag) == (Tag.GPU_COMPUTE, Tag.GPU_COMPUTE)
    math = affinity.plan(workers, "gem_math_like", sticky=None, kv_at=None)
    assert (math.prefill_worker, math.decode_worker) == ("b", "b")
    assert (math.prefill_tag, math.decode_tag) == (Tag.GPU_BANDWIDTH, Tag.GPU_BANDWIDTH)
    mapping = affinity.mapping()
    assert mapping["swe_like"]["home"] == "compute"
    assert mapping["gem_math_like"]["home"] == "bandwidth"
    assert mapping["swe_like"]["turns_placed"] == {"compute": 1}
    assert set(mapping["swe_like"]["dollars_per_trajectory"]) == {str(h) for h in Home}
    assert mapping["swe_like"]["estimate"]["turns"] == 10


def test_a_trajectory_stays_with_its_kv_and_a_busy_compute_pool_spills_new_ones():
    affinity, workers = _paper_mix_affinity()
    # a decode-heavy trajectory whose KV is on the compute engine keeps its turns there
    kept = affinity.plan(workers, "gem_math_like", sticky="c", kv_at="c")
    assert (kept.prefill_worker, kept.decode_worker) == ("c", "c")
    # a prefill-heavy one whose KV is on the bandwidth engine keeps its decode there
    stays = affinity.plan(workers, "swe_like", sticky="b", kv_at="b")
    assert stays.decode_worker == "b"
    # the compute engine saturated: new prefill-heavy trajectories go elsewhere
    for _ in range(90):
        workers.started("c")
    spilled = affinity.plan(workers, "swe_like", sticky=None, kv_at=None)
    assert spilled.decode_worker == "b"


def test_place_turn_asks_the_env_task_affinity_and_falls_back_without_an_estimate():
    affinity, workers = _paper_mix_affinity()
    plan = place_turn(workers, affinity.devices, None, None, prompt=100, context=0,
                      expected=None, affinity=affinity, env_task="gem_math_like")
    assert (plan.prefill_worker, plan.decode_worker) == ("b", "b")
    # an env task with no shape and no observed turn: the split, as length_aware starts
    plan = place_turn(workers, affinity.devices, None, None, prompt=100, context=0,
                      expected=None, affinity=affinity, env_task="unshaped")
    assert (plan.prefill_worker, plan.decode_worker) == ("c", "b")
    assert plan.estimate_s is None


def test_the_mapping_is_logged_once_settled_and_again_when_it_changes(caplog):
    affinity, workers = _paper_mix_affinity()
    caplog.set_level(logging.INFO, logger="flows.training.turn_placement")
    affinity.plan(workers, "gem_math_like", None, None)
    assert not caplog.records  # priced from the config's shape, not settled yet
    for _ in range(SETTLE_TRAJECTORIES):
        affinity.lengths.finished("gem_math_like", 2)
    affinity.plan(workers, "gem_math_like", None, None)
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "affinity: env task gem_math_like -> bandwidth"]
    assert affinity.mapping()["gem_math_like"]["settled"]
    # its responses turn out short and its turns many: a prefill-heavy task now
    caplog.clear()
    for _ in range(300):
        affinity.lengths.record("gem_math_like", 20, prompt=3000)
        affinity.lengths.finished("gem_math_like", 12)
    affinity.plan(workers, "gem_math_like", None, None)
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "affinity: env task gem_math_like -> compute"]
