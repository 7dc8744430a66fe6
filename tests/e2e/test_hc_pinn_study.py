"""The HC-PINN spectral study (flows/hc_pinn_study.py, its sweep and report in flows/studies/,
its job and statistics in tasks/hc_pinn/): the command line end to end on a real Dask cluster
and in process, failures recorded, the kernel's spectrum from the SVD of J, and the correlation,
verdict and collapse rules on synthetic runs."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from flows import hc_pinn_study
from flows.studies import hc_pinn_sweep
from tasks.hc_pinn.boundary import BoundarySpec, parse_spec
from tasks.hc_pinn.collapse import collapsed, contrast, summarise
from tasks.hc_pinn.correlations import (
    POOLED,
    Measure,
    Outcome,
    Predictor,
    convergence,
    correlations,
    lexicographic_ranks,
    spearman,
    verdict,
)
from tasks.hc_pinn.ntk import (
    HCPinn,
    analyse,
    eigenvalues,
    jacobian_spectrum,
    make_network,
    residual_ntk,
)
from tasks.hc_pinn.problems import get_problem
from tasks.hc_pinn.study import Failure, StudyCase, StudyRun
from tests import CHECKOUT_PYTHONPATH, ROOT

STUDY = ROOT / "flows" / "hc_pinn_study.py"
ENV = {**os.environ, "PYTHONPATH": CHECKOUT_PYTHONPATH}
SMALL = ["--problems", "poisson1d", "--specs", "poly 1", "sine 4", "rfun 1", "--seeds", "0", "1",
         "--steps", "100"]
OUTPUTS = ("results.json", "results.csv", "summary.md", "hc_pinn_study.png")


# -- the command line ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dask_study(tmp_path_factory):
    """The small study through the Dask path (one local worker process), as a user runs it."""
    out = tmp_path_factory.mktemp("hc_pinn_dask")
    proc = subprocess.run([sys.executable, str(STUDY), *SMALL, "--workers", "1", "--out", str(out)],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, proc


@pytest.mark.integration
def test_the_study_runs_end_to_end_on_a_dask_cluster(dask_study):
    out, proc = dask_study
    for name in OUTPUTS:
        assert (out / name).stat().st_size > 0, name
    assert (out / "hc_pinn_study.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = proc.stdout
    assert "local cluster: 1 workers" in proc.stderr
    assert "| poisson1d | sine 4 |" in text and "| poisson1d | rfun 1 | COMMON |" in text
    assert "at float64 limit" in text
    for measure in Measure:
        assert f"| poisson1d | {measure.value} | 6 |" in text
    assert "Verdict: the measurements" in text or "Verdict: too few runs" in text
    # sin(pi x)^4 flattens the kernel to one mode: 100 steps leave most of the loss
    assert "Collapsing on poisson1d: sine 4" in text
    data = json.loads((out / "results.json").read_text())
    runs = data["runs"]
    assert len(runs) == 6
    assert sorted((r["spec"], r["seed"]) for r in runs) == sorted(
        (s, seed) for s in ("poly 1", "sine 4", "rfun 1") for seed in (0, 1))
    for r in runs:
        assert r["failure"] is None and r["reason"] == ""
        assert math.isfinite(r["effective_rank"]) and 1.0 <= r["effective_rank"] <= 64
        assert r["steps"] <= 100 and r["max_steps"] == 100
    assert data["config"]["specs"] == ["poly 1", "sine 4", "rfun 1"]
    assert data["verdict"]["text"] in text
    assert len((out / "results.csv").read_text().strip().splitlines()) == 1 + 6


@pytest.mark.integration
def test_in_process_runs_measure_what_the_dask_workers_measured(dask_study, tmp_path):
    out, _ = dask_study
    assert hc_pinn_study.main([*SMALL, "--workers", "0", "--out", str(tmp_path)]) == 0
    on_dask = json.loads((out / "results.json").read_text())["runs"]
    here = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert len(here) == len(on_dask) == 6
    for a, b in zip(here, on_dask, strict=True):
        assert (a["problem"], a["spec"], a["seed"], a["steps"], a["reached"]) == \
            (b["problem"], b["spec"], b["seed"], b["steps"], b["reached"])
        for k in ("effective_rank", "top_share", "final_loss", "l2_error"):
            assert a[k] == pytest.approx(b[k], rel=1e-9), k


@pytest.mark.integration
def test_the_study_runs_on_a_running_scheduler(tmp_path):
    from distributed import LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as bare:
        # jobs ask for CPU_ENV: a cluster without it is refused, not waited on forever
        assert hc_pinn_study.main(["--scheduler", bare.scheduler_address,
                                   "--out", str(tmp_path)]) == 2
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0", resources={"CPU_ENV": 1}) as cluster:
        assert hc_pinn_study.main(["--scheduler", cluster.scheduler_address, "--problems",
                                   "heat1d", "--specs", "tanh 4", "--seeds", "3", "--steps", "20",
                                   "--out", str(tmp_path)]) == 0
    (run,) = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert (run["problem"], run["spec"], run["seed"], run["failure"]) == ("heat1d", "tanh 4", 3,
                                                                         None)
    assert run["n_points"] == 144 and run["steps"] <= 20


def test_an_unknown_problem_exits_2_naming_the_argument(tmp_path):
    proc = subprocess.run([sys.executable, str(STUDY), "--problems", "poisson3d", "--out",
                           str(tmp_path)], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "argument --problems" in proc.stderr and "poisson3d" in proc.stderr
    assert not (tmp_path / "results.json").exists()


@pytest.mark.parametrize("bad", ["wave 2", "sine 99", "sine two", "sine 2 extra"])
def test_a_bad_spec_exits_2_naming_the_argument(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        hc_pinn_study.parse_args(["--specs", "poly 1", bad])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --specs" in err and repr(bad) in err


def test_specs_parse_strictly_and_cases_drop_duplicates():
    args = hc_pinn_study.parse_args(["--problems", "heat1d", "--specs", "Sine 2", " sine  2 ",
                                     "exp", "--seeds", "1", "1"])
    assert args.specs == [BoundarySpec("sine", 2), BoundarySpec("sine", 2), BoundarySpec("exp", 1)]
    cases = hc_pinn_study.cases_of(args)
    assert [(c.problem, str(c.spec), c.seed) for c in cases] == [("heat1d", "sine 2", 1),
                                                                ("heat1d", "exp 1", 1)]
    keys = {hc_pinn_sweep.job_key(c) for c in cases}
    assert len(keys) == 2 and all(k.startswith("hc-pinn-heat1d-") for k in keys)
    longer = StudyCase("heat1d", BoundarySpec("sine", 2), 1, max_steps=5000)
    assert hc_pinn_sweep.job_key(longer) not in keys  # another budget, another result


# -- failures are recorded -------------------------------------------------------------------------


def fake_job(case: StudyCase) -> StudyRun:
    """A job that fails on ``sine 4`` and otherwise returns a made-up run at once."""
    if case.spec == BoundarySpec("sine", 4):
        raise ValueError("the kernel exploded")
    return _run(case.problem, str(case.spec), case.seed, erank=1.5, steps=10)


CASES = [StudyCase("poisson1d", parse_spec(s), 0, max_steps=10)
         for s in ("poly 1", "sine 4", "rfun 1")]


def _check_failure_recorded(runs):
    assert [r.ok for r in runs] == [True, False, True]
    bad = runs[1]
    assert (bad.problem, bad.spec, bad.seed) == ("poisson1d", "sine 4", 0)
    assert bad.failure is Failure.JOB_ERROR
    assert "ValueError" in bad.reason and "the kernel exploded" in bad.reason
    assert math.isnan(bad.effective_rank)
    (s,) = [s for s in summarise(runs) if s.spec == "sine 4"]
    assert s.runs == 0 and s.failed == 1 and not s.collapses


def test_a_failing_job_is_recorded_in_process():
    _check_failure_recorded(hc_pinn_sweep.run_in_process(CASES, job=fake_job))


def test_a_study_with_a_failed_run_reports_it_and_exits_1(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(hc_pinn_study, "run_jobs", lambda cases, workers, scheduler:
                        hc_pinn_sweep.run_in_process(cases, job=fake_job))
    assert hc_pinn_study.main(["--problems", "poisson1d", "--specs", "poly 1", "sine 4",
                               "rfun 1", "--seeds", "0", "--steps", "10", "--workers", "0",
                               "--out", str(tmp_path)]) == 1
    assert "FAILED poisson1d sine 4 seed 0" in capsys.readouterr().out
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [r["failure"] is None for r in runs] == [True, False, True]


@pytest.mark.integration
def test_a_failing_job_is_recorded_on_dask():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0", resources={"CPU_ENV": 1}) as cluster, \
            Client(cluster) as client:
        _check_failure_recorded(hc_pinn_sweep.run_on_dask(client, CASES, job=fake_job))


# -- the kernel's spectrum ---------------------------------------------------------------------------


def test_the_svd_of_j_gives_the_kernels_spectrum_and_resolves_it_further():
    problem = get_problem("poisson1d")
    pinn = HCPinn(problem, BoundarySpec("poly", 1), make_network(1, 0))
    xs = problem.collocation()
    from_svd = jacobian_spectrum(pinn, xs)
    from_kernel = eigenvalues(residual_ntk(pinn, xs))
    assert from_svd.shape == from_kernel.shape == (64,)
    assert torch.all(from_svd[:-1] >= from_svd[1:])
    torch.testing.assert_close(from_svd[:3], from_kernel[:3], rtol=1e-8, atol=0.0)
    # eigvalsh of J J^T stops at eps * lambda_1 and clamps the rest to 0; the SVD goes further
    assert int((from_kernel > 0).sum()) < 64 and bool((from_svd > 0).all())
    spectrum, values = analyse(problem, BoundarySpec("poly", 1), 0)
    assert torch.equal(values, from_svd)
    assert math.isfinite(spectrum.condition_number) and spectrum.condition_at_limit
    assert 1 < spectrum.numerical_rank < 64


def test_a_kernel_wider_than_the_parameters_has_exact_zero_eigenvalues():
    problem = get_problem("poisson1d")  # 64 points, 7 parameters
    pinn = HCPinn(problem, BoundarySpec("sine", 1), make_network(1, 0, width=2, depth=1))
    values = jacobian_spectrum(pinn, problem.collocation())
    assert values.shape == (64,) and bool((values[7:] == 0).all()) and bool((values[:7] > 0).all())
    spectrum, _ = analyse(problem, BoundarySpec("sine", 1), 0, width=2, depth=1)
    assert spectrum.condition_number == math.inf and spectrum.condition_at_limit
    assert spectrum.numerical_rank <= 7


# -- the evidence, on synthetic runs ----------------------------------------------------------------


def _run(problem="p", spec="poly 1", seed=0, *, erank=1.5, logcond=30.0, top=None, steps=100,
         reached=True, loss=1e-4, l2=1e-2, max_steps=1000) -> StudyRun:
    return StudyRun(problem=problem, spec=spec, seed=seed, common=spec == "poly 1", n_points=64,
                    effective_rank=erank, condition_number=10.0**logcond, log10_condition=logcond,
                    condition_at_limit=False, numerical_rank=10,
                    top_share=1 / erank if top is None else top, steps=steps,
                    max_steps=max_steps, reached=reached, final_loss=loss, l2_error=l2,
                    boundary_b_max=0.0, seconds=0.0)


def test_spearman_of_perfect_and_undefined_orders():
    assert spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4], [1, 4, 9, 16]) == pytest.approx(1.0)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))      # a constant predictor
    assert math.isnan(spearman([1, 2], [2, 1]))            # too few pairs
    assert math.isnan(spearman([1, 2, math.nan], [1, 2, 3]))


def test_steps_to_threshold_ranks_missed_runs_after_reached_ones_by_final_loss():
    assert lexicographic_ranks([(0, 5), (1, 0.5), (0, 3), (0, 5)]) == [2.5, 4.0, 1.0, 2.5]
    runs = [_run(steps=1000, reached=False, loss=0.5), _run(steps=300),
            _run(steps=1000, reached=False, loss=0.01), _run(steps=900),
            _run(steps=1000, reached=False, loss=math.nan)]  # diverged: last
    assert convergence(runs, Measure.STEPS) == [4.0, 1.0, 3.0, 2.0, 5.0]
    assert convergence(runs, Measure.LOSS)[:3] == pytest.approx([math.log10(0.5), -4, -2])
    assert convergence(runs, Measure.LOSS)[4] == math.inf


SLOW = range(6)                     # slowness order of six runs per problem
NOISE = [3, 6, 1, 5, 2, 4]          # a permutation nearly uncorrelated with it (rho -0.09)


def _runs(erank, logcond, problems=("a", "b")):
    """Six runs per problem, slower and slower; ``erank(i)``, ``logcond(i)`` of the i-th."""
    return [_run(problem=p, spec=f"poly {i + 1}", erank=erank(i), logcond=logcond(i),
                 steps=100 * (i + 1), loss=1e-5 * (i + 1), l2=1e-3 * (i + 1))
            for p in problems for i in SLOW]


def test_a_rank_falling_with_slowness_beats_an_uncorrelated_condition_number():
    runs = _runs(erank=lambda i: 2.0 - 0.1 * i, logcond=lambda i: 30 + NOISE[i])
    corrs = correlations(runs)
    assert {c.scope for c in corrs} == {"a", "b", POOLED}
    for c in corrs:
        assert c.rho[Predictor.EFFECTIVE_RANK] == pytest.approx(-1.0)
        assert abs(c.rho[Predictor.LOG10_CONDITION]) < 0.2
        assert c.stronger() is Predictor.EFFECTIVE_RANK
    v = verdict(corrs, runs)
    assert v.outcome is Outcome.SUPPORTED
    assert all(c.rank_wins == 2 and c.problems == 2 for c in v.comparisons)
    assert v.text().startswith("Verdict: the measurements SUPPORT the claim")
    assert "mean |rho| 1.00 (effective rank) vs 0.09 (condition number)" in v.text()


def test_a_condition_number_rising_with_slowness_contradicts_the_claim():
    runs = _runs(erank=lambda i: 1.5 + 0.1 * NOISE[i], logcond=lambda i: 30 + i)
    v = verdict(correlations(runs), runs)
    assert v.outcome is Outcome.CONTRADICTED
    assert all(c.condition_wins == 2 for c in v.comparisons)
    assert "CONTRADICT" in v.text()


def test_a_rank_rising_with_slowness_does_not_support_the_claim():
    runs = _runs(erank=lambda i: 1.5 + 0.1 * i, logcond=lambda i: 30 + NOISE[i])
    v = verdict(correlations(runs), runs)
    assert v.outcome is Outcome.CONTRADICTED
    assert "higher effective rank went with slower convergence" in v.text()


def test_measures_that_disagree_give_a_mixed_verdict():
    runs = _runs(erank=lambda i: 2.0 - 0.1 * i, logcond=lambda i: 30 + NOISE[i])
    # the L2 error now rises with the condition number instead
    runs = [dataclasses.replace(r, l2_error=10.0 ** (r.log10_condition - 40)) for r in runs]
    v = verdict(correlations(runs), runs)
    outcomes = {c.measure: c.outcome for c in v.comparisons}
    assert outcomes[Measure.STEPS] is Outcome.SUPPORTED
    assert outcomes[Measure.L2] is Outcome.CONTRADICTED
    assert v.outcome is Outcome.MIXED and "MIXED" in v.text()


def test_too_few_runs_are_inconclusive():
    runs = [_run(), _run(seed=1, steps=200)]
    v = verdict(correlations(runs), runs)
    assert v.outcome is Outcome.INCONCLUSIVE and "too few runs" in v.text()


def test_collapse_is_stagnation_above_the_loss_level_on_most_seeds():
    assert collapsed(_run(reached=False, steps=1000, loss=0.5))
    assert not collapsed(_run(reached=False, steps=1000, loss=0.05))
    assert collapsed(_run(reached=False, steps=1000, loss=0.05), collapse_loss=0.01)
    assert not collapsed(_run(reached=True, loss=0.5))
    assert not collapsed(_run(reached=False, loss=math.nan))  # diverged, not stagnated
    runs = [_run(spec="sine 4", seed=s, reached=False, steps=1000, loss=loss)
            for s, loss in enumerate((0.6, 0.7, 0.01))]
    runs += [_run(spec="poly 1", seed=s, reached=s != 2, steps=1000 if s == 2 else 200,
                  loss=0.6 if s == 2 else 1e-4) for s in range(3)]
    by_spec = {s.spec: s for s in summarise(runs)}
    assert by_spec["sine 4"].collapsed == 2 and by_spec["sine 4"].collapses
    assert by_spec["poly 1"].collapsed == 1 and not by_spec["poly 1"].collapses
    assert by_spec["poly 1"].common and not by_spec["sine 4"].common
    pair = contrast(list(by_spec.values()))
    assert pair is not None and (pair[0].spec, pair[1].spec) == ("sine 4", "poly 1")
