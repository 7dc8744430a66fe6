"""The scheduler benchmark's cluster (:mod:`flows.benchmarks.scheduler`): a ``dask scheduler``
and two ``dask worker`` processes (no nanny), so that each role's CPU seconds are one process's,
read with psutil, and never mixed with the driver's as in a ``LocalCluster``."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
from distributed import Client

from flows.benchmarks.scheduler_capacity import CpuSample
from resources.pools import Tag

logger = logging.getLogger(__name__)

# the package root, for the worker processes to import the benchmark's task functions from the
# same checkout as the driver (an environment variable of the children, not a sys.path edit)
ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60
STOP_TIMEOUT_S = 15


@dataclass
class BenchCluster:
    """A scheduler process, an inference and an environment worker process, and a client."""

    client: Client
    inference: str  # worker address: GPU_COMPUTE and GPU_BANDWIDTH
    env: str  # worker address: CPU_ENV
    scheduler_proc: psutil.Process
    worker_procs: list[psutil.Process]
    threads: int

    def cpu(self) -> tuple[float, float, float, float]:
        """(wall, scheduler, driver, workers) seconds now."""
        def used(p: psutil.Process) -> float:
            t = p.cpu_times()
            return t.user + t.system
        return (time.perf_counter(), used(self.scheduler_proc), used(psutil.Process()),
                sum(used(p) for p in self.worker_procs))

    @contextlib.contextmanager
    def measured(self) -> Iterator[list[CpuSample]]:
        """Yields a list that holds, once the block ends, the block's :class:`CpuSample`."""
        box: list[CpuSample] = []
        before = self.cpu()
        yield box
        after = self.cpu()
        box.append(CpuSample(*(a - b for a, b in zip(after, before, strict=True))))

    def idle(self, timeout: float = 30) -> None:
        """Wait until the scheduler has forgotten every task (the last run's releases done),
        so that one measurement's clean-up is not billed to the next."""
        deadline = time.monotonic() + timeout
        while left := self.client.run_on_scheduler(_scheduler_tasks):
            if time.monotonic() > deadline:
                logger.warning("the scheduler still holds %d tasks", left)
                return
            time.sleep(0.05)


def _scheduler_tasks(dask_scheduler=None) -> int:
    return len(dask_scheduler.tasks)


def _spawn(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "DASK_LOGGING__DISTRIBUTED": "warning",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                       os.environ.get("PYTHONPATH")]))}
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", "dask", *args], env=env, stdout=f,
                                stderr=subprocess.STDOUT)


def _stop(procs: list[subprocess.Popen]) -> None:
    """Wait for the processes to exit; terminate, then kill, those that do not (children
    too, should any exist)."""
    children = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            children += psutil.Process(p.pid).children(recursive=True)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("pid %d did not stop on SIGTERM: killed", p.pid)
            p.kill()
            p.wait(timeout=STOP_TIMEOUT_S)
    for c in children:
        with contextlib.suppress(psutil.Error):
            c.kill()


@contextlib.contextmanager
def bench_cluster(threads: int = 8, slots: int = 64) -> Iterator[BenchCluster]:
    """Start the scheduler and the two workers as processes of their own; stop them all."""
    procs: list[subprocess.Popen] = []
    client = None
    with tempfile.TemporaryDirectory(prefix="bench-scheduler-") as tmp:
        tmpdir = Path(tmp)
        try:
            sched_file = tmpdir / "scheduler.json"
            procs.append(_spawn(["scheduler", "--host", "127.0.0.1", "--port", "0",
                                 "--no-dashboard", "--scheduler-file", str(sched_file)],
                                tmpdir / "scheduler.log"))
            deadline = time.monotonic() + START_TIMEOUT_S
            while not sched_file.exists():
                if procs[0].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the scheduler did not start: "
                                       + (tmpdir / "scheduler.log").read_text()[-2000:])
                time.sleep(0.1)
            time.sleep(0.1)  # the file is written in one go, but let it land
            address = json.loads(sched_file.read_text())["address"]
            pools = {"inference": {Tag.GPU_COMPUTE: slots, Tag.GPU_BANDWIDTH: slots},
                     "env": {Tag.CPU_ENV: slots}}
            for name, tags in pools.items():
                procs.append(_spawn(
                    ["worker", address, "--name", name, "--nthreads", str(threads),
                     "--resources", ",".join(f"{t}={n}" for t, n in tags.items()),
                     "--host", "127.0.0.1", "--no-dashboard", "--no-nanny",
                     "--memory-limit", "0", "--local-directory", str(tmpdir / name)],
                    tmpdir / f"{name}.log"))
            client = Client(address, timeout=START_TIMEOUT_S)
            try:
                client.wait_for_workers(len(pools), timeout=START_TIMEOUT_S)
            except TimeoutError as e:
                logs = "\n".join((tmpdir / f"{n}.log").read_text()[-1000:] for n in pools)
                raise RuntimeError(f"the workers did not join: {logs}") from e
            by_name = {w["name"]: a for a, w in client.scheduler_info()["workers"].items()}
            yield BenchCluster(client, by_name["inference"], by_name["env"],
                               psutil.Process(procs[0].pid),
                               [psutil.Process(p.pid) for p in procs[1:]], threads)
        finally:
            if client is not None:
                # the scheduler closes its workers, then itself; what is left is terminated
                with contextlib.suppress(Exception):
                    client.shutdown()
                client.close()
            _stop(procs)
