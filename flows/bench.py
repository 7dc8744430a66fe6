"""The benchmark: RollArc against its baselines on emulated production GPUs, side by side.

One invocation runs every system of a workload (``config/bench/<name>.yaml``, a full training
config on the ``emulated`` backend), the same seeds and number of train steps each, on a fresh
local cluster each, the systems interleaved when repeated so that machine drift hits all alike:

- **end to end**, at equal hourly cost: ``rollarc`` (async, disaggregated, serverless
  reward), ``sync-disaggregated``, ``async-monolithic`` and ``sync-monolithic`` (every stage,
  training included, time-sharing one pool of the monolithic profile);
- **per principle**, each against its own baseline as arXiv 2512.22560 measures it: hardware
  affinity (the H800 + H20 split against H800-only and H20-only inference at the same hourly
  cost), the cohorts' asynchrony (members leaving their stage as they finish, against a
  barrier per cohort and against a task per trajectory and turn), trajectory-level against batch-level environment handling as the environment
  latency's spread grows, redundant rollouts (spare groups) on and off, and (on a workload
  whose reward is a model's) serverless reward instances against a dedicated reward pool
  carved out of the inference GPUs.

Systems are sized to RollArc's provisioned hourly cost within
:data:`flows.benchmarks.costs.COST_TOLERANCE` (:mod:`flows.benchmarks.costs`; the serverless
reward model's GPU-seconds are billed into each run's measured $/h). Each system runs
``--repeats`` times (default 3), interleaved. For each it reports, as the median over repeats
with the lowest and highest repeat: time per step, trained trajectories/s, trained tokens/s
and per dollar (prompt and response tokens of trained trajectories, virtual lengths), the
measured $/h and its deviation from RollArc's, drops by reason, the lower bound
(:mod:`flows.benchmarks.bound`: the run's work at each pool's best rate, perfectly packed, and
the longest trajectory's own chain at zero queueing) and the wall time over it; and the ratios
to ``rollarc`` (or a principle's baseline) taken repeat by repeat, with a verdict: a gain or a
loss only when every repeat agrees. Times are in emulated seconds (real /
``engine.time_scale``). Output: the Markdown tables printed and saved, ``bench.json`` with every
figure of every run, and timelines (``timeline-<system>.png``, and ``timeline.png`` with
``rollarc`` beside ``sync-monolithic``).

    python flows/bench.py --workload long_tail
    python flows/bench.py --workload uniform --steps 6 --repeats 2
    python flows/bench.py --workload long_tail --sections end_to_end -- engine.time_scale=0.05
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from rich.console import Console

from flows.api import run_training
from flows.benchmarks.costs import (
    COST_TOLERANCE,
    hardware_of,
    inference_shape,
    monolithic_overrides,
)
from flows.benchmarks.report import markdown_table, run_figures, save_timelines
from flows.benchmarks.tables import (
    RATIOS,
    compare,
    cost_text,
    merge_repeats,
    ratio_dicts,
    system_tables,
)
from flows.benchmarks.work import TRAINED_FILE, TrainedBatches
from flows.config import TrainConfig, load_config
from flows.monitoring import critical_path
from resources.pools import Role

WORKLOADS = Path(__file__).resolve().parent.parent / "config" / "bench"
SECTIONS = ("end_to_end", "affinity", "asynchrony", "environment", "redundancy", "reward")
# environment step latency of the trajectory- vs batch-level comparison: normal, the workload's
# median as the mean, these fractions of it as the standard deviation (arXiv 2512.22560 Sec. 7
# injects a mean of 10 s and a standard deviation of 1 s to 10 s)
ENV_SPREADS = (0.1, 0.5, 1.0)

logger = logging.getLogger(__name__)


# what arXiv 2512.22560 reports for the comparison each per-principle system stands in
PAPER = {"affinity": "1.30-1.68x (vs H20-only), 1.12-1.37x (vs H800-only)",
         "environment": "1.23x at std 1 s rising to 2.27x at std 10 s (mean 10 s)",
         "redundancy": "up to 1.62x",
         "asynchrony": "trajectory-level (Sec. 4.2)",
         "reward": "reward GPUs 6% -> 88% busy; rollout 158 s -> 77 s"}


@dataclass
class System:
    name: str
    section: str
    overrides: list[str] = field(default_factory=list)
    baseline: str = "rollarc"  # what its ratio is taken against


def systems(cfg: TrainConfig, sections: tuple[str, ...]) -> list[System]:
    """Every system of the chosen sections, with the overrides that make it from ``cfg``."""
    out = [System("rollarc", "end_to_end")]
    mono = monolithic_overrides(cfg)
    if "end_to_end" in sections:
        out += [System("sync-disaggregated", "end_to_end", ["mode=sync"]),
                System("async-monolithic", "end_to_end", mono),
                System("sync-monolithic", "end_to_end", ["mode=sync", *mono])]
    if "affinity" in sections:
        inference = [p for p in cfg.cluster.pools if p.role is Role.INFERENCE]
        others = [p.model_dump(mode="json") for p in cfg.cluster.pools
                  if p.role is not Role.INFERENCE]
        template = inference[0].model_dump(mode="json")
        for profile in sorted({p.profile for p in inference}):
            shape = inference_shape(cfg, profile)
            pool = template | {"name": "inference", "profile": profile, "gpus": shape.gpus,
                               "workers": shape.workers}
            pools = yaml.safe_dump([pool, *others], default_flow_style=True, width=10**6)
            out.append(System(f"{profile}-only", "affinity", [f"cluster.pools={pools.strip()}"]))
        if cfg.rollout.turn_placement != "split":
            out.append(System("per-request split", "affinity", ["rollout.turn_placement=split"]))
    if "asynchrony" in sections and cfg.rollout.cohort_max > 1:
        # what a cohort's members cost each other: the stage waiting for all of them, and no
        # cohorts at all (a task per trajectory and turn: no barrier, more orchestration)
        if not cfg.rollout.cohort_barrier:
            out.append(System("cohort barrier", "asynchrony", ["rollout.cohort_barrier=true"]))
        out.append(System("per-trajectory tasks", "asynchrony", ["rollout.cohort_max=1"]))
    if "environment" in sections:
        for spread in ENV_SPREADS:
            latency = env_spread(cfg, spread)
            if not latency:
                break
            name = f"sync, trajectory-level env, std {spread:.0%} of mean"
            out += [System(name, "environment", ["mode=sync", *latency]),
                    System(name.replace("trajectory-level", "batch-level"), "environment",
                           ["mode=sync", "rollout.env_barrier=true", *latency],
                           baseline=name)]
    if "reward" in sections and dedicated_reward(cfg):
        out.append(System("dedicated reward pool", "reward", dedicated_reward(cfg)))
    if "redundancy" in sections:
        spare = cfg.rollout.spare_groups
        out.append(System(f"spare groups {0 if spare else 2}", "redundancy",
                          [f"rollout.spare_groups={0 if spare else 2}"]))
    return out


def env_spread(cfg: TrainConfig, spread: float) -> list[str]:
    """Overrides giving every remote-latency environment normal step latency around its
    median, with ``spread`` x that as the standard deviation (none when the workload has no
    such environment)."""
    out = []
    for i, t in enumerate(cfg.env_tasks):
        lat = t.env.get("step_latency")
        if not isinstance(lat, dict):
            continue
        mean = (lat.get("mean_s") or lat.get("median_s") or lat.get("p50_s")
                or lat.get("seconds") or 0.0)
        out.append(f"env_tasks.{i}.env.step_latency={{kind: normal, mean_s: {mean}, "
                   f"std_s: {spread * mean}}}")
    return out


def dedicated_reward(cfg: TrainConfig) -> list[str] | None:
    """Overrides that move the reward model from serverless instances onto a dedicated local
    pool of ``reward.judge.gpus`` devices taken from the inference pool of its profile."""
    judge = cfg.reward.judge
    if judge is None:
        return None
    for i, p in enumerate(cfg.cluster.pools):
        if (p.role is Role.INFERENCE and p.profile == judge.profile and p.gpus <= judge.gpus
                and judge.gpus % p.gpus == 0 and p.workers > judge.gpus // p.gpus):
            return ["reward.backend=local",
                    f"cluster.pools.{i}.workers={p.workers - judge.gpus // p.gpus}"]
    return None


def run_system(workload: Path, system: System, steps: int, extra: list[str],
               run_dir: Path, resume: bool = False) -> dict:
    cfg = load_config(workload, [*extra, *system.overrides, f"trainer.max_steps={steps}",
                                 "metrics.progress=false", "metrics.task_stream=true",
                                 # the bench draws its own timelines from the task stream
                                 "metrics.performance_report=false",
                                 "cluster.dashboard_port=0", "eval.every_steps=0"])
    t0 = time.perf_counter()
    if not (resume and (run_dir / "summary.json").exists()):
        trained = TrainedBatches()  # which trajectories each step trained: the bound's work
        run_training(cfg, run_dir, dashboard=lambda line: None, on_transition=trained)
        trained.save(run_dir / TRAINED_FILE)
    figures = run_figures(run_dir, cfg)
    figures["hardware"] = hardware_of(cfg)
    figures["bench_wall_s"] = time.perf_counter() - t0
    return figures


def principle_rows(results: dict[str, dict], ratios: dict, chosen: list[System]) -> list[list]:
    """One row per per-principle system against its baseline (a system that is itself some
    other's baseline shows as that one's baseline only); ``ratios``: by system, its paired
    ratios against its baseline."""
    baselines = {s.baseline for s in chosen}
    rows = []
    for s in chosen:
        if (s.section == "end_to_end" or s.name in baselines or s.name not in results
                or s.baseline not in results):
            continue
        r, b = results[s.name], results[s.baseline]
        note = ""
        if s.section == "reward":
            gpu_s = b.get("reward_serverless_gpu_s", b["reward_serverless_billed_s"])
            note = (f"dedicated reward GPU busy {r['reward_gpu_busy_fraction']:.0%}; serverless "
                    f"GPU-seconds billed {gpu_s:.0f} ({gpu_s / b['wall_s']:.2f} GPUs on "
                    f"average)")
        x = ratios[s.name]
        rows.append([s.section, s.name, s.baseline, cost_text(r, b),
                     f"{r['step_s_median']:.1f}", f"{b['step_s_median']:.1f}",
                     *[x[k].text() for k in RATIOS], PAPER.get(s.section, ""), note])
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="long_tail",
                   help="a name in config/bench/ or a path to a workload YAML")
    p.add_argument("--steps", type=int, default=None,
                   help="train steps per system (default: the workload's trainer.max_steps)")
    p.add_argument("--repeats", type=int, default=3, help="runs per system, interleaved")
    p.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    p.add_argument("--only", nargs="+", default=None, metavar="SYSTEM",
                   help="run only these systems (rollarc always runs: ratios refer to it)")
    p.add_argument("--out", default=None, help="output directory (default runs/bench/...)")
    p.add_argument("--resume", action="store_true",
                   help="reuse the runs already finished in --out (a bench cut short)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides for every system")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    workload = Path(args.workload)
    if not workload.exists():
        workload = WORKLOADS / f"{args.workload}.yaml"
    if not workload.exists():
        print(f"unknown workload {args.workload!r}: one of "
              f"{sorted(f.stem for f in WORKLOADS.glob('*.yaml'))} or a path", file=sys.stderr)
        return 2
    base = load_config(workload, args.overrides)
    args.steps = args.steps or base.trainer.max_steps
    chosen = systems(base, tuple(args.sections))
    if args.only:
        unknown = set(args.only) - {s.name for s in chosen}
        if unknown:
            print(f"unknown systems {sorted(unknown)}: {[s.name for s in chosen]}",
                  file=sys.stderr)
            return 2
        keep = {"rollarc", *args.only}
        chosen = [s for s in chosen if s.name in keep or s.baseline in keep and s.name in keep]
    out = Path(args.out or f"runs/bench/{workload.stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    console = Console(width=240)
    started = time.perf_counter()
    per_system: dict[str, list[dict]] = {s.name: [] for s in chosen}
    for rep in range(args.repeats):
        for s in chosen:
            console.print(f"[{rep + 1}/{args.repeats}] {s.name} ({args.steps} steps) ...")
            run_dir = out / "runs" / f"{s.name.replace(' ', '_').replace(',', '')}-{rep}"
            per_system[s.name].append(run_system(workload, s, args.steps, args.overrides,
                                                 run_dir, args.resume))
    results = {name: merge_repeats(runs) for name, runs in per_system.items()}
    # paired by repeat: each system against rollarc, and against its own baseline
    vs_rollarc = {name: compare(runs, per_system["rollarc"])
                  for name, runs in per_system.items() if name != "rollarc"}
    vs_baseline = {s.name: compare(per_system[s.name], per_system[s.baseline])
                   for s in chosen if s.name in per_system and s.baseline in per_system
                   and s.name != s.baseline}
    ts = base.engine.time_scale
    e2e = {s.name: results[s.name] for s in chosen if s.section == "end_to_end"}
    report = [f"# {workload.stem}: {args.steps} train steps per system, "
              f"{args.repeats} repeat(s); emulated seconds (time_scale {ts})", "",
              f"Figures: median over repeats (lowest-highest repeat). Ratios: per repeat, "
              f"median [min, max]; above 1 the reference did better; a gain or a loss only "
              f"when every repeat agrees. $/h: provisioned GPUs plus serverless GPU-seconds; "
              f"systems are sized within {COST_TOLERANCE:.0%} of rollarc's provisioned $/h "
              f"(! beyond it, measured).", "",
              "## End to end", "", system_tables(e2e, vs_rollarc, "rollarc")]
    rows = principle_rows(results, vs_baseline, chosen)
    if rows:
        report += ["", "## Per principle", "", markdown_table(
            ["principle", "system", "baseline", "$/h (vs baseline)", "s/step",
             "baseline s/step", *[f"x vs baseline, {k}" for k in RATIOS], "paper", "notes"],
            rows), "", "### All systems", "",
            system_tables({"rollarc": results["rollarc"]}
                          | {k: v for k, v in results.items() if k not in e2e}, vs_rollarc,
                          "rollarc")
            if len(results) > len(e2e) else ""]
    # why each of rollarc's steps (first repeat) took as long as it did
    first = out / "runs" / "rollarc-0"
    steps_view = critical_path.step_breakdown(first) if (first / "summary.json").exists() else []
    if steps_view:
        report += ["", "## Why each step took as long as it did (rollarc, first repeat)", "",
                   "The critical path of each train step (the trajectory whose end let the "
                   "batch be cut, then the train step) in emulated seconds by kind of work, "
                   "and the pool it spent most of them on.", "",
                   critical_path.markdown(steps_view)]
    bench_wall = time.perf_counter() - started
    report += ["", f"bench wall time: {bench_wall:.0f} s"]
    text = "\n".join(report)
    console.print(text, markup=False, highlight=False)  # "[min, max]" is no markup
    (out / "bench.md").write_text(text + "\n")
    (out / "bench.json").write_text(json.dumps(
        {"workload": str(workload), "steps": args.steps, "repeats": args.repeats,
         "time_scale": ts, "bench_wall_s": bench_wall, "cost_tolerance": COST_TOLERANCE,
         "results": results, "ratios_vs_rollarc": ratio_dicts(vs_rollarc),
         "ratios_vs_baseline": ratio_dicts(vs_baseline), "runs": per_system}, indent=2,
        default=str))
    streams = {}
    for s in chosen:
        if s.section != "end_to_end":
            continue
        run_dir = out / "runs" / f"{s.name.replace(' ', '_').replace(',', '')}-0"
        streams[s.name] = json.loads((run_dir / "task_stream.json").read_text())
        save_timelines({s.name: streams[s.name]}, out / f"timeline-{s.name}.png", ts)
    pair = {k: streams[k] for k in ("rollarc", "sync-monolithic") if k in streams}
    if pair:
        save_timelines(pair, out / "timeline.png", ts)
    console.print(f"written: {out}/bench.md, bench.json, timeline*.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
