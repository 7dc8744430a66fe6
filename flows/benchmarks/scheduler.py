"""What one Dask scheduler, and one driver, sustain for tasks shaped like RollArc's.

A RollArc turn is three tiny-result tasks, ``prefill -> decode -> env_step``, each restricted to
one worker (``workers=[addr]``) and one slot of a pool's resource (``resources={TAG: 1}``),
keyed ``"{stage}-{trajectory}-{turn}-{attempt}@{tag}"`` (:mod:`flows.training.rollout`). When the
devices are fast the work inside a task is nothing next to its orchestration, so the cluster's
ceiling is the scheduler's (and the driver's) CPU per task. This benchmark runs no-op tasks of
that shape on a real cluster and measures it, three ways:

- **static graph** (scheduler-bound): ``--chains`` chains of the three tasks submitted at once,
  then waited for: tasks/s, wall per task, and scheduler CPU per task. Twice: one
  ``client.submit`` per task, as RollArc submits, and one ``client.map`` per stage, which tells
  the scheduler's price of a graph update apart from its price of running a task;
- **dynamic turns** (the driver's pattern): ``C`` trajectories in flight; each time a turn's
  env_step completes (``as_completed`` and a batched gather: :class:`flows.training.events.EventLoop`)
  the driver submits that trajectory's next turn, whose prefill reads the previous decode's
  future as RollArc's does, for ``--seconds``, for each ``C`` of ``--concurrency``: turns/s,
  tasks/s, driver CPU per turn, scheduler CPU per task;
- **batched** (cohorts): the same at the largest ``C`` with each task standing for ``--cohort``
  trajectories' turns (``rollout.cohort_max``), which shows how coarser tasks raise turns/s.

How to read it: a process whose ``busy`` (CPU seconds over wall seconds) is near 1 is the
bound. ``scheduler_us_per_task`` is the scheduler's price of a task of this shape: one
scheduler can run at most about 1e6 / it tasks/s, a third of that in turns/s, however many GPUs
stand behind it; ``driver_us_per_turn`` is the same for the driver's Python loop. Every process
(the scheduler, two workers, the driver) shares this machine's cores, so on a small machine the
figures are a lower bound and the busy fractions say who took the CPU. The load average at the
start is saved with the figures.

The scheduler and the workers are ``dask scheduler`` / ``dask worker`` subprocesses (no nanny),
not a ``LocalCluster`` or ``SpecCluster``: those run the scheduler inside the calling process,
where its CPU could not be told apart from the driver's. Here each role is one process whose CPU
seconds psutil reads, the way a run launched with ``--scheduler`` is deployed. Worker A
advertises ``GPU_COMPUTE`` and ``GPU_BANDWIDTH``, worker B ``CPU_ENV`` (64 slots each).

Output: a Markdown table printed and saved, and the capacity as JSON at ``<out>/capacity.json``
(default ``runs/bench_scheduler/``). The records, the capacity, its file (``load_capacity``
reads it back) and its table are in :mod:`flows.benchmarks.scheduler_capacity`; the processes
are :mod:`flows.benchmarks.scheduler_cluster`; this module holds the no-op tasks, the
measurements and the command line.

    python -m flows.benchmarks.scheduler
    python -m flows.benchmarks.scheduler --seconds 5
    python -m flows.benchmarks.scheduler --seconds 3 --concurrency 16 256 --cohort 0 --out /tmp/sched
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import dask
import distributed
import psutil
from distributed import Future
from rich.console import Console

from flows.benchmarks.scheduler_capacity import (
    CAPACITY_FILE,
    DEFAULT_OUT,
    DynamicResult,
    Machine,
    SchedulerCapacity,
    StaticResult,
    capacity_of,
    dynamic_result,
    save_capacity,
    static_result,
    table,
)
from flows.benchmarks.scheduler_cluster import BenchCluster, bench_cluster
from flows.training.events import EventLoop, FutureKind
from resources.pools import Stage, demand

logger = logging.getLogger(__name__)

OBS_BYTES = 256  # an observation's payload (token ids of a short turn)
DECODE_BYTES = 256  # a decode's output: sampled token ids and a cache handle
WARMUP_CHAINS = 100


# -- the tasks: no-ops of a turn's shape -------------------------------------------------------


def prefill(past: bytes | list | None, observation: bytes | list) -> bytes:
    """Stands for prefill: reads the previous decode (the cache) and the observation."""
    return b"kv"


def decode(handle: bytes, past: bytes | list | None) -> bytes | list:
    """Stands for decode: the sampled tokens (a list of them for a cohort)."""
    return b"d" * DECODE_BYTES


def env_step(observation: bytes | list, decoded: bytes | list) -> bytes | list:
    """Stands for env_step: the next observation, what the driver gathers."""
    return observation


# -- the measurements --------------------------------------------------------------------------


def _submit_turn(c: BenchCluster, suffix: str, past: Future | None,
                 observation: Any) -> tuple[Future, Future]:
    """prefill -> decode -> env_step of one trajectory (or cohort), as flows/training/rollout.py submits
    them; returns (decode, env_step)."""
    def submit(stage: Stage, fn, *args, worker: str) -> Future:
        return c.client.submit(fn, *args, key=f"{stage}-{suffix}", workers=[worker],
                               allow_other_workers=False, resources=demand(stage), pure=False)
    pre = submit(Stage.PREFILL, prefill, past, observation, worker=c.inference)
    dec = submit(Stage.DECODE, decode, pre, past, worker=c.inference)
    step = submit(Stage.ENV_STEP, env_step, observation, dec, worker=c.env)
    return dec, step


def run_static(c: BenchCluster, chains: int, tag: str, mapped: bool = False) -> StaticResult:
    """``chains`` turns submitted at once, each its own trajectory; waits for them all. With
    ``mapped`` each stage's tasks go in one ``client.map`` (one graph update per stage, not
    per task): the scheduler's price of a task without the price of a submission."""
    obs = b"o" * OBS_BYTES
    with c.measured() as cpu:
        if mapped:
            def keys(stage: Stage) -> list[str]:
                return [f"{stage}-{i}-0-0@{tag}" for i in range(chains)]
            def stage_map(stage: Stage, fn, *args, worker: str) -> list[Future]:
                return c.client.map(fn, *args, key=keys(stage), workers=[worker],
                                    allow_other_workers=False, resources=demand(stage),
                                    pure=False)
            pre = stage_map(Stage.PREFILL, prefill, [None] * chains, [obs] * chains,
                            worker=c.inference)
            dec = stage_map(Stage.DECODE, decode, pre, [None] * chains, worker=c.inference)
            steps = stage_map(Stage.ENV_STEP, env_step, [obs] * chains, dec, worker=c.env)
            del pre, dec
        else:
            steps = [_submit_turn(c, f"{i}-0-0@{tag}", None, obs)[1] for i in range(chains)]
        distributed.wait(steps)
    failed = sum(f.status != "finished" for f in steps)
    if failed:
        raise RuntimeError(f"{failed} of {chains} static chains failed: "
                           f"{next(f for f in steps if f.status != 'finished').exception()!r}")
    del steps
    c.idle()
    return static_result(chains, cpu[0], mapped)


