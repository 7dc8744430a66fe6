"""Simulate RollArc on a cluster you do not have: time per step of RollArc and its baselines,
pool utilisation, the best split of a budget, and the load on the Dask scheduler and driver.

The simulator (:mod:`flows.simulation.simulator`) runs the flow's own decision functions and the device
model of the emulated backend on a virtual clock. It reads the YAML ``flows/train.py`` reads,
plus an optional ``simulate:`` section (:class:`flows.simulation.simulator.SimSettings`: cluster size,
hours, turns per trajectory, scheduler and driver costs, shards); dotted overrides work on both
(``simulate.gpus=1024``).

    python flows/simulate.py --config config/bench/long_tail.yaml           # the bench's cluster
    python flows/simulate.py --config config/scale/rollarc_3k.yaml          # 3,072 GPUs, 4 systems
    python flows/simulate.py --config config/scale/rollarc_3k.yaml --hours 1 --systems rollarc
    python flows/simulate.py --config config/scale/rollarc_3k.yaml --sweep 64 256 1024 4096
    python flows/simulate.py --config config/scale/rollarc_3k.yaml --split-search
    python flows/simulate.py --validate runs/bench/long_tail              # against a bench run
    python -m flows.benchmarks.scheduler && python flows/simulate.py --config config/bench/long_tail.yaml \
        --capacity runs/bench_scheduler/capacity.json --load 256 1024 4096   # scheduler load

Where it departs from the Dask flow, on purpose: environments and the policy do not run, so the
number of turns of a trajectory is drawn (``simulate.turns``) and rewards are random (they only
order nothing: groups complete by time, not by reward); a cohort's members run their turns
independently (the scheduler and driver are charged per cohort); worker loss is not simulated.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

from rich.console import Console

from flows.bench import gpu_cost
from flows.benchmarks.report import markdown_table
from flows.config import (
    ConfigError,
    TrainConfig,
    load_config,
    read_config_file,
    validated,
    with_overrides,
)
from flows.config.overrides import apply_overrides, check_path, parse_value
from flows.monitoring.metrics import read_metrics
from flows.simulation.simulator import SimResult, SimSettings, simulate
from resources.catalog import get_profile
from resources.pools import Role

logger = logging.getLogger(__name__)

GPU_ROLES = (Role.INFERENCE, Role.TRAIN)  # the pools whose GPUs a cluster's size counts
SYSTEMS = ("rollarc", "sync-disaggregated", "async-monolithic", "sync-monolithic")
DEFAULT_SWEEP = (64, 128, 256, 512, 1024, 2048, 3072, 4096)


# -- config ---------------------------------------------------------------------------------------


def load(path: str | Path, overrides: list[str] = ()) -> tuple[TrainConfig, SimSettings]:
    """A training config and its ``simulate:`` section, overrides applied to both."""
    data = read_config_file(Path(path))
    sim = data.pop("simulate", None) or {}
    train, settings = split_overrides(overrides)
    apply_overrides(data, train)
    cfg, sim_cfg = validated(data), sim_settings(sim, settings)
    names = {t.name for t in cfg.env_tasks}
    for name in sim_cfg.turns:
        if name not in names:
            raise ConfigError(f"simulate.turns.{name}: no such env task; env tasks: "
                              f"{sorted(names)}")
    return cfg, sim_cfg


def split_overrides(overrides) -> tuple[list[str], list[str]]:
    """(the run's overrides, the ``simulate.*`` ones)."""
    sim = [o for o in overrides if o.startswith("simulate.")]
    return [o for o in overrides if not o.startswith("simulate.")], sim


def sim_settings(section: dict, overrides: list[str] = ()) -> SimSettings:
    """The ``simulate:`` section with ``simulate.key=value`` overrides, validated; a bad key
    or value is a ConfigError naming it."""
    section = json.loads(json.dumps(section))
    for item in overrides:
        key, _, raw = item.partition("=")
        parts = key.strip().split(".")[1:]
        check_path(SimSettings, parts[:1], key)
        node = section
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = parse_value(raw)
    try:
        return SimSettings.model_validate(section)
    except Exception as exc:  # pydantic's ValidationError: name the key
        err = exc.errors()[0]  # type: ignore[attr-defined]
        loc = ".".join(str(p) for p in err["loc"])
        raise ConfigError(f"simulate.{loc}: {err['msg']}") from None


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
    """(workers, GPUs each) of the monolithic profile at about the hourly cost of the
    disaggregated GPU pools; an engine as large as the largest inference engine (the model
    must fit)."""
    _, cost = gpu_cost(cfg, GPU_ROLES)
    gpus = max(p.gpus for p in cfg.cluster.pools if p.role is Role.INFERENCE)
    price = get_profile(cfg.cluster.monolithic_profile, cfg.affinity.profiles).price_per_hour
    return max(1, round(cost / (price * gpus))), gpus


def system_overrides(cfg: TrainConfig, system: str) -> list[str]:
    workers, gpus = monolithic_shape(cfg)
    mono = ["placement=monolithic", f"cluster.monolithic_workers={workers}",
            f"cluster.monolithic_gpus={gpus}"]
    return {"rollarc": [], "sync-disaggregated": ["mode=sync"], "async-monolithic": mono,
            "sync-monolithic": ["mode=sync", *mono]}[system]


def run_systems(cfg: TrainConfig, sim: SimSettings, systems=SYSTEMS) -> dict[str, SimResult]:
    return {name: simulate(with_overrides(cfg, system_overrides(cfg, name)), sim, name)
            for name in systems}


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


# -- tables ---------------------------------------------------------------------------------------


def systems_table(results: dict[str, SimResult], capacity: dict | None = None) -> str:
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


# -- validation against an emulated bench run ----------------------------------------------------


def calibration(run_dir: Path, cfg: TrainConfig, figures: dict, rows: list[dict]) -> list[str]:
    """Overrides that give the simulator what the emulated run measured and the simulator
    cannot know: turns per trajectory by env task (the policy's and environments' doing), the
    orchestration time per turn and the trainer's real work per step (both in emulated
    seconds). ``rows``: the run's train metrics rows."""
    out = []
    for t in cfg.env_tasks:
        n = sum(r.get(f"env/{t.name}/trajectories", 0) for r in rows)
        turns = sum(r.get(f"env/{t.name}/turns", 0) * r.get(f"env/{t.name}/trajectories", 0)
                    for r in rows)
        if n:
            out.append(f"simulate.turns.{t.name}={{mean: {turns / n:.4f}}}")
    scale = cfg.engine.time_scale
    overhead = figures.get("overhead", {}).get("orchestration_ms", 0.0) / 1e3 / scale
    out.append(f"simulate.turn_overhead_s={overhead:.4f}")
    summary = json.loads((run_dir / "summary.json").read_text())
    trainer_emulated = sum((w.get("trainer") or {}).get("emulated_busy_s", 0.0)
                           for w in summary["workers"].values())
    steps = max(len(rows), 1)
    real = sum(r.get("train/seconds", 0.0) for r in rows) / scale
    # train/seconds holds the real step and the scaled emulated wait; the export is not in it
    extra = max(0.0, (real - trainer_emulated) / steps)
    out.append(f"simulate.train_overhead_s={extra:.4f}")
    return out


def validate(bench_dir: Path, out: Path | None = None) -> tuple[list[list[str]], list[dict]]:
    """Each system of a bench run (``flows/bench.py --out DIR``) simulated with the same
    config and seeds: step time and busy fraction per pool, emulated against simulated."""
    bench = json.loads((bench_dir / "bench.json").read_text())
    workload = Path(bench["workload"]).stem
    rows, records = [], []
    for name, fig in bench["results"].items():
        run_dir = bench_dir / "runs" / f"{name}-0"
        cfg = load_config(run_dir / "config.yaml")  # the run's resolved config
        metrics = read_metrics(run_dir)
        sim_over = calibration(run_dir, cfg, fig, metrics)
        r = simulate(cfg, sim_settings({}, sim_over), name)
        # time per step after the first (which holds the start-up): the steady state, less
        # noisy than a median of a few steps
        ends = [row["perf/elapsed_s"] / cfg.engine.time_scale for row in metrics]
        step_e = (ends[-1] - ends[0]) / (len(ends) - 1)
        step_s = r.steady_step_s
        # the same without the orchestration measured: what the devices alone explain
        bare_s = simulate(cfg, sim_settings({}, [o for o in sim_over if ".turns." in o]),
                          name).steady_step_s
        rec = {"workload": workload, "system": name, "emulated_step_s": step_e,
               "simulated_step_s": step_s, "step_error": step_s / step_e - 1,
               "devices_only_step_s": bare_s,
               "emulated_busy": fig["busy_fraction"], "simulated_busy": r.busy,
               "calibration": sim_over}
        records.append(rec)
        busy = "; ".join(f"{p} {fig['busy_fraction'][p]:.0%} / {r.busy.get(p, float('nan')):.0%}"
                         for p in fig["busy_fraction"])
        rows.append([workload, name, f"{step_e:.1f}", f"{step_s:.1f}",
                     f"{rec['step_error']:+.0%}", busy, f"{bare_s:.1f} ({bare_s / step_e - 1:+.0%})"])
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "validation.json").write_text(json.dumps(records, indent=1))
    return rows, records


