"""The CPU a benchmarked run uses: the cores its whole process tree keeps busy (a run of the
Dask flow is a driver and a worker process per pool; a one-process peer is one), sampled from
outside with psutil while it runs."""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path

import psutil

CPU_POLL_S = 0.5
CPU_WINDOW = (0.3, 0.9)  # the part of a run's wall time its busy cores are measured over


def run_sampling_cpu(cmd: list[str], cwd: Path | None = None) -> list[tuple[float, float]]:
    """Run ``cmd`` to its end, sampling every ``CPU_POLL_S`` the CPU seconds (user + system)
    that its whole process tree has used so far: ``(monotonic time, CPU seconds)`` pairs. A
    process that ends keeps the CPU time it was last seen with."""
    proc = subprocess.Popen(cmd, cwd=cwd)
    used: dict[tuple[int, float], float] = {}  # (pid, start time) -> CPU seconds
    samples = []
    try:
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            with contextlib.suppress(psutil.Error):
                for p in [root, *root.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        t = p.cpu_times()
                        used[(p.pid, p.create_time())] = t.user + t.system
            samples.append((time.monotonic(), sum(used.values())))
            time.sleep(CPU_POLL_S)
    finally:  # interrupted: the run goes with it
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    return samples


def cores_busy(samples: list[tuple[float, float]]) -> float | None:
    """The mean number of cores a run's processes kept busy over ``CPU_WINDOW`` of its wall
    time (past the start-up, before the end's writing of files)."""
    if len(samples) < 3:
        return None
    t0, t1 = samples[0][0], samples[-1][0]
    lo, hi = (t0 + f * (t1 - t0) for f in CPU_WINDOW)
    inside = [s for s in samples if lo <= s[0] <= hi]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])
