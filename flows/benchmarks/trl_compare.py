"""RollArc's embedded default and the TRL baseline (:mod:`flows.benchmarks.trl_baseline`) side
by side: each run in a fresh process, seeds interleaved, with the CPU its process tree used
(:mod:`flows.benchmarks.cpu`); per system the median [min, max] over seeds, and RollArc over
TRL seed by seed, called a difference only when every seed agrees.

    python -m flows.benchmarks.trl_baseline --compare --steps 80 --seeds 0 1 2
    python -m flows.benchmarks.trl_baseline --compare --frozen --steps 40 --seeds 0 1 2
    python -m flows.benchmarks.trl_baseline --pool runs/trl_compare runs/trl_compare_345

A learning run's step is as long as its policy's episodes: the two systems' steps are equal
work only while their policies play alike, so a learning comparison also reports seconds per
thousand trained tokens. ``--frozen`` holds both policies at their initialisation (every
pass, optimizer step and weight sync still runs, at a learning rate of ``FROZEN_LR``): every
step is then the same work in both, and s/step compares the systems alone.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from statistics import median

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flows.benchmarks.backends import TARGET, WINDOW, spread, steps_to_target
from flows.benchmarks.cpu import cores_busy, run_sampling_cpu
from flows.monitoring.metrics import read_metrics

logger = logging.getLogger(__name__)

SUCCESS_KEY = "env/frozenlake/success"
# the learning rate of --frozen: AdamW moves a weight by about the learning rate per step, and
# 1e-12 is below float32's resolution at the initial weights' size (~1e-2: steps of ~1e-9; a
# zero-initialised bias does move, by ~1e-12 a step), so the policy's samples stay as they were
# while every pass of the update still runs
FROZEN_LR = 1e-12
ROOT = Path(__file__).resolve().parents[2]


def run_figures(rows: list[dict]) -> dict:
    """A run's figures from its train steps' metric rows (RollArc's or TRL's, one per step):
    per-step wall times, seconds per step over the run, the tokens its batches trained
    (sequence tokens, what a step's rollouts and passes grow with: a policy that has learned
    plays shorter episodes, so steps of two runs are equal work only while their policies
    play alike) and seconds per thousand of them, and the step and elapsed seconds at which
    FrozenLake's success, averaged over ``WINDOW`` steps, first reaches ``TARGET``."""
    elapsed = [float(r["perf/elapsed_s"]) for r in rows]
    step_s = [b - a for a, b in zip([0.0, *elapsed], elapsed, strict=False)]
    reached = steps_to_target(rows, SUCCESS_KEY)
    tokens = (sum(r["rollout/sequence_tokens"] * r["rollout/batch_trajectories"] for r in rows)
              if rows and all("rollout/sequence_tokens" in r for r in rows) else None)
    return {"steps": len(rows), "elapsed_s": elapsed[-1] if elapsed else 0.0,
            "s_per_step": elapsed[-1] / len(rows) if rows else None,
            "trained_tokens": tokens,
            "s_per_1k_tokens": 1000 * elapsed[-1] / tokens if tokens else None,
            "step_s_median": median(step_s) if step_s else None, "step_s": step_s,
            "step_to_target": reached[0] if reached else None,
            "s_to_target": reached[1] if reached else None}


def run_system(system: str, seed: int, steps: int, run_dir: Path, overrides: list[str],
               threads: int = 1, heap_keep_mb: float = 0) -> dict:
    """One run in a fresh process (``flows/train.py`` or this module), its figures read from
    the metric rows it wrote, with the cores its processes kept busy (:func:`cores_busy`) and
    so the core-seconds a step took."""
    common = [f"seed={seed}", f"trainer.max_steps={steps}", *overrides]
    if system == "rollarc":
        cmd = [sys.executable, "flows/train.py", "--run-dir", str(run_dir), *common,
               "metrics.progress=false", "cluster.dashboard_port=0"]
    else:
        cmd = [sys.executable, "-m", "flows.benchmarks.trl_baseline", "--out", str(run_dir),
               "--steps", str(steps), "--seed", str(seed), "--threads", str(threads),
               "--heap-keep-mb", str(heap_keep_mb), *overrides]
    logger.info("%s seed %d: %s", system, seed, " ".join(cmd))
    cores = cores_busy(run_sampling_cpu(cmd, cwd=ROOT))
    figures = run_figures(read_metrics(run_dir))
    # over the whole run, where cores_busy is its middle: an estimate, labelled so
    core_s = cores * figures["s_per_step"] if cores is not None and figures["s_per_step"] else None
    return figures | {"system": system, "seed": seed, "run_dir": str(run_dir),
                      "cores_busy": cores, "core_s_per_step": core_s}


