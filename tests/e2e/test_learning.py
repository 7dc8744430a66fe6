"""Full-length runs of the default config: async/disaggregated learns FrozenLake, and so do the
baselines. 6-10 minutes each on 2 cores: marked slow, run with ``pytest -m slow``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flows.monitoring.metrics import read_metrics
from tests import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1200)]


def _run(tmp_path, *overrides):
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(ROOT / "flows" / "train.py"), "--run-dir", str(run),
                           "metrics.progress=false", "cluster.dashboard_port=0", *overrides],
                          capture_output=True, text=True, timeout=1100, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = read_metrics(run)
    summary = json.loads((run / "summary.json").read_text())
    first_08 = next((m["train/step"] for m in metrics
                     if m.get("env/frozenlake/success", 0) >= 0.8), None)
    # figures for the CI log (.ci/run shows the output of passed slow tests)
    print(json.dumps({"overrides": overrides, "elapsed_s": round(summary["elapsed_s"]),
                      "steps": len(metrics), "first_step_success_0.8": first_08,
                      "final": {k: round(v, 3) for k, v in summary["final_metrics"].items()
                                if k.startswith(("env/frozenlake", "perf/", "rollout/stal"))},
                      "trajectories": summary["trajectories"],
                      "tasks_per_stage_per_pool": summary["tasks_per_stage_per_pool"]}))
    return metrics, summary


def _success(metrics, env="frozenlake", window=3):
    """Success of the first steps, and the best moving average over ``window`` steps (a single
    step's batch is only ~48 episodes, so one step is a noisy reading)."""
    vals = [m[f"env/{env}/success"] for m in metrics if f"env/{env}/success" in m]
    avg = [sum(vals[i : i + window]) / window for i in range(len(vals) - window + 1)]
    return vals[:window], max(avg)


def test_default_run_learns_frozenlake(tmp_path):
    metrics, summary = _run(tmp_path)
    first, best = _success(metrics)
    assert max(first) <= 0.1, first
    assert best >= 0.8, best
    assert max(m["rollout/staleness_max"] for m in metrics) <= 2


@pytest.mark.parametrize("switch", ["mode=sync", "placement=monolithic"])
def test_baselines_learn_too(tmp_path, switch):
    metrics, summary = _run(tmp_path, switch)
    first, best = _success(metrics)
    assert max(first) <= 0.1 and best >= 0.5, (first, best)
    t = summary["trajectories"]
    assert t["started"] == t["trained"] + sum(t["dropped"].values())
