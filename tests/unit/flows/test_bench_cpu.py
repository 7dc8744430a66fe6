"""Sampling the CPU of a benchmarked run's process tree (flows/benchmarks/cpu.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flows.benchmarks import cpu


def test_cores_busy_are_read_over_the_middle_of_a_run():
    # 10 s: a start-up at 2 cores, then 1.5 cores, then an end at none
    samples = [(t, 2.0 * min(t, 2) + 1.5 * max(0, min(t, 9) - 2)) for t in range(11)]
    assert cpu.cores_busy(samples) == pytest.approx(1.5)  # from 3 s to 9 s
    assert cpu.cores_busy(samples[:2]) is None


def test_the_cpu_of_a_run_s_whole_process_tree_is_sampled():
    """A parent that waits on a child busy for 2 s: the CPU is the child's, and counted."""
    busy = ("import time\nt = time.monotonic()\nwhile time.monotonic() - t < 2: pass")
    waits = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {busy!r}])"
    sleeps = "import time; time.sleep(2)"
    working = cpu.cores_busy(cpu.run_sampling_cpu([sys.executable, "-c", waits]))
    idle = cpu.cores_busy(cpu.run_sampling_cpu([sys.executable, "-c", sleeps]))
    assert working > 0.3 > idle
    with pytest.raises(subprocess.CalledProcessError):
        cpu.run_sampling_cpu([sys.executable, "-c", "raise SystemExit(3)"])
