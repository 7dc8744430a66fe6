"""flows/benchmarks/scheduler.py and flows/benchmarks/member_inputs.py with tiny budgets: the
figures' structure and counts (never their values), the JSON round trip, no process left behind,
and the scripts as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest

from flows.benchmarks.scheduler import measure
from flows.benchmarks.scheduler_capacity import (
    CAPACITY_FILE,
    SchedulerCapacity,
    load_capacity,
    save_capacity,
)
from tests import CHECKOUT_PYTHONPATH, ROOT

ENV = {**os.environ, "PYTHONPATH": CHECKOUT_PYTHONPATH}

pytestmark = pytest.mark.integration


def _alive_children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE}


def test_measure_counts_add_up_and_round_trip(tmp_path):
    before = _alive_children()
    cap = measure(seconds=0.5, concurrency=(2, 8), chains=40, cohort=4, threads=2,
                  turns_per_trajectory=3)
    assert _alive_children() <= before, "a scheduler or worker process was left running"

    for static, mapped in ((cap.static, False), (cap.static_mapped, True)):
        assert static.mapped is mapped and static.chains == 40 and static.tasks == 120
        assert static.wall_s > 0 and static.tasks_per_s > 0
        assert static.scheduler_us_per_task > 0
        # process CPU times tick every 10 ms: the mapped run's driver (three map calls, one
        # wait, some 80 ms) may spend less than a tick, and then measures 0
        assert static.driver_us_per_task > 0 if not mapped else static.driver_us_per_task >= 0
    assert [r.concurrency for r in cap.dynamic] == [2, 8]
    assert all(r.cohort == 1 for r in cap.dynamic)
    for r in cap.dynamic:
        assert r.errors == 0
        # every trajectory in flight finished at least its first turn (the run drains)
        assert r.turns >= r.concurrency
        assert r.tasks == 3 * r.turns
        assert r.turns_per_s > 0 and r.driver_us_per_turn > 0 and r.scheduler_us_per_task > 0
    (b,) = cap.batched
    assert (b.concurrency, b.cohort, b.errors) == (8, 4, 0)
    # one task stands for a cohort's 4 turns
    assert b.turns % 4 == 0 and b.tasks == 3 * b.turns // 4 and b.turns >= 8

    assert cap.tasks_per_s == cap.static.tasks_per_s
    assert cap.mapped_tasks_per_s == cap.static_mapped.tasks_per_s
    assert cap.turns_per_s == max(r.turns_per_s for r in cap.dynamic)
    assert cap.batched_turns_per_s == b.turns_per_s
    assert cap.machine.cpu_count >= 1 and cap.machine.dask_version and cap.seconds == 0.5

    path = save_capacity(cap, tmp_path / "out")
    assert path == tmp_path / "out" / CAPACITY_FILE
    assert load_capacity(path) == cap == load_capacity(tmp_path / "out")
    assert isinstance(load_capacity(path), SchedulerCapacity)


def test_script_runs_as_a_user_runs_it(tmp_path):
    out = tmp_path / "bench"
    before = _alive_children()
    proc = subprocess.run([sys.executable, "-m", "flows.benchmarks.scheduler", "--seconds", "1",
                           "--chains", "30", "--concurrency", "4", "--cohort", "2",
                           "--threads", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert _alive_children() <= before
    cap = load_capacity(out)
    assert [r.concurrency for r in cap.dynamic] == [4]
    assert cap.dynamic[0].tasks == 3 * cap.dynamic[0].turns and cap.batched[0].cohort == 2
    table = (out / "capacity.md").read_text()
    assert "static graph (client.submit)" in table and "batched (cohort 2)" in table
    assert "| dynamic turns | C=4 |" in proc.stdout


def test_member_inputs_bench_runs_both_forms_as_a_user_runs_it(tmp_path):
    out = tmp_path / "inputs"
    before = _alive_children()
    cmd = [sys.executable, "-m", "flows.benchmarks.member_inputs", "--out", str(out)]
    proc = subprocess.run(cmd + ["--tasks", "10", "--members", "8", "--repeats", "2"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert _alive_children() <= before
    figures = json.loads((out / "member_inputs.json").read_text())
    assert {f: len(r) for f, r in figures["runs"].items()} == {"none": 2, "pairs": 2,
                                                              "by_source": 2}
    # a ratio per repeat whose CPU time psutil could tell (tiny runs may show none)
    assert all(len(figures["pairs_over_by_source"][role]["per_repeat"]) <= 2
               for role in ("driver", "scheduler", "workers"))
    assert "pairs / by_source" in proc.stdout
    bad = subprocess.run(cmd + ["--tasks", "0"], capture_output=True, text=True, timeout=60,
                         cwd=ROOT, env=ENV)
    assert bad.returncode == 2 and "--tasks" in bad.stderr