def compare_report(runs: list[dict], console) -> dict:
    """Per system over seeds: s/step and steps and seconds to the target, median [min, max];
    RollArc over TRL per seed, a gain only when every seed agrees."""
    systems = ["rollarc", "trl"]
    by = {s: [r for r in runs if r["system"] == s] for s in systems}
    table = Table(title=escape(f"RollArc default vs TRL GRPOTrainer (median [min, max] over "
                               f"seeds); target: FrozenLake {TARGET} over {WINDOW} steps"))
    for col in ("system", "s/step", "s per 1k trained tokens", "step to target", "s to target",
                "reached", "cores busy", "core-s/step (cores busy x s/step)"):
        table.add_column(col)
    out: dict = {"runs": runs, "systems": {}, "ratios": {}}
    for s, rs in by.items():
        def vals(key, rs=rs):
            return [r[key] for r in rs if r.get(key) is not None]

        row = {"s_per_step": spread(vals("s_per_step")),
               "s_per_1k_tokens": spread(vals("s_per_1k_tokens")),
               "step_to_target": spread(vals("step_to_target")),
               "s_to_target": spread(vals("s_to_target")),
               "reached": f"{len(vals('step_to_target'))}/{len(rs)}",
               "cores_busy": spread(vals("cores_busy")),
               "core_s_per_step": spread(vals("core_s_per_step"))}
        out["systems"][s] = row
        table.add_row(s, *row.values())
    console.print(table)
    for key in ("s_per_step", "s_per_1k_tokens", "s_to_target", "core_s_per_step"):
        ratios = [a[key] / b[key] for a in by["rollarc"] for b in by["trl"]
                  if a["seed"] == b["seed"] and a.get(key) is not None and b.get(key)]
        if not ratios:
            continue
        below, above = (("rollarc uses less", "rollarc uses more") if key == "core_s_per_step"
                        else ("rollarc faster", "rollarc slower"))
        verdict = (below if max(ratios) < 1 else above if min(ratios) > 1
                   else "no difference beyond the spread")
        out["ratios"][key] = {"median": median(ratios), "min": min(ratios), "max": max(ratios),
                              "seeds": len(ratios), "verdict": verdict}
        console.print(escape(f"rollarc / trl {key}: {median(ratios):.2f}x [{min(ratios):.2f}, "
                             f"{max(ratios):.2f}] over {len(ratios)} seeds: {verdict}"))
    return out


def pool(dirs: list[Path], out: Path | None = None) -> dict:
    """The runs of several ``--compare`` outputs (their ``compare.json``) reported as one, so
    that seeds run at different times add up; a system's seed may appear once only, since
    RollArc and TRL are paired by seed. Written to ``out``/compare.json when given."""
    runs: list[dict] = []
    for d in dirs:
        path = Path(d) / "compare.json"
        if not path.is_file():
            raise FileNotFoundError(f"--pool {d}: no compare.json there (a --compare output)")
        runs += json.loads(path.read_text())["runs"]
    seen: set[tuple[str, int]] = set()
    for r in runs:
        key = (r["system"], r["seed"])
        if key in seen:
            raise ValueError(f"--pool: {r['system']} seed {r['seed']} is in more than one of "
                             f"{[str(d) for d in dirs]}; pool runs of different seeds")
        seen.add(key)
    result = compare_report(runs, Console())
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare.json").write_text(json.dumps(result, indent=2))
    return result


def compare(seeds: list[int], steps: int, out: Path, overrides: list[str], threads: int = 1,
            heap_keep_mb: float = 0) -> dict:
    runs = [run_system(system, seed, steps, out / f"{system}-seed{seed}", overrides, threads,
                       heap_keep_mb)
            for seed in seeds for system in ("rollarc", "trl")]
    result = compare_report(runs, Console())
    (out / "compare.json").write_text(json.dumps(result, indent=2))
    return result
