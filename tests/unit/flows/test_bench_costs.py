"""Equal cost (flows/benchmarks/costs.py) and figures over repeats (flows/benchmarks/repeats.py,
flows/benchmarks/tables.py): every shipped workload's systems at RollArc's $/h within the
tolerance, one monolithic baseline for the bench and the simulator, serverless GPU-seconds
priced, paired ratios and their verdicts."""

from __future__ import annotations

import math

import pytest

from flows.bench import SECTIONS, systems
from flows.benchmarks import costs
from flows.benchmarks.repeats import Spread, Verdict, paired_ratios, ratio, verdict
from flows.benchmarks.tables import compare, merge_repeats, system_tables
from flows.config import load_config, with_overrides
from flows.simulation import systems as sim_systems
from tests import ROOT

WORKLOADS = sorted((ROOT / "config" / "bench").glob("*.yaml"))


@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda p: p.stem)
def test_every_system_of_a_shipped_workload_costs_rollarcs_dollars_per_hour(workload):
    cfg = load_config(workload)
    _, reference = costs.provisioned(cfg)
    chosen = systems(cfg, SECTIONS)
    assert {s.section for s in chosen} >= {"end_to_end", "affinity", "redundancy"}
    for s in chosen:
        _, cost = costs.provisioned(with_overrides(cfg, s.overrides))
        assert abs(costs.deviation(cost, reference)) <= costs.COST_TOLERANCE, (s.name, cost)


@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda p: p.stem)
def test_the_bench_and_the_simulator_share_one_monolithic_baseline(workload):
    cfg = load_config(workload)
    bench = {s.name: s.overrides for s in systems(cfg, ("end_to_end",))}
    for name in ("async-monolithic", "sync-monolithic"):
        assert bench[name] == sim_systems.system_overrides(cfg, name)


def test_the_monolithic_baseline_takes_its_own_engine_size_when_the_workload_sets_one():
    cfg = load_config(ROOT / "config" / "bench" / "paper_mix.yaml")
    _, reference = costs.provisioned(cfg)
    # unset, the baseline's engines follow RollArc's largest inference engine (4 H20)
    follow = with_overrides(cfg, ["cluster.monolithic_gpus=null"])
    assert costs.monolithic_shape(follow) == costs.Shape(3, 4)
    for gpus, workers in ((2, 6), (4, 3)):
        own = with_overrides(cfg, [f"cluster.monolithic_gpus={gpus}"])
        assert costs.monolithic_shape(own) == costs.Shape(workers, gpus)
        _, cost = costs.provisioned(with_overrides(own, costs.monolithic_overrides(own)))
        assert abs(costs.deviation(cost, reference)) <= costs.COST_TOLERANCE


def test_the_shape_search_meets_the_tolerance_where_four_workers_of_1_2_4_8_could_not():
    # $13.60/h of inference beside a $4.40/h trainer, in H20s ($0.95): 14 devices
    shape = costs.equal_cost_shape(18.0, 4.4, 0.95, engine_gpus=4)
    assert shape.devices == 14 and shape.workers <= costs.BENCH_MAX_WORKERS
    assert abs(costs.deviation(4.4 + shape.devices * 0.95, 18.0)) <= costs.COST_TOLERANCE
    # engines of the reference's size when that meets the tolerance
    assert costs.equal_cost_shape(17.6, 0.0, 2.2, engine_gpus=4) == costs.Shape(2, 4)
    # the model must fit: no engine smaller than three devices
    assert costs.equal_cost_shape(17.6, 0.0, 2.2, 1, fits=lambda g: g >= 3).gpus >= 3
    # a worker limit is kept, at the price of the tolerance
    capped = costs.equal_cost_shape(100.0, 0.0, 1.0, engine_gpus=1, max_workers=4)
    assert capped.workers <= 4
    # at cluster scale the simulator's shape keeps the reference engine
    big = costs.equal_cost_shape(6000.0, 0.0, 2.2, engine_gpus=4, max_workers=None)
    assert big.gpus == 4 and abs(costs.deviation(big.devices * 2.2, 6000.0)) < 0.01


