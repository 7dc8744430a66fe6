"""Compare the paper's baselines with RollArc, side by side in one run.

Runs ``flows/train.py`` once per mode (async | sync) x placement (disaggregated | monolithic) on
the same config, each on a fresh local cluster, and prints wall time, trajectories/s, time per
train step, time to a FrozenLake success target, and each one's ratio to async + disaggregated.

    python flows/bench.py                        # 4 modes, 20 steps each
    python flows/bench.py --steps 60 --target 0.8  # full runs: end-to-end time to learn
    python flows/bench.py --modes async/disaggregated sync/disaggregated -- rollout.max_staleness=3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from flows.metrics import read_metrics

TRAIN = Path(__file__).resolve().parent / "train.py"
MODES = ["async/disaggregated", "sync/disaggregated", "async/monolithic", "sync/monolithic"]


def run_mode(mode: str, steps: int, extra: list[str], run_dir: Path, target: float,
             env_name: str) -> dict:
    sched, placement = mode.split("/")
    cmd = [sys.executable, str(TRAIN), "--run-dir", str(run_dir), f"mode={sched}",
           f"placement={placement}", f"trainer.max_steps={steps}", "metrics.progress=false",
           "cluster.dashboard_port=0", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = read_metrics(run_dir)
    reached = next((m["perf/elapsed_s"] for m in metrics
                    if m.get(f"env/{env_name}/success", 0) >= target), None)
    last = metrics[-1]
    return {"mode": mode, "elapsed_s": summary["elapsed_s"],
            "traj_per_s": last["perf/trajectories_per_s"],
            "step_s": summary["elapsed_s"] / max(len(metrics), 1),
            "time_to_target_s": reached,
            "final_success": last.get(f"env/{env_name}/success"),
            "staleness_mean": sum(m["rollout/staleness_mean"] for m in metrics) / len(metrics)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="train steps per mode")
    p.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    p.add_argument("--target", type=float, default=0.8, help="success target for time-to-target")
    p.add_argument("--env", default="frozenlake", help="env task whose success is tracked")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--keep", default=None, help="keep each mode's run directory under this path")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides for every mode")
    args = p.parse_args(argv)
    console = Console(width=200)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp)
        for mode in args.modes:
            console.print(f"running {mode} for {args.steps} steps ...")
            rows.append(run_mode(mode, args.steps, args.overrides,
                                 root / mode.replace("/", "-"), args.target, args.env))
    base = rows[0]
    table = Table(title=f"{args.steps} train steps per mode; ratios are to {base['mode']}")
    for col in ("mode", "wall s", "x wall", "traj/s", "x traj/s", "s/step",
                f"s to {args.env}>={args.target}", "x to target", "final success", "staleness"):
        table.add_column(col)
    for r in rows:
        ttt, bttt = r["time_to_target_s"], base["time_to_target_s"]
        table.add_row(
            r["mode"], f"{r['elapsed_s']:.0f}", f"{r['elapsed_s'] / base['elapsed_s']:.2f}",
            f"{r['traj_per_s']:.1f}", f"{r['traj_per_s'] / base['traj_per_s']:.2f}",
            f"{r['step_s']:.1f}", f"{ttt:.0f}" if ttt else "not reached",
            f"{ttt / bttt:.2f}" if ttt and bttt else "-",
            f"{r['final_success']:.2f}" if r["final_success"] is not None else "-",
            f"{r['staleness_mean']:.2f}")
    console.print(table)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
