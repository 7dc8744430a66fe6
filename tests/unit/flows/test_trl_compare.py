"""RollArc's default and the TRL baseline side by side (flows/benchmarks/trl_compare.py): the
figures read from a run's metric rows, the comparison over seeds and the pooled report. Needs no
``trl``."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from flows.benchmarks import trl_baseline
from flows.benchmarks import trl_compare as tc


def test_figures_find_the_first_three_step_mean_at_target():
    succ = [0.5, 0.9, 0.8, 0.6, 0.9, 0.95]
    rows = [{"train/step": i + 1, "perf/elapsed_s": 2.0 * (i + 1), tc.SUCCESS_KEY: s}
            for i, s in enumerate(succ)]
    f = tc.run_figures(rows)
    assert f["step_s"] == [2.0] * 6 and f["s_per_step"] == 2.0
    assert (f["step_to_target"], f["s_to_target"]) == (6, 12.0)  # (0.6 + 0.9 + 0.95) / 3
    assert tc.run_figures(rows[:5])["step_to_target"] is None
    assert f["trained_tokens"] is None and f["s_per_1k_tokens"] is None  # rows without sizes


def test_figures_price_a_run_per_thousand_trained_tokens():
    """Two steps of 64 trajectories of 100 and then 50 tokens (a policy that learned plays
    shorter episodes) in 3 s: 9,600 tokens, 0.3125 s per thousand."""
    rows = [{"train/step": 1, "perf/elapsed_s": 2.0, "rollout/batch_trajectories": 64,
             "rollout/sequence_tokens": 100.0},
            {"train/step": 2, "perf/elapsed_s": 3.0, "rollout/batch_trajectories": 64,
             "rollout/sequence_tokens": 50.0}]
    f = tc.run_figures(rows)
    assert f["trained_tokens"] == 9600 and f["s_per_1k_tokens"] == pytest.approx(0.3125)
    del rows[1]["rollout/sequence_tokens"]  # a step without its size: no figure, not a wrong one
    assert tc.run_figures(rows)["s_per_1k_tokens"] is None


def test_comparison_calls_a_gain_only_when_every_seed_agrees():
    def run(system, seed, s):
        return {"system": system, "seed": seed, "s_per_step": s, "s_per_1k_tokens": s / 10,
                "step_to_target": None, "s_to_target": None}

    console = SimpleNamespace(print=lambda *a, **k: None)
    faster = tc.compare_report([run("rollarc", 0, 1.0), run("trl", 0, 2.0),
                                run("rollarc", 1, 1.5), run("trl", 1, 2.0)], console)
    assert faster["ratios"]["s_per_step"]["verdict"] == "rollarc faster"
    assert faster["ratios"]["s_per_step"]["median"] == pytest.approx(0.625)
    assert faster["ratios"]["s_per_1k_tokens"]["verdict"] == "rollarc faster"
    mixed = tc.compare_report([run("rollarc", 0, 1.0), run("trl", 0, 2.0),
                               run("rollarc", 1, 3.0), run("trl", 1, 2.0)], console)
    assert mixed["ratios"]["s_per_step"]["verdict"] == "no difference beyond the spread"
    assert "s_to_target" not in mixed["ratios"]


def test_pooled_comparisons_pair_seeds_across_their_outputs(tmp_path):
    def run(system, seed, s):
        return {"system": system, "seed": seed, "s_per_step": s, "step_to_target": None,
                "s_to_target": None}

    first, second = tmp_path / "a", tmp_path / "b"
    for d, runs in ((first, [run("rollarc", 0, 1.0), run("trl", 0, 2.0)]),
                    (second, [run("rollarc", 1, 3.0), run("trl", 1, 2.0)])):
        d.mkdir()
        (d / "compare.json").write_text(json.dumps({"runs": runs}))
    pooled = tc.pool([first, second], tmp_path / "pooled")
    assert pooled["ratios"]["s_per_step"]["seeds"] == 2
    assert pooled["ratios"]["s_per_step"]["median"] == pytest.approx(1.0)  # 0.5 and 1.5
    saved = json.loads((tmp_path / "pooled" / "compare.json").read_text())
    assert saved["ratios"] == pooled["ratios"]
    with pytest.raises(ValueError, match="rollarc seed 0"):
        tc.pool([first, first])
    with pytest.raises(FileNotFoundError, match="no compare.json"):
        tc.pool([tmp_path / "pooled" / "missing"])


def test_pool_reports_earlier_runs_and_takes_no_run_options(capsys):
    for argv in (["--pool", "a", "--compare"], ["--pool", "a", "--frozen"],
                 ["--pool", "a", "seed=3"]):
        with pytest.raises(SystemExit) as exc:
            trl_baseline.main(argv)
        assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "not allowed with argument" in err and "--frozen and overrides do not apply" in err