def test_serverless_gpu_seconds_are_priced_into_a_runs_cost():
    cfg = load_config(ROOT / "config" / "bench" / "reward_model.yaml")
    judge = cfg.reward.judge
    price = {"H800": 2.20, "H20": 0.95}[judge.profile]
    cost = costs.run_cost(cfg, wall_s=3600.0, serverless_billed_s=1800.0)
    assert cost["provisioned_usd"] == pytest.approx(costs.provisioned(cfg)[1])
    assert cost["serverless_usd"] == pytest.approx(1800.0 * judge.gpus * price / 3600)
    assert cost["per_hour"] == pytest.approx(cost["provisioned_usd"] + cost["serverless_usd"])
    plain = costs.run_cost(load_config(ROOT / "config" / "bench" / "uniform.yaml"), 3600.0,
                           1800.0)
    assert plain["serverless_usd"] == 0.0  # no reward model: nothing billed


# -- repeats -------------------------------------------------------------------------------------


def test_a_ratio_is_a_gain_or_a_loss_only_when_every_repeat_agrees():
    assert verdict([1.1, 1.3, 1.05]) is Verdict.GAIN
    assert verdict([0.8, 0.95, 0.9]) is Verdict.LOSS
    assert verdict([0.95, 1.2, 1.1]) is Verdict.NONE
    assert verdict([1.0, 1.2, 1.1]) is Verdict.NONE  # a tie is no gain
    assert verdict([1.5]) is Verdict.ONE_RUN


def _run(step_s: float, tokens_per_s: float, wall_s: float = 100.0, **kw) -> dict:
    return {"step_s_median": step_s, "trained_tokens_per_s": tokens_per_s, "wall_s": wall_s,
            "dropped": kw.pop("dropped", {}), **kw}


def test_ratios_are_paired_by_repeat_and_oriented_for_the_reference():
    system = [_run(40.0, 100.0), _run(60.0, 80.0), _run(50.0, 90.0)]
    rollarc = [_run(20.0, 200.0), _run(40.0, 160.0), _run(25.0, 90.0)]
    steps = paired_ratios(system, rollarc, lambda r: r["step_s_median"], lower_is_better=True)
    assert steps == [2.0, 1.5, 2.0]  # each repeat against its own, not medians against medians
    tokens = ratio(system, rollarc, lambda r: r["trained_tokens_per_s"], lower_is_better=False)
    assert tokens.values == (2.0, 2.0, 1.0) and tokens.verdict is Verdict.NONE
    assert tokens.text() == "2.00 [1.00, 2.00] no difference"
    # a repeat missing on one side is left out
    assert len(paired_ratios(system, rollarc[:2], lambda r: r["step_s_median"], True)) == 2


def test_repeats_merge_into_medians_with_their_spread_and_tables_show_them():
    runs = {"rollarc": [_run(20.0, 200.0, 90.0, dropped={"stale": 2}),
                        _run(22.0, 190.0, 100.0, dropped={"stale": 4}),
                        _run(30.0, 150.0, 120.0)],
            "sync-monolithic": [_run(40.0, 100.0), _run(44.0, 95.0), _run(45.0, 90.0)]}
    for rs in runs.values():
        for r in rs:
            r |= {"busy_fraction": {"decode": 0.9}, "trainer_busy_fraction": 0.5,
                  "staleness_mean": 1.0, "staleness_max": 2, "success": {"game": 0.5},
                  "cost_per_hour": 18.0}
    merged = {k: merge_repeats(v) for k, v in runs.items()}
    r = merged["rollarc"]
    assert r["step_s_median"] == 22.0 and r["repeats"] == 3
    assert r["spread"]["step_s_median"] == {"median": 22.0, "low": 20.0, "high": 30.0}
    assert r["dropped"] == {"stale": 2}  # median of 2, 4 and 0
    ratios = {"sync-monolithic": compare(runs["sync-monolithic"], runs["rollarc"])}
    assert ratios["sync-monolithic"]["s/step"].verdict is Verdict.GAIN
    text = system_tables(merged, ratios, "rollarc")
    assert "22.0 (20.0-30.0)" in text and "x vs rollarc, s/step" in text
    assert "2.00 [1.50, 2.00] gain" in text
    assert Spread.of([3.0]).text() == "3.00" and math.isnan(Spread.of([]).median)
