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

Output: a Markdown table printed and saved, and :class:`SchedulerCapacity` as JSON at
``<out>/capacity.json`` (default ``runs/bench_scheduler/``), for :func:`load_capacity`.

    python -m flows.benchmarks.scheduler
    python -m flows.benchmarks.scheduler --seconds 5
    python -m flows.benchmarks.scheduler --seconds 3 --concurrency 16 256 --cohort 0 --out /tmp/sched
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import dask
import distributed
import psutil
from distributed import Client, Future
from rich.console import Console

from flows.benchmarks.report import markdown_table
from flows.training.events import EventLoop, FutureKind
from resources.pools import Stage, Tag, demand

logger = logging.getLogger(__name__)

DEFAULT_OUT = Path("runs/bench_scheduler")
CAPACITY_FILE = "capacity.json"
# the package root, for the worker processes to import this module's task functions from the
# same checkout as the driver (an environment variable of the children, not a sys.path edit)
ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 60
STOP_TIMEOUT_S = 15
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


# -- records -----------------------------------------------------------------------------------


@dataclass
class CpuSample:
    """CPU seconds (user + system) per role over one measurement, and its wall seconds."""

    wall_s: float
    scheduler_s: float
    driver_s: float
    workers_s: float


@dataclass
class StaticResult:
    """Chains of prefill -> decode -> env_step submitted at once, then waited for."""

    chains: int
    mapped: bool  # submitted with one client.map per stage (else one client.submit per task)
    tasks: int
    wall_s: float
    tasks_per_s: float
    wall_us_per_task: float
    scheduler_us_per_task: float
    driver_us_per_task: float
    worker_us_per_task: float
    scheduler_busy: float  # scheduler CPU seconds over wall seconds
    driver_busy: float


@dataclass
class DynamicResult:
    """Trajectories advanced turn by turn as their env_step completes."""

    concurrency: int  # trajectories in flight
    cohort: int  # trajectories per task (1: every trajectory's turn is its own tasks)
    turns: int  # trajectory turns completed
    tasks: int  # tasks submitted (all completed: the run drains before it stops)
    errors: int  # turns whose env_step failed or whose result was lost
    wall_s: float
    turns_per_s: float
    tasks_per_s: float
    driver_us_per_turn: float
    scheduler_us_per_task: float
    worker_us_per_task: float
    scheduler_busy: float
    driver_busy: float


@dataclass
class Machine:
    cpu_count: int
    load_average: list[float]  # 1, 5, 15 min at the start: other work on the machine
    dask_version: str
    distributed_version: str
    python: str
    platform: str
    worker_threads: int


@dataclass
class SchedulerCapacity:
    """What one scheduler and one driver sustain for RollArc-shaped tasks on this machine."""

    tasks_per_s: float  # static graph, one client.submit per task (RollArc's way)
    scheduler_us_per_task: float  # static graph, one client.submit per task: scheduler CPU
    mapped_tasks_per_s: float  # static graph, one client.map per stage
    mapped_scheduler_us_per_task: float  # static graph, one client.map per stage
    turns_per_s: float  # dynamic turns: the best over the concurrencies (one trajectory a task)
    driver_us_per_turn: float  # dynamic turns: driver CPU per turn at that concurrency
    batched_turns_per_s: float | None  # the best with cohorts (None: not measured)
    machine: Machine
    static: StaticResult
    static_mapped: StaticResult
    dynamic: list[DynamicResult] = field(default_factory=list)
    batched: list[DynamicResult] = field(default_factory=list)
    seconds: float = 0.0  # budget of each dynamic measurement
    measured_at: str = ""


# -- pure derivations --------------------------------------------------------------------------


def _per(total_s: float, count: int) -> float:
    return 1e6 * total_s / count if count else 0.0


def static_result(chains: int, cpu: CpuSample, mapped: bool = False) -> StaticResult:
    tasks = 3 * chains
    return StaticResult(
        chains=chains, mapped=mapped, tasks=tasks, wall_s=cpu.wall_s,
        tasks_per_s=tasks / cpu.wall_s if cpu.wall_s else 0.0,
        wall_us_per_task=_per(cpu.wall_s, tasks),
        scheduler_us_per_task=_per(cpu.scheduler_s, tasks),
        driver_us_per_task=_per(cpu.driver_s, tasks),
        worker_us_per_task=_per(cpu.workers_s, tasks),
        scheduler_busy=cpu.scheduler_s / cpu.wall_s if cpu.wall_s else 0.0,
        driver_busy=cpu.driver_s / cpu.wall_s if cpu.wall_s else 0.0)


