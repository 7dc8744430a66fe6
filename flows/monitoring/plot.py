"""Curves of one run, or of several overlaid: reward and per-env-task success against train step
and against wall time (evaluation rounds marked), staleness and throughput below.

Every run draws its own ``curves.png`` at the end; this redraws it, or compares runs:

    python -m flows.monitoring.plot runs/20261201-101500
    python -m flows.monitoring.plot runs/async runs/sync --out async-vs-sync.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flows.monitoring.metrics import read_metrics

STYLES = ("-", "--", ":", "-.")


def env_names(rows: list[dict]) -> list[str]:
    """Env tasks of a run, in the order their success first appears."""
    names: dict[str, None] = {}
    for r in rows:
        for k in r:
            if k.startswith("env/") and k.endswith("/success"):
                names.setdefault(k.split("/")[1], None)
    return list(names)


def trained_per_s(train: list[dict]) -> list[float]:
    """Trajectories trained per second of each step after the first."""
    out = []
    for a, b in zip(train, train[1:], strict=False):
        dt = b.get("perf/elapsed_s", 0.0) - a.get("perf/elapsed_s", 0.0)
        dn = b.get("rollout/trained", 0) - a.get("rollout/trained", 0)
        out.append(dn / dt if dt > 0 else 0.0)
    return out


def draw_curves(runs: dict[str, tuple[list[dict], list[dict]]], out: str | Path) -> Path:
    """``runs``: label -> (train rows, evaluation rows), as :func:`flows.monitoring.metrics.read_metrics`
    gives them. Writes the PNG and returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5), height_ratios=(3, 2))
    (ax_step, ax_wall), (ax_stale, ax_tput) = axes
    names = sorted({n for train, _ in runs.values() for n in env_names(train)})
    colors = {n: f"C{i % 10}" for i, n in enumerate(names)}
    several = len(runs) > 1
    for i, (label, (train, evals)) in enumerate(runs.items()):
        style = STYLES[i % len(STYLES)]
        tag = f"{label}: " if several else ""
        steps = [r["train/step"] for r in train]
        wall = [r.get("perf/elapsed_s", 0.0) for r in train]
        for x, ax in ((steps, ax_step), (wall, ax_wall)):
            ax.plot(x, [r.get("reward/mean", 0.0) for r in train], style, color="black",
                    lw=1.2, label=f"{tag}reward mean")
            for n in names:
                key = f"env/{n}/success"
                pts = [(xv, r[key]) for xv, r in zip(x, train, strict=True) if key in r]
                if pts:
                    ax.plot(*zip(*pts, strict=True), style, color=colors[n], lw=1.8,
                            label=f"{tag}{n} success")
        for n in names:
            key = f"eval/{n}/success"
            pts = [(r["eval/step"], r.get("perf/elapsed_s"), r[key]) for r in evals if key in r]
            if pts:
                ax_step.scatter([p[0] for p in pts], [p[2] for p in pts], marker="D", s=36,
                                color=colors[n], edgecolor="black", zorder=3,
                                label=f"{tag}{n} evaluation")
                timed = [p for p in pts if p[1] is not None]
                ax_wall.scatter([p[1] for p in timed], [p[2] for p in timed], marker="D", s=36,
                                color=colors[n], edgecolor="black", zorder=3)
        ax_stale.plot(steps, [r.get("rollout/staleness_mean", 0.0) for r in train], style,
                      color="C0", label=f"{tag}mean")
        ax_stale.plot(steps, [r.get("rollout/staleness_max", 0) for r in train], style,
                      color="C3", lw=0.8, label=f"{tag}max")
        ax_tput.plot(steps, [r.get("perf/trajectories_per_s", 0.0) for r in train], style,
                     color="C2", label=f"{tag}finished/s, since the start")
        ax_tput.plot(steps[1:], trained_per_s(train), style, color="C4", lw=0.8,
                     label=f"{tag}trained/s, per step")
    ax_step.set(title="Reward and success by step", xlabel="policy version (train step)",
                ylabel="success rate; mean reward")
    ax_wall.set(title="Reward and success by wall time", xlabel="seconds since the first step")
    ax_stale.set(title="Staleness of trained trajectories", xlabel="policy version",
                 ylabel="steps")
    ax_tput.set(title="Throughput", xlabel="policy version", ylabel="trajectories per second")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    ax_step.legend(fontsize=7, loc="lower right")
    for ax in (ax_stale, ax_tput):
        ax.legend(fontsize=7)
    fig.suptitle(" vs ".join(runs) if several else f"run {next(iter(runs))}")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def load_run(run_dir: str | Path) -> tuple[list[dict], list[dict]]:
    return read_metrics(run_dir, "train"), read_metrics(run_dir, "eval")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dirs", nargs="+", help="Run directories (with metrics.jsonl)")
    p.add_argument("--out", default=None, help="PNG to write (default: RUN_DIR/curves.png for "
                                               "one run, curves.png here for several)")
    args = p.parse_args(argv)
    runs = {}
    for d in args.run_dirs:
        if not (Path(d) / "metrics.jsonl").is_file():
            print(f"error: {d} has no metrics.jsonl", file=sys.stderr)
            return 2
        label = Path(d).resolve().name
        runs[label if label not in runs else str(d)] = load_run(d)
    out = args.out or (Path(args.run_dirs[0]) / "curves.png" if len(runs) == 1 else
                       Path("curves.png"))
    print(draw_curves(runs, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