def run_dynamic(c: BenchCluster, concurrency: int, seconds: float, tag: str, cohort: int = 1,
                turns_per_trajectory: int = 8) -> DynamicResult:
    """``concurrency`` trajectories (in cohorts of ``cohort``), each advanced by a turn as its
    env_step completes, for ``seconds``; then the turns in flight drain. A trajectory ends
    after ``turns_per_trajectory`` turns and a new one takes its place, releasing its cache."""
    units = max(1, concurrency // cohort)
    obs: Any = b"o" * OBS_BYTES if cohort == 1 else [b"o" * OBS_BYTES] * cohort
    loop = EventLoop(c.client)
    state: dict[str, tuple[int, int, Future]] = {}  # env_step key -> (traj, turn, decode)
    tasks = turns = errors = 0
    next_traj = 0

    def submit(traj: int, turn: int, past: Future | None, observation: Any) -> None:
        nonlocal tasks
        # a cohort's keys as flows/training/rollout.py spells them: "{stage}-c{cohort}-{members}-0"
        suffix = (f"{traj}-{turn}-0@{tag}" if cohort == 1
                  else f"c{traj}x{turn}-{cohort}-0@{tag}")
        dec, step = _submit_turn(c, suffix, past, observation)
        state[step.key] = (traj, turn, dec)
        loop.track(step, FutureKind.TURN)
        tasks += 3

    with c.measured() as cpu:
        deadline = time.perf_counter() + seconds
        for _ in range(units):
            submit(next_traj, 0, None, obs)
            next_traj += 1
        while not loop.empty():
            for ev in loop.next_batch():
                traj, turn, dec = state.pop(ev.future.key)
                if ev.ok:
                    turns += cohort
                else:
                    errors += 1
                if time.perf_counter() >= deadline:
                    continue  # draining
                if ev.ok and turn + 1 < turns_per_trajectory:
                    submit(traj, turn + 1, dec, ev.result)
                else:
                    submit(next_traj, 0, None, obs)
                    next_traj += 1
    ev = dec = None  # the last futures: held, they would keep their tasks
    c.idle()
    return dynamic_result(concurrency, cohort, turns, tasks, errors, cpu[0])


def machine(threads: int) -> Machine:
    return Machine(cpu_count=psutil.cpu_count() or 1, load_average=list(os.getloadavg()),
                   dask_version=dask.__version__, distributed_version=distributed.__version__,
                   python=platform.python_version(), platform=platform.platform(),
                   worker_threads=threads)


def measure(seconds: float = 10.0, concurrency: Sequence[int] = (16, 64, 256),
            chains: int = 2000, cohort: int = 16, threads: int = 8,
            turns_per_trajectory: int = 8) -> SchedulerCapacity:
    """Run the three measurements on a fresh cluster and derive the capacity.

    ``seconds`` is each dynamic measurement's budget (the turns in flight then drain),
    ``chains`` the static graph's size; ``cohort`` 0 or 1 skips the batched measurement, which
    runs at the largest concurrency."""
    if not concurrency:
        raise ValueError("concurrency: at least one number of trajectories in flight")
    host = machine(threads)
    run = uuid.uuid4().hex[:6]
    with bench_cluster(threads) as c:
        run_static(c, WARMUP_CHAINS, f"{run}-warmup")  # functions deserialized, pools warm
        logger.info("static graph: %d chains", chains)
        static = run_static(c, chains, f"{run}-static")
        static_mapped = run_static(c, chains, f"{run}-mapped", mapped=True)
        dynamic = []
        for n in concurrency:
            logger.info("dynamic turns: %d trajectories, %.0f s", n, seconds)
            dynamic.append(run_dynamic(c, n, seconds, f"{run}-d{n}",
                                       turns_per_trajectory=turns_per_trajectory))
        batched = []
        if cohort > 1:
            n = max(concurrency)
            logger.info("batched: %d trajectories in cohorts of %d, %.0f s", n, cohort, seconds)
            batched.append(run_dynamic(c, n, seconds, f"{run}-b{n}", cohort=cohort,
                                       turns_per_trajectory=turns_per_trajectory))
    return capacity_of(static, static_mapped, dynamic, batched, host, seconds)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=10.0,
                   help="budget of each dynamic measurement (the turns in flight then drain)")
    p.add_argument("--chains", type=int, default=2000,
                   help="static graph: prefill -> decode -> env_step chains submitted at once")
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 256],
                   help="dynamic turns: trajectories in flight, one measurement each")
    p.add_argument("--cohort", type=int, default=16,
                   help="batched: trajectories per task, at the largest concurrency (0: skip)")
    p.add_argument("--threads", type=int, default=8, help="threads per worker process")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help=f"directory of {CAPACITY_FILE} and capacity.md")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logger.setLevel(logging.INFO)
    if args.seconds <= 0 or args.chains < 1 or min(args.concurrency) < 1:
        p.error("--seconds, --chains and --concurrency must be positive")
    cap = measure(args.seconds, args.concurrency, args.chains, args.cohort, args.threads)
    text = table(cap)
    Console(width=200).print(text, markup=False, highlight=False)
    path = save_capacity(cap, args.out)
    (args.out / "capacity.md").write_text(text + "\n")
    Console().print(f"written: {path}, {args.out / 'capacity.md'}", markup=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
