"""Simulate RollArc on a cluster you do not have: time per step of RollArc and its baselines,
pool utilisation, the best split of a budget, and the load on the Dask scheduler and driver.

The simulator (:mod:`flows.simulation.simulator`) runs the flow's own decision functions and the
device model of the emulated backend on a virtual clock. It reads the YAML ``flows/train.py``
reads, plus an optional ``simulate:`` section (:class:`flows.simulation.settings.SimSettings`:
cluster size, hours, turns per trajectory, scheduler and driver costs, shards); dotted overrides
work on both (``simulate.gpus=1024``). This file is the command line; the studies live beside
the simulator: :mod:`~flows.simulation.systems` (rollarc and its baselines),
:mod:`~flows.simulation.validation`, :mod:`~flows.simulation.scaling`,
:mod:`~flows.simulation.budget_split` and :mod:`~flows.simulation.scheduler_load`.

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
import sys
import time
from pathlib import Path

from rich.console import Console

from flows.config import ConfigError, with_overrides
from flows.simulation.budget_split import split_search, split_table
from flows.simulation.scaling import DEFAULT_SWEEP, plot_scaling, sweep, sweep_table
from flows.simulation.scheduler_load import (
    load_study,
    load_table,
    plot_scheduler_load,
    read_capacity,
    with_capacity,
)
from flows.simulation.settings import load
from flows.simulation.systems import SYSTEMS, run_systems, scaled, systems_table
from flows.simulation.validation import validate, validation_table


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
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
    return p, p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    p, args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    console = Console(width=250)
    out = Path(args.out or "runs/simulate")
    out.mkdir(parents=True, exist_ok=True)
    try:
        if args.validate:
            rows = []
            for d in args.validate:
                rows += validate(Path(d), out / Path(d).name)[0]
            text = validation_table(rows)
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
            capacity = read_capacity(args.capacity)
            sim = with_capacity(sim, capacity)
        if sim.gpus:
            cfg = with_overrides(cfg, scaled(cfg, sim.gpus))
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    if args.split_search:
        ranked = split_search(cfg, sim)
        (out / "split.json").write_text(json.dumps(ranked, indent=1))
        console.print(split_table(ranked))
        return 0
    if args.sweep is not None:
        points = sweep(cfg, sim, args.sweep or list(DEFAULT_SWEEP))
        (out / "sweep.json").write_text(json.dumps(points, indent=1))
        plot_scaling(points, out / "scaling.png")
        console.print(sweep_table(points))
        console.print(f"[{time.perf_counter() - t0:.0f} s] {out}/scaling.png")
        return 0
    if args.load is not None:
        if not capacity:
            p.error("--load needs --capacity (flows/benchmarks/scheduler.py's capacity.json)")
        points = load_study(cfg, sim, args.load or list(DEFAULT_SWEEP))
        (out / "load.json").write_text(json.dumps({"capacity": capacity, "points": points},
                                                  indent=1))
        plot_scheduler_load(points, capacity, out / "scheduler_load.png")
        console.print(load_table(points))
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
