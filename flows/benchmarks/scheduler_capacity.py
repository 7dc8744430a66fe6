"""The figures of the scheduler benchmark (:mod:`flows.benchmarks.scheduler`): what one
measurement records, the headline capacity derived from them, its JSON file and its Markdown
table. Pure: no cluster, no processes."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flows.benchmarks.report import markdown_table

DEFAULT_OUT = Path("runs/bench_scheduler")
CAPACITY_FILE = "capacity.json"


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
