"""What the design asks of the Dask scheduler and driver as the cluster grows: their measured
cost per task and per completion (``flows/benchmarks/scheduler.py``'s capacity JSON), the load
of ``rollarc`` at each size as it is and with each remedy, the table and its picture."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from flows.benchmarks.report import markdown_table
from flows.config import ConfigError, TrainConfig, with_overrides
from flows.simulation.settings import SimSettings, sim_settings, split_overrides
from flows.simulation.simulator import simulate
from flows.simulation.systems import scaled

logger = logging.getLogger(__name__)

# the control plane as built, sharded over schedulers (cluster.shards: one driver), with a
# driver per shard too (a design), and coarser tasks: cohorts
# as the flow forms them (of turns that happen to share their workers) and with a group's
# turns placed together so that cohorts form
REMEDIES = {"one scheduler": [], "2 shards": ["simulate.shards=2"],
            "4 shards": ["simulate.shards=4"],
            "4 shards, 4 drivers": ["simulate.shards=4", "simulate.shard_drivers=true"],
            "cohorts of 8": ["rollout.cohort_max=8"],
            "cohorts of 8, group placement": ["rollout.cohort_max=8",
                                              "simulate.group_placement=true"]}


def capacity_costs(capacity: dict) -> dict:
    """The scheduler's and the driver's price per task and per completion, from
    ``flows/benchmarks/scheduler.py``'s JSON: the dynamic measurement at its best concurrency (the
    driver's pattern), and the capacities they imply (one core each)."""
    dynamic = capacity.get("dynamic") or []
    best = max(dynamic, key=lambda d: d["turns_per_s"]) if dynamic else capacity
    scheduler_us = best["scheduler_us_per_task"]
    driver_us = best["driver_us_per_turn"]
    return {"scheduler_us_per_task": scheduler_us, "driver_us_per_event": driver_us,
            "tasks_per_s": 1e6 / scheduler_us, "driver_events_per_s": 1e6 / driver_us}


def read_capacity(path: str | Path) -> dict:
    """:func:`capacity_costs` of a capacity JSON file; a ConfigError if it is not one."""
    try:
        return capacity_costs(json.loads(Path(path).read_text()))
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"--capacity: {path} is not a capacity.json of "
                          f"flows/benchmarks/scheduler.py ({exc!r})") from None


def with_capacity(sim: SimSettings, capacity: dict) -> SimSettings:
    """``sim`` with the scheduler and driver costs of ``capacity``."""
    return sim.model_copy(update={
        "scheduler_us_per_task": capacity["scheduler_us_per_task"],
        "driver_us_per_event": capacity["driver_us_per_event"]})


def load_study(cfg: TrainConfig, sim: SimSettings, gpus: list[int],
               remedies: dict[str, list[str]] = REMEDIES) -> list[dict]:
    """``rollarc`` at each cluster size with the scheduler and driver costs of ``sim`` (which
    must be set: from ``--capacity``), as it
    is and with each remedy: tasks and completions per second per scheduler and driver, their
    busy shares, and the step time (a saturated control plane shows as time)."""
    out = []
    for n in gpus:
        for name, over in remedies.items():
            train, sim_over = split_overrides(over)
            c = with_overrides(cfg, scaled(cfg, n) + train)
            s = sim_settings(sim.model_dump(), sim_over)
            r = simulate(c, s, "rollarc")
            drivers = s.shards if s.shard_drivers else 1
            out.append({"gpus": n, "remedy": name, "shards": s.shards, "step_s": r.step_s,
                        # the busiest scheduler's (shard 0 also takes score, train and load
                        # tasks)
                        "tasks_per_s": max(r.scheduler_busy) / (s.scheduler_us_per_task * 1e-6),
                        "driver_events_per_s": r.driver_events_per_s / drivers,
                        "scheduler_busy": max(r.scheduler_busy),
                        "driver_busy": max(r.driver_busy), "wall_s": r.wall_s})
            logger.info("%d GPUs, %s: %.1f s/step, %.0f tasks/s per scheduler", n, name,
                        r.step_s, out[-1]["tasks_per_s"])
    return out


def load_table(points: list[dict]) -> str:
    """Markdown of :func:`load_study`'s points."""
    rows = [[f"{x['gpus']:,}", x["remedy"], f"{x['step_s']:.1f}",
             f"{x['tasks_per_s']:,.0f}", f"{x['scheduler_busy']:.0%}",
             f"{x['driver_events_per_s']:,.0f}", f"{x['driver_busy']:.0%}"] for x in points]
    return markdown_table(["GPUs", "control plane", "s/step", "tasks/s per scheduler",
                           "scheduler busy", "completions/s per driver", "driver busy"], rows)


def plot_scheduler_load(points: list[dict], capacity: dict, path: Path) -> None:
    """Tasks/s per scheduler and completions/s per driver against GPUs, for each remedy, with
    the measured capacities; and the step time, where saturation shows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    remedies = list(dict.fromkeys(p["remedy"] for p in points))
    for i, name in enumerate(remedies):
        pts = [p for p in points if p["remedy"] == name]
        xs = [p["gpus"] for p in pts]
        ax.plot(xs, [p["tasks_per_s"] for p in pts], marker="o", color=f"C{i}",
                label=f"{name}: tasks/s per scheduler")
        ax.plot(xs, [p["driver_events_per_s"] for p in pts], marker="s", ls="--",
                color=f"C{i}", label=f"{name}: completions/s per driver")
        ax2.plot(xs, [p["step_s"] for p in pts], marker="o", color=f"C{i}", label=name)
    if capacity.get("tasks_per_s"):
        ax.axhline(capacity["tasks_per_s"], color="red", ls=":",
                   label=f"one scheduler, measured ({capacity['tasks_per_s']:,.0f} tasks/s)")
        ax.axhline(capacity["driver_events_per_s"], color="purple", ls=":",
                   label=f"one driver, measured ({capacity['driver_events_per_s']:,.0f}/s)")
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        xs = sorted({p["gpus"] for p in points})
        a.set_xticks(xs, [str(x) for x in xs], rotation=45)
        a.set_xlabel("GPUs")
    ax.set_yscale("log")
    ax.set_ylabel("per second")
    ax.set_title("Control-plane load against measured capacity", fontsize=10)
    ax.legend(fontsize=6)
    ax2.set_ylabel("s/step (simulated)")
    ax2.set_title("Step time with the scheduler and driver as queues", fontsize=10)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
