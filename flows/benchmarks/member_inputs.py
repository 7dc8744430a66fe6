"""What a cohort's member inputs cost Dask: one ``(future, index)`` pair per member against
each earlier result once plus plain ``(source, index)`` pairs (:func:`tasks.cohort.by_source`,
what :mod:`flows.training.turn_tasks` submits).

A cohort's task reads each member's input from an earlier cohort's result list (its decode's
cache handle, its env step's observation). Passed as a ``(future, index)`` pair per member, the
argument becomes a nested task per member that the driver builds (``dask._task_spec``), the
scheduler unpickles and the worker resolves; passed through ``by_source``, the graph carries one
dependency per earlier result and the indices as plain data. This runs no-op tasks of that shape
on the cluster of :mod:`flows.benchmarks.scheduler` (a scheduler, an inference and an
environment worker, each its own process, their CPU read with psutil): ``--tasks`` tasks on the
environment worker, each reading ``--members`` members spread over four earlier results on the
inference worker, submitted one ``client.submit`` each, then waited for; the two forms
alternate, ``--repeats`` times each, and a task without inputs is the floor. Printed: the CPU
microseconds per task of the driver, the scheduler and the workers (median [min, max] over the
repeats) and the pairs' over ``by_source`` per repeat; saved as JSON in ``--out``.

    python -m flows.benchmarks.member_inputs --tasks 300 --members 64 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from pathlib import Path

import distributed
from rich.console import Console
from rich.table import Table

from flows.benchmarks.repeats import Spread, ratio
from flows.benchmarks.scheduler_cluster import BenchCluster, bench_cluster
from tasks.cohort import by_source, inputs

FORMS = ("none", "pairs", "by_source")
SOURCES = 4  # earlier results the members' inputs are spread over
ROLES = ("driver", "scheduler", "workers")


def results(n: int) -> list[bytes]:
    """An earlier cohort's result list: ``n`` members' small outputs."""
    return [b"r" * 64] * n


def read(arg) -> int:
    """A cohort's task: its members' inputs, resolved as ``tasks.cohort`` resolves them."""
    if arg is None:
        return 0
    if isinstance(arg, tuple):
        return len(inputs(arg))
    return len([res[i] for res, i in arg])


def argument(form: str, sources: list, members: int):
    pairs = [(sources[i * SOURCES // members], i) for i in range(members)]
    return None if form == "none" else pairs if form == "pairs" else by_source(pairs)


def run_form(c: BenchCluster, form: str, tasks: int, members: int, tag: str) -> dict:
    """``tasks`` tasks of ``form``: CPU microseconds per task by role."""
    sources = [c.client.submit(results, members, key=f"results-{k}-{tag}", workers=[c.inference],
                               pure=False) for k in range(SOURCES)]
    distributed.wait(sources)
    with c.measured() as cpu:
        futs = [c.client.submit(read, argument(form, sources, members), key=f"read-{i}-{tag}",
                                workers=[c.env], pure=False) for i in range(tasks)]
        distributed.wait(futs)
    if any(f.status != "finished" or f.result() != (members if form != "none" else 0)
           for f in futs):
        raise RuntimeError(f"{form}: a task failed or read the wrong inputs")
    del futs, sources
    c.idle()
    s = cpu[0]
    return {"form": form, "driver": 1e6 * s.driver_s / tasks,
            "scheduler": 1e6 * s.scheduler_s / tasks, "workers": 1e6 * s.workers_s / tasks,
            "wall": 1e6 * s.wall_s / tasks}


def measure(tasks: int = 300, members: int = 64, repeats: int = 3) -> dict:
    runs: dict[str, list[dict]] = {f: [] for f in FORMS}
    run = uuid.uuid4().hex[:6]
    with bench_cluster() as c:
        run_form(c, "pairs", 50, members, f"{run}-warmup")  # functions deserialized
        for r in range(repeats):  # the order alternates, so drift hits both forms alike
            for form in (FORMS if r % 2 == 0 else FORMS[::-1]):
                runs[form].append(run_form(c, form, tasks, members, f"{run}-{r}-{form}"))
    out = {"tasks": tasks, "members": members, "repeats": repeats, "runs": runs,
           "us_per_task": {f: {role: vars(Spread.of([x[role] for x in runs[f]]))
                               for role in (*ROLES, "wall")} for f in FORMS}}
    # per repeat (a repeat whose CPU time is below psutil's resolution has no ratio)
    out["pairs_over_by_source"] = {
        role: ratio(runs["pairs"], runs["by_source"], lambda r, role=role: r[role],
                    lower_is_better=True).as_dict() for role in ROLES}
    return out


def report(out: dict) -> Table:
    table = Table(title=f"{out['tasks']} tasks of {out['members']} members' inputs, "
                        f"{out['repeats']} repeats: CPU us per task, median [min, max]")
    table.add_column("form")
    for role in (*ROLES, "wall"):
        table.add_column(role)
    for form in FORMS:
        cells = [Spread(**out["us_per_task"][form][role]) for role in (*ROLES, "wall")]
        table.add_row(form, *(f"{s.median:.0f} [{s.low:.0f}, {s.high:.0f}]" for s in cells))
    ratios = out["pairs_over_by_source"]
    table.add_row("pairs / by_source", *(f"{ratios[r]['median']:.2f}x [{ratios[r]['min']:.2f}, "
                                         f"{ratios[r]['max']:.2f}]" if ratios[r]["per_repeat"]
                                         else "-" for r in ROLES), "")
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, default=300, help="tasks per form and repeat")
    p.add_argument("--members", type=int, default=64, help="members' inputs per task")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("runs/bench_member_inputs"))
    args = p.parse_args(argv)
    if min(args.tasks, args.members, args.repeats) < 1:
        p.error("--tasks, --members and --repeats must be positive")
    out = measure(args.tasks, args.members, args.repeats)
    Console(width=160).print(report(out))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "member_inputs.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