def dynamic_result(concurrency: int, cohort: int, turns: int, tasks: int, errors: int,
                   cpu: CpuSample) -> DynamicResult:
    wall = cpu.wall_s or float("inf")
    return DynamicResult(
        concurrency=concurrency, cohort=cohort, turns=turns, tasks=tasks, errors=errors,
        wall_s=cpu.wall_s, turns_per_s=turns / wall, tasks_per_s=tasks / wall,
        driver_us_per_turn=_per(cpu.driver_s, turns),
        scheduler_us_per_task=_per(cpu.scheduler_s, tasks),
        worker_us_per_task=_per(cpu.workers_s, tasks),
        scheduler_busy=cpu.scheduler_s / wall, driver_busy=cpu.driver_s / wall)


def capacity_of(static: StaticResult, static_mapped: StaticResult,
                dynamic: list[DynamicResult], batched: list[DynamicResult], machine: Machine,
                seconds: float) -> SchedulerCapacity:
    """The headline figures: the static graph's task rate and scheduler price per task, the
    best dynamic turn rate and the driver's price per turn there."""
    best = max(dynamic, key=lambda r: r.turns_per_s)
    return SchedulerCapacity(
        tasks_per_s=static.tasks_per_s, scheduler_us_per_task=static.scheduler_us_per_task,
        mapped_tasks_per_s=static_mapped.tasks_per_s,
        mapped_scheduler_us_per_task=static_mapped.scheduler_us_per_task,
        turns_per_s=best.turns_per_s, driver_us_per_turn=best.driver_us_per_turn,
        batched_turns_per_s=max((r.turns_per_s for r in batched), default=None),
        machine=machine, static=static, static_mapped=static_mapped, dynamic=dynamic, batched=batched, seconds=seconds,
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))


def capacity_from_dict(d: dict[str, Any]) -> SchedulerCapacity:
    return SchedulerCapacity(**{
        **d, "machine": Machine(**d["machine"]), "static": StaticResult(**d["static"]),
        "static_mapped": StaticResult(**d["static_mapped"]),
        "dynamic": [DynamicResult(**r) for r in d["dynamic"]],
        "batched": [DynamicResult(**r) for r in d["batched"]]})


def save_capacity(cap: SchedulerCapacity, out: Path) -> Path:
    """Write ``<out>/capacity.json``; returns its path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / CAPACITY_FILE
    path.write_text(json.dumps(asdict(cap), indent=2) + "\n")
    return path


def load_capacity(path: Path | str = DEFAULT_OUT) -> SchedulerCapacity:
    """A saved :class:`SchedulerCapacity`, from its JSON file or the directory holding it."""
    path = Path(path)
    if path.is_dir():
        path = path / CAPACITY_FILE
    return capacity_from_dict(json.loads(path.read_text()))


def table(cap: SchedulerCapacity) -> str:
    """The figures as one Markdown table, a row per measurement."""
    rows = [[f"static graph ({'client.map' if s.mapped else 'client.submit'})",
             f"{s.chains} chains", "-", f"{s.tasks_per_s:.0f}", f"{s.wall_us_per_task:.0f}",
             f"{s.scheduler_us_per_task:.0f}", "-",
             f"{s.scheduler_busy:.2f} / {s.driver_busy:.2f}", "-"]
            for s in (cap.static, cap.static_mapped)]
    for r in [*cap.dynamic, *cap.batched]:
        kind = "dynamic turns" if r.cohort == 1 else f"batched (cohort {r.cohort})"
        rows.append([kind, f"C={r.concurrency}", f"{r.turns_per_s:.0f}", f"{r.tasks_per_s:.0f}",
                     f"{_per(r.wall_s, r.tasks):.0f}", f"{r.scheduler_us_per_task:.0f}",
                     f"{r.driver_us_per_turn:.0f}",
                     f"{r.scheduler_busy:.2f} / {r.driver_busy:.2f}", str(r.errors)])
    m = cap.machine
    head = (f"dask {m.distributed_version}, {m.cpu_count} CPUs (load "
            f"{m.load_average[0]:.1f} at start), {m.worker_threads} threads per worker")
    return head + "\n\n" + markdown_table(
        ["measurement", "size", "turns/s", "tasks/s", "wall us/task", "scheduler us/task",
         "driver us/turn", "busy sched / driver", "errors"], rows)


# -- the cluster -------------------------------------------------------------------------------


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
