"""RollArc and its three baselines on one cluster at equal hourly cost, a config scaled to a
cluster size, and the table that compares them."""

from __future__ import annotations

from flows.benchmarks import costs
from flows.benchmarks.costs import GPU_ROLES, gpu_cost
from flows.benchmarks.report import markdown_table
from flows.config import TrainConfig, with_overrides
from flows.simulation.settings import SimSettings
from flows.simulation.simulator import SimResult, simulate
from resources.pools import Role

SYSTEMS = ("rollarc", "sync-disaggregated", "async-monolithic", "sync-monolithic")


def gpus_of(cfg: TrainConfig) -> int:
    """GPUs of the inference and trainer pools."""
    return gpu_cost(cfg, GPU_ROLES)[0]


def scaled(cfg: TrainConfig, gpus: int) -> list[str]:
    """Overrides that grow (or shrink) ``cfg`` to about ``gpus`` GPUs: every GPU pool's and the
    environment pool's workers, the batch and the admission caps by one factor (weak scaling:
    the batch grows with the cluster that rolls it out)."""
    f = gpus / gpus_of(cfg)
    out = []
    for i, p in enumerate(cfg.cluster.pools):
        if p.role in (Role.INFERENCE, Role.ENV, Role.ALL):
            out.append(f"cluster.pools.{i}.workers={max(1, round(p.workers * f))}")
        elif p.role is Role.TRAIN:  # one trainer over more (or fewer) devices
            out.append(f"cluster.pools.{i}.gpus={max(1, round(p.gpus * f))}")
    groups = max(1, round(cfg.trainer.groups_per_step * f))
    group = max(t.group_size for t in cfg.env_tasks)  # admission holds a whole group at least
    out += [f"trainer.groups_per_step={groups}",
            f"rollout.max_in_flight={max(round(cfg.rollout.max_in_flight * f), group)}"]
    return out


def monolithic_shape(cfg: TrainConfig) -> tuple[int, int]:
    """(workers, GPUs each) of the monolithic baseline: the bench's definition
    (:func:`flows.benchmarks.costs.monolithic_shape`), with no limit on the worker count."""
    shape = costs.monolithic_shape(cfg, max_workers=None)
    return shape.workers, shape.gpus


def system_overrides(cfg: TrainConfig, system: str) -> list[str]:
    """The overrides that make ``cfg`` (RollArc) into ``system``."""
    mono = costs.monolithic_overrides(cfg, max_workers=None)
    return {"rollarc": [], "sync-disaggregated": ["mode=sync"], "async-monolithic": mono,
            "sync-monolithic": ["mode=sync", *mono]}[system]


def run_systems(cfg: TrainConfig, sim: SimSettings, systems=SYSTEMS) -> dict[str, SimResult]:
    """Each of ``systems`` simulated on ``cfg``'s cluster."""
    return {name: simulate(with_overrides(cfg, system_overrides(cfg, name)), sim, name)
            for name in systems}


def systems_table(results: dict[str, SimResult], capacity: dict | None = None) -> str:
    """Markdown: each system's size, step time against rollarc's, busy shares and load (as a
    share of ``capacity``, :func:`flows.simulation.scheduler_load.capacity_costs`, if given)."""
    base = results.get("rollarc")
    rows = []
    for name, r in results.items():
        busy = ", ".join(f"{p} {b:.0%}" for p, b in r.busy.items())
        load = f"{r.tasks_per_s:,.0f} / {r.driver_events_per_s:,.0f}"
        if capacity:  # against what one scheduler and one driver were measured to sustain
            load += (f" ({r.tasks_per_s / capacity['tasks_per_s']:.0%} / "
                     f"{r.driver_events_per_s / capacity['driver_events_per_s']:.0%})")
        rows.append([name, f"{r.gpus:,} (${r.cost_per_hour:,.0f})", f"{r.step_s:.1f}",
                     f"{r.step_s / base.step_s:.2f}" if base else "-", busy,
                     f"{r.trainer_busy:.0%}", f"{r.staleness_mean:.2f}", load,
                     f"{r.wall_s:.1f}"])
    return markdown_table(["system", "GPUs ($/h)", "s/step", "x vs rollarc", "busy per pool",
                           "trainer busy", "staleness",
                           "tasks/s / driver events/s (of capacity)",
                           "sim wall s"], rows)