VALIDATION_HEADER = ["workload", "system", "emulated s/step", "simulated s/step", "error",
                     "busy per pool, emulated / simulated",
                     "simulated without the measured orchestration"]


# -- at scale --------------------------------------------------------------------------------------


def sweep(cfg: TrainConfig, sim: SimSettings, gpus: list[int]) -> list[dict]:
    """The four systems at each cluster size (the config scaled to it)."""
    out = []
    for n in gpus:
        c = with_overrides(cfg, scaled(cfg, n))
        results = run_systems(c, sim)
        out.append({"gpus": n, "results": {k: v.as_dict() for k, v in results.items()}})
        logger.info("%d GPUs: %s", n, {k: round(v.step_s, 1) for k, v in results.items()})
    return out


def split_search(cfg: TrainConfig, sim: SimSettings, budget: float | None = None,
                 steps: int = 4) -> list[dict]:
    """The best split of an hourly budget between the prefill (H800), decode (H20), trainer
    (H800) and environment (CPU) pools: a small grid of shares, each point simulated for a few
    steps of ``rollarc``. The budget defaults to what the config's pools cost. Best first."""
    pools = cfg.cluster.pools
    price = [get_profile(p.profile, cfg.affinity.profiles).price_per_hour for p in pools]
    inf = [i for i, p in enumerate(pools) if p.role is Role.INFERENCE]
    role = {p.role: i for i, p in enumerate(pools) if p.role is not Role.INFERENCE}
    t, e = role[Role.TRAIN], role[Role.ENV]
    # the pool whose profile the affinity router sends prefill to comes first
    prefill_i, decode_i = sorted(inf, key=lambda i: -get_profile(
        pools[i].profile, cfg.affinity.profiles).peak_flops)[:2]
    cost = {i: pools[i].workers * pools[i].gpus * price[i] for i in (*inf, t)}
    cost[e] = pools[e].workers * price[e]
    budget = budget or sum(cost.values())
    out = []
    for train_share in (0.1, 0.15, 0.25):
        for prefill_share in (0.05, 0.1, 0.2, 0.35):
            for env_share in (0.01, 0.025, 0.05):
                decode_share = 1 - train_share - prefill_share - env_share
                over = [f"trainer.max_steps={steps}"]
                for i, share in ((prefill_i, prefill_share), (decode_i, decode_share)):
                    engines = max(1, math.floor(budget * share / (price[i] * pools[i].gpus)))
                    over.append(f"cluster.pools.{i}.workers={engines}")
                over.append(f"cluster.pools.{t}.gpus="
                            f"{max(1, math.floor(budget * train_share / price[t]))}")
                over.append(f"cluster.pools.{e}.workers="
                            f"{max(1, math.floor(budget * env_share / price[e]))}")
                c = with_overrides(cfg, over)
                r = simulate(c, sim.model_copy(update={"hours": None}), "rollarc")
                out.append({"prefill_share": prefill_share, "decode_share": decode_share,
                            "train_share": train_share, "env_share": env_share,
                            "pools": {p.name: (p.workers, p.gpus) for p in c.cluster.pools},
                            "gpus": r.gpus, "cost_per_hour": r.cost_per_hour + c.cluster.pools[
                                e].workers * price[e],
                            "step_s": r.step_s, "busy": r.busy, "trainer_busy": r.trainer_busy})
    return sorted(out, key=lambda x: x["step_s"])


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


