"""An external Dask cluster started the way the README tells a user to start one, and the means
to SIGKILL its workers at chosen moments (fault drills).

:class:`ExternalCluster` runs ``dask scheduler`` and one ``dask worker`` per pool, each a process
of its own with the CLI's default Nanny and ``--resources "TAG=N"``: a killed worker process is
started again by its Nanny under a new address, as on a real deployment.

:class:`KillOnce` wraps a stage function (a train step, a weight load, a checkpoint) so that the
worker running it SIGKILLs its own process the first time the moment comes: a kill *while* that
work is in flight, exactly, on the worker doing it. A marker file makes it fire once per drill
(the Nanny's new process runs the same function again, and must not die too).

:func:`random_moment` draws a kill moment from a seed: a train step's batch cut, then a delay
within it; a failing drill names its seed, and ``ROLLARC_DRILL_SEED`` replays it.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from resources.cluster import WORKER_ENV as CLUSTER_WORKER_ENV
from tests import CHECKOUT_PYTHONPATH, ROOT

# the pools of the embedded default, one worker each, with its slot counts
POOLS = {"GPU_COMPUTE": 16, "GPU_BANDWIDTH": 16, "CPU_ENV": 16, "TRAINER": 4, "SERVERLESS": 4}
# the embedded cluster's worker environment; and the workers unpickle this module's KillOnce
WORKER_ENV = CLUSTER_WORKER_ENV | {"PYTHONPATH": CHECKOUT_PYTHONPATH}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ExternalCluster:
    """``dask scheduler`` + ``dask worker`` per pool, as separate processes (see the module)."""

    def __init__(self, log_dir: Path, pools: dict[str, int] | None = None):
        self.log_dir, self.pools = Path(log_dir), dict(pools or POOLS)
        self.port = _free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self._procs: list[subprocess.Popen] = []
        self.client = None

    def _start(self, args: list[str], log: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", *args],
                                stdout=open(self.log_dir / log, "w"), stderr=subprocess.STDOUT,
                                env=os.environ | WORKER_ENV, cwd=ROOT)
        self._procs.append(proc)
        return proc

    def start(self, timeout: float = 120) -> ExternalCluster:
        from distributed import Client

        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._start(["distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port",
                     str(self.port), "--dashboard-address", "127.0.0.1:0"], "scheduler.log")
        for tag, slots in self.pools.items():
            self._start(["distributed.cli.dask_worker", self.address, "--name", tag,
                         "--nthreads", str(slots), "--resources", f"{tag}={slots}",
                         "--host", "127.0.0.1", "--no-dashboard"], f"worker-{tag}.log")
        self.client = Client(self.address, timeout=timeout)
        self.client.wait_for_workers(len(self.pools), timeout=timeout)
        return self

    def workers_by_tag(self) -> dict[str, str]:
        info = self.client.scheduler_info(n_workers=-1)["workers"]
        return {tag: addr for addr, w in info.items() for tag in w.get("resources", {})
                if tag in self.pools}

    def wait_for_pools(self, timeout: float = 120) -> None:
        """Every pool has its worker again (the Nanny restarts a killed one)."""
        deadline = time.monotonic() + timeout
        while set(self.workers_by_tag()) != set(self.pools):
            if time.monotonic() > deadline:
                raise TimeoutError(f"pools without a worker: "
                                   f"{set(self.pools) - set(self.workers_by_tag())}")
            time.sleep(0.5)

    def kill(self, tag: str) -> dict:
        """SIGKILL the worker process of ``tag``'s pool: its address and pid."""
        address = self.workers_by_tag()[tag]
        pid = self.client.run(os.getpid, workers=[address])[address]
        os.kill(pid, signal.SIGKILL)
        return {"tag": tag, "worker": address, "pid": pid, "at": time.perf_counter()}

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        for proc in reversed(self._procs):  # workers first (their Nannies close them), then
            proc.terminate()  # the scheduler
        for proc in reversed(self._procs):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()

    def __enter__(self) -> ExternalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


class Moment(Enum):
    """The stage functions a :class:`KillOnce` can wrap, and the version each is at."""

    TRAIN_STEP = "train_step"  # (trainer, batch): trains the batch cut at batch.policy_version
    LOAD_WEIGHTS = "load_weights"  # (backend, snapshot): loads snapshot.version
    SAVE_CHECKPOINT = "save_checkpoint"  # (trainer, directory): writes trainer.version

    def version(self, target: Any, args: tuple) -> int:
        if self is Moment.TRAIN_STEP:
            return int(args[0].policy_version)
        if self is Moment.LOAD_WEIGHTS:
            return int(args[0].version)
        return int(target.version)


@dataclass(frozen=True)
class KillOnce:
    """A stage function that SIGKILLs its own worker process once (see the module docstring).

    ``version``: only at this version (None: any); ``tag``: only on a worker carrying this
    resource; ``after``: only once this marker file exists (a kill that waits for an earlier
    one: a kill while the run recovers); ``finish_first``: run the stage, then die before its
    result is returned (the checkpoint's files written, not acknowledged)."""

    fn: Callable
    moment: Moment
    marker: str
    version: int | None = None
    tag: str | None = None
    after: str | None = None
    finish_first: bool = False

    def _due(self, target: Any, args: tuple) -> bool:
        from distributed import get_worker

        if os.path.exists(self.marker) or (self.after and not os.path.exists(self.after)):
            return False
        if self.tag is not None and self.tag not in get_worker().state.total_resources:
            return False
        return self.version is None or self.moment.version(target, args) == self.version

    def __call__(self, target: Any, *args):
        if not self._due(target, args):
            return self.fn(target, *args)
        Path(self.marker).write_text(f"{os.getpid()} {time.time()}")
        if self.finish_first:
            self.fn(target, *args)
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # not reached


def random_moment(seed: int, steps: int) -> tuple[int, float]:
    """A kill moment of a run of ``steps`` steps: the batch cut of a step in 2..steps-2, then
    a delay of 0-2 s (train step, weight loads and the next turns are in flight then). Two
    steps are left after the cut, so that the kill falls while the run trains (a step can take
    under a second)."""
    rng = random.Random(seed)
    return rng.randint(2, max(2, steps - 2)), round(rng.uniform(0.0, 2.0), 2)


def drill_seed(default: int) -> int:
    """``ROLLARC_DRILL_SEED`` when set (replaying a failed drill), else ``default``."""
    return int(os.environ.get("ROLLARC_DRILL_SEED", default))
