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
    python flows/simulate.py --config config/scale/rollarc_3k.yaml --sensitivity price_ratio
    python flows/simulate.py --config config/scale/rollarc_3k.yaml --sensitivity floor_scale 0 1 4
    python flows/simulate.py --calibrate runs/bench/uniform-s0 --validate runs/bench/long_tail-s0
    python flows/simulate.py --calibration runs/simulate/calibration.json --validate DIR ...
    python flows/simulate.py --config config/bench/paper_mix.yaml \
        --calibration tests/data/simulator/calibration-uniform-s0.json   # with what a bench saw
    python -m flows.benchmarks.scheduler && python flows/simulate.py --config config/bench/long_tail.yaml \
        --capacity runs/bench_scheduler/capacity.json --load 256 1024 4096   # scheduler load

The simulator is validated out of sample: ``--calibrate`` fits what it cannot know on one bench
invocation (one workload and seed: turns per env task, the host's orchestration per turn and per
train step; :mod:`~flows.simulation.calibration`), ``--validate`` predicts other invocations' step
times and ratios between systems from their configs alone and reports both errors. With
``--config``, ``--calibration`` alone simulates that config with the calibration's turns and
host times (the command line's own overrides win over them).

Where it departs from the Dask flow, on purpose: environments and the policy do not run, so the
number of turns of a trajectory is drawn (``simulate.turns``) and rewards are random (they only
order nothing: groups complete by time, not by reward); worker loss is not simulated.
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
from flows.simulation import validation
from flows.simulation.budget_split import best_table, split_search, split_table
from flows.simulation.calibration import Calibration, fit, read_bench
from flows.simulation.scaling import (
    DEFAULT_SWEEP,
    SENSITIVITY,
    plot_scaling,
    sensitivity,
    sensitivity_table,
    sweep,
    sweep_table,
)
from flows.simulation.scheduler_load import (
    load_study,
    load_table,
    plot_scheduler_load,
    read_capacity,
    with_capacity,
)
from flows.simulation.settings import load
from flows.simulation.systems import SYSTEMS, run_systems, scaled, systems_table


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
                   help="each of --systems at its best shape of the config's hourly budget")
    p.add_argument("--sensitivity", nargs="+", default=None, metavar=("KIND", "VALUE"),
                   help=f"the systems' ratios as one quantity moves: {', '.join(SENSITIVITY)}, "
                   "and its values (default: a range around today's)")
    p.add_argument("--calibrate", default=None, metavar="BENCH",
                   help="fit the calibration on one bench invocation (a bench or run "
                   "directory, or a digest JSON) and save it")
    p.add_argument("--calibration", default=None, metavar="JSON",
                   help="a saved calibration (calibration.json of --calibrate): with "
                   "--validate, predict those benches; with --config alone, simulate it")
    p.add_argument("--validate", nargs="+", default=None, metavar="BENCH",
                   help="predict these bench invocations' step times and ratios from their "
                   "configs and the calibration, and report the errors")
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
        if args.calibrate or args.validate or (args.calibration and not args.config):
            return calibrate_and_validate(p, args, out, console)
        if not args.config:
            p.error("--config is required (or --calibrate / --validate)")
        overrides = list(args.overrides)
        if args.hours:
            overrides.append(f"simulate.hours={args.hours}")
        if args.calibration:  # what a bench measured, under the command line's own overrides
            cfg, _ = load(args.config, overrides)
            overrides = read_calibration(p, args.calibration).overrides(cfg) + overrides
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
        ranked = split_search(cfg, sim, args.systems)
        (out / "split.json").write_text(json.dumps(ranked, indent=1))
        for system, shapes in ranked.items():
            console.print(f"\n{system}\n" + split_table(shapes))
        text = best_table(ranked)
        (out / "split.md").write_text(text + "\n")
        console.print("\n" + text + f"\n[{time.perf_counter() - t0:.0f} s]")
        return 0
    if args.sensitivity:
        kind, values = args.sensitivity[0], [float(v) for v in args.sensitivity[1:]]
        if kind not in SENSITIVITY:
            p.error(f"--sensitivity: one of {sorted(SENSITIVITY)}, not {kind!r}")
        points = sensitivity(cfg, sim, kind, values)
        (out / f"sensitivity-{kind}.json").write_text(json.dumps(points, indent=1))
        text = sensitivity_table(points, kind)
        (out / f"sensitivity-{kind}.md").write_text(text + "\n")
        console.print(text + f"\n[{time.perf_counter() - t0:.0f} s]")
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


def _name(path: str) -> str:
    return Path(path).stem.removeprefix("digest-")


def read_calibration(p: argparse.ArgumentParser, path: str) -> Calibration:
    try:
        return Calibration.model_validate_json(Path(path).read_text())
    except (OSError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        p.error(f"--calibration {path}: {str(exc).splitlines()[0]}")


def calibrate_and_validate(p: argparse.ArgumentParser, args: argparse.Namespace, out: Path,
                           console: Console) -> int:
    """--calibrate and/or --validate: the calibration fitted (or loaded) and saved, each
    bench to validate read into a digest without its measures (saved beside the results),
    predicted and compared."""
    if args.calibrate:
        bench = read_bench(Path(args.calibrate))
        (out / f"digest-{_name(args.calibrate)}.json").write_text(bench.model_dump_json())
        cal = fit(bench)
        (out / "calibration.json").write_text(cal.model_dump_json(indent=1))
        console.print(f"calibration ({cal.source}) -> {out}/calibration.json\n"
                      + json.dumps(cal.model_dump(exclude={"points"}), indent=1))
    elif args.calibration:
        cal = read_calibration(p, args.calibration)
    else:
        p.error("--validate needs --calibrate or --calibration: a prediction is only a "
                "validation on runs it was not calibrated on")
    if not args.validate:
        if args.calibration:
            p.error("--calibration needs --validate (benches to predict) or --config (a "
                    "config to simulate)")
        return 0
    records = []
    for d in args.validate:
        bench = read_bench(Path(d)).without_measures()
        (out / f"digest-{_name(d)}.json").write_text(bench.model_dump_json())
        records += validation.predict(cal, bench)
    validation.save(records, cal, out)
    console.print(validation.validation_table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