# -- pictures --------------------------------------------------------------------------------------


def plot_scaling(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    xs = [p["gpus"] for p in points]
    for base in SYSTEMS[1:]:
        ys = [p["results"][base]["step_s"] / p["results"]["rollarc"]["step_s"] for p in points]
        ax.plot(xs, ys, marker="o", label=f"vs {base}")
    ax.axhspan(1.35, 2.05, color="grey", alpha=0.15, label="arXiv 2512.22560: 1.35-2.05x")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs], rotation=45)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("speedup of rollarc (step time ratio)")
    ax.set_title("RollArc against its baselines at equal hourly cost (simulated)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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


# -- main ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="training YAML (with an optional simulate: section)")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--hours", type=float, default=None, help="simulated hours (default: "
                   "trainer.max_steps)")
    p.add_argument("--sweep", nargs="*", type=int, default=None, metavar="GPUS",
                   help="cluster sizes to scale the config to (no value: 64 ... 4096)")
    p.add_argument("--load", nargs="*", type=int, default=None, metavar="GPUS",
                   help="scheduler and driver load of rollarc at these sizes, with remedies "
                   "(needs --capacity)")
    p.add_argument("--split-search", action="store_true",
                   help="search the best split of the config's hourly GPU budget")
    p.add_argument("--validate", nargs="+", default=None, metavar="BENCH_DIR",
                   help="simulate each system of these bench runs and compare")
    p.add_argument("--capacity", default=None, help="scheduler capacity JSON of "
                   "flows/benchmarks/scheduler.py (sets the scheduler and driver costs)")
    p.add_argument("--out", default=None, help="output directory (default runs/simulate)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides (simulate.* too)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    console = Console(width=250)
    out = Path(args.out or "runs/simulate")
    out.mkdir(parents=True, exist_ok=True)
    try:
        if args.validate:
            rows = []
            for d in args.validate:
                rows += validate(Path(d), out / Path(d).name)[0]
            text = markdown_table(VALIDATION_HEADER, rows)
            (out / "validation.md").write_text(text + "\n")
            console.print(text)
            return 0
        if not args.config:
            p.error("--config is required (or --validate)")
        overrides = list(args.overrides)
        if args.hours:
            overrides.append(f"simulate.hours={args.hours}")
        cfg, sim = load(args.config, overrides)
        capacity = {}
        if args.capacity:
            try:
                capacity = capacity_costs(json.loads(Path(args.capacity).read_text()))
            except (OSError, ValueError, KeyError) as exc:
                raise ConfigError(f"--capacity: {args.capacity} is not a capacity.json of "
                                  f"flows/benchmarks/scheduler.py ({exc!r})") from None
            sim = sim.model_copy(update={
                "scheduler_us_per_task": capacity["scheduler_us_per_task"],
                "driver_us_per_event": capacity["driver_us_per_event"]})
        if sim.gpus:
            cfg = with_overrides(cfg, scaled(cfg, sim.gpus))
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    if args.split_search:
        ranked = split_search(cfg, sim)
        (out / "split.json").write_text(json.dumps(ranked, indent=1))
        rows = [[f"{r['prefill_share']:.0%} / {r['decode_share']:.0%} / {r['train_share']:.0%}"
                 f" / {r['env_share']:.1%}",
                 ", ".join(f"{k} {w}x{g}" for k, (w, g) in r["pools"].items()),
                 f"{r['gpus']:,}", f"${r['cost_per_hour']:,.0f}", f"{r['step_s']:.1f}",
                 ", ".join(f"{k} {v:.0%}" for k, v in r["busy"].items()),
                 f"{r['trainer_busy']:.0%}"] for r in ranked[:8] + ranked[-2:]]
        console.print(markdown_table(["prefill / decode / trainer / env $", "pools (workers x "
                                      "GPUs)", "GPUs", "$/h", "s/step", "busy", "trainer busy"],
                                     rows))
        return 0
    if args.sweep is not None:
        points = sweep(cfg, sim, args.sweep or list(DEFAULT_SWEEP))
        (out / "sweep.json").write_text(json.dumps(points, indent=1))
        plot_scaling(points, out / "scaling.png")
        rows = []
        for pt in points:
            r = pt["results"]
            rows.append([f"{pt['gpus']:,}"] + [f"{r[s]['step_s']:.1f}" for s in SYSTEMS]
                        + [f"{r[s]['step_s'] / r['rollarc']['step_s']:.2f}" for s in SYSTEMS[1:]]
                        + [f"{r['rollarc']['tasks_per_s']:,.0f}"])
        console.print(markdown_table(["GPUs"] + [f"{s} s/step" for s in SYSTEMS]
                                     + [f"x {s}" for s in SYSTEMS[1:]] + ["tasks/s"], rows))
        console.print(f"[{time.perf_counter() - t0:.0f} s] {out}/scaling.png")
        return 0
    if args.load is not None:
        if not capacity:
            p.error("--load needs --capacity (flows/benchmarks/scheduler.py's capacity.json)")
        points = load_study(cfg, sim, args.load or list(DEFAULT_SWEEP))
        (out / "load.json").write_text(json.dumps({"capacity": capacity, "points": points},
                                                  indent=1))
        plot_scheduler_load(points, capacity, out / "scheduler_load.png")
        rows = [[f"{x['gpus']:,}", x["remedy"], f"{x['step_s']:.1f}",
                 f"{x['tasks_per_s']:,.0f}", f"{x['scheduler_busy']:.0%}",
                 f"{x['driver_events_per_s']:,.0f}", f"{x['driver_busy']:.0%}"] for x in points]
        console.print(markdown_table(["GPUs", "control plane", "s/step", "tasks/s per scheduler",
                                      "scheduler busy", "completions/s per driver",
                                      "driver busy"], rows))
        console.print(f"[{time.perf_counter() - t0:.0f} s] {out}/scheduler_load.png")
        return 0
    results = run_systems(cfg, sim, args.systems)
    (out / "simulate.json").write_text(json.dumps({k: v.as_dict() for k, v in results.items()},
                                                  indent=1))
    text = systems_table(results, capacity)
    (out / "simulate.md").write_text(text + "\n")
    console.print(text)
    console.print(f"simulated in {time.perf_counter() - t0:.1f} s -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
