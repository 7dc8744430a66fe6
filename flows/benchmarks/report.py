"""The benchmark's figures, tables and timelines, from a finished run's directory. Pure (files in,
dicts and text out), so ``flows/bench.py`` and a notebook read runs the same way.

Every time is reported in *emulated* seconds (real seconds / ``engine.time_scale``): what the run
would take on the production cluster it emulates. Ratios are the same either way.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from statistics import median
from typing import Any

from flows.monitoring.metrics import read_metrics

# stages drawn in the timeline, in legend order, with their colours
STAGE_COLOURS = {"env_reset": "#8c564b", "prefill": "#1f77b4", "decode": "#ff7f0e",
                 "env_step": "#2ca02c", "env_close": "#98df8a",
                 "score": "#9467bd", "train_step": "#d62728", "publish_weights": "#e377c2",
                 "load_weights": "#7f7f7f", "time_share": "#bcbd22"}
CHAIN = ("prefill", "decode", "env_step")


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))] if xs else float("nan")


def turn_overhead(stream: dict) -> dict[str, float]:
    """Per turn, the wall time from submission to the driver holding the result, split into
    the tasks' compute (emulated waits, then real work) and the rest: the driver's loop,
    scheduling, messages and transfers (the orchestration overhead). A cohort's members share
    its tasks: each member's turn counts their whole compute time."""
    compute: dict[str, float] = defaultdict(float)
    for key, _worker, start, stop in stream["tasks"]:
        stage, _, suffix = key.partition("-")
        if stage in CHAIN:
            compute[suffix] += stop - start
        elif stage == "env_reset":
            compute[suffix] += stop - start  # the first turn's chain starts with the reset
    wall = emulated = task = 0.0
    for suffix, submitted, done, waited, _traj in stream["turns"]:
        wall += done - submitted
        emulated += waited
        task += compute.get(suffix, 0.0)
    n = max(len(stream["turns"]), 1)
    wall = max(wall, 1e-12)
    return {"turns": len(stream["turns"]), "turn_wall_ms": 1e3 * wall / n,
            "orchestration_ms": 1e3 * (wall - task) / n,
            "orchestration_fraction": (wall - task) / wall,
            "emulated_fraction": emulated / wall,
            "real_work_fraction": (task - emulated) / wall}


def run_figures(run_dir: Path, time_scale: float) -> dict[str, Any]:
    """Every figure of one run (see the module docstring for units)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = read_metrics(run_dir)
    to_emu = 1.0 / time_scale
    wall = summary["elapsed_s"] * to_emu
    ends = [0.0] + [r["perf/elapsed_s"] * to_emu for r in rows]
    steps = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    last = rows[-1] if rows else {}
    envs = sorted({k.split("/")[1] for k in last if k.startswith("env/")})
    pools: dict[str, dict[str, float]] = defaultdict(lambda: {"engines": 0, "busy_s": 0.0})
    decoded = 0
    trainer_busy = 0.0
    judge = {"dedicated_busy_s": 0.0, "serverless_billed_s": 0.0}
    for w in summary["workers"].values():
        for stats in (w.get("reward_judge") or {}).values():
            for k in judge:
                judge[k] += stats.get(k, 0.0)
        emu = (w.get("engine") or {}).get("emulated")
        if emu:
            p = pools[w["pool"]]
            p["engines"] += 1
            p["busy_s"] += emu["busy_s"]
            p["profile"] = w["engine"]["profile"]
            p["gpus"] = w["engine"]["gpus"]
            decoded += emu["decode_tokens"]
        if (w.get("trainer") or {}).get("emulated_busy_s"):
            trainer_busy = w["trainer"]["emulated_busy_s"]
    busy = {name: p["busy_s"] / max(p["engines"], 1) / wall for name, p in pools.items()}
    # the analytic lower bound: each pool's device work spread evenly over its engines, and
    # the trainer's work; no schedule finishes sooner than the busiest of them
    bounds = {f"pool {name}": p["busy_s"] / max(p["engines"], 1) for name, p in pools.items()}
    if trainer_busy:
        bounds["trainer"] = trainer_busy
    out: dict[str, Any] = {
        "wall_s": wall, "steps": len(rows),
        "step_s_median": median(steps) if steps else float("nan"),
        "step_s_p10": _quantile(steps, 0.1), "step_s_p90": _quantile(steps, 0.9),
        "trajectories_per_s": summary["trajectories"]["trained"] / wall,
        "generated_tokens_per_s": decoded / wall,
        "busy_fraction": busy, "trainer_busy_fraction": trainer_busy / wall,
        "bubble_s": {name: wall * (1 - f) for name, f in busy.items()},
        "staleness_mean": (sum(r["rollout/staleness_mean"] for r in rows) / len(rows)
                           if rows else 0.0),
        "staleness_max": max((r["rollout/staleness_max"] for r in rows), default=0),
        "dropped": summary["trajectories"]["dropped"],
        "success": {e: last.get(f"env/{e}/success") for e in envs},
        "bounds_s": bounds, "bound_s": max(bounds.values(), default=0.0),
        "pools": {n: dict(p) for n, p in pools.items()},
        # a reward model's GPUs: the dedicated pool's busy share, the serverless seconds billed
        "reward_gpu_busy_fraction": judge["dedicated_busy_s"] / wall,
        "reward_serverless_billed_s": judge["serverless_billed_s"],
    }
    stream_file = run_dir / "task_stream.json"
    if stream_file.exists():
        stream = json.loads(stream_file.read_text())
        out["overhead"] = turn_overhead(stream)
        out["critical_path_s"] = longest_trajectory_s(stream) * to_emu
        if pools:  # on real devices the work per pool is not known: no bound
            out["bound_s"] = max(out["bound_s"], out["critical_path_s"])
    return out


def longest_trajectory_s(stream: dict) -> float:
    """The longest trajectory's own work: its turns' emulated waits, back to back."""
    per_traj: dict[str, float] = defaultdict(float)
    for _suffix, _s, _d, waited, traj in stream["turns"]:
        per_traj[traj] += waited
    return max(per_traj.values(), default=0.0)


# -- tables ---------------------------------------------------------------------------------------


def _fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def system_table(results: dict[str, dict], baseline: str) -> str:
    """One row per system; ``x`` columns are each system's step time over ``baseline``'s."""
    base = results[baseline]["step_s_median"]
    header = ["system", "GPUs ($/h)", "s/step (median)", "p10-p90", f"x vs {baseline}",
              "traj/s", "gen tok/s", "busy per pool", "trainer busy", "staleness mean/max",
              "dropped", "success", "bound s/step", "x bound", "orchestration"]
    rows = []
    for name, r in results.items():
        per_step_bound = r["bound_s"] / max(r["steps"], 1)
        ov = r.get("overhead", {})
        rows.append([
            name, r.get("hardware", "-"), r["step_s_median"],
            f"{r['step_s_p10']:.1f}-{r['step_s_p90']:.1f}", r["step_s_median"] / base,
            r["trajectories_per_s"], r["generated_tokens_per_s"],
            ", ".join(f"{k} {v:.0%}" for k, v in r["busy_fraction"].items()),
            f"{r['trainer_busy_fraction']:.0%}",
            f"{r['staleness_mean']:.2f}/{r['staleness_max']}",
            ", ".join(f"{k} {v}" for k, v in r["dropped"].items()) or "0",
            ", ".join(f"{k} {v:.2f}" for k, v in r["success"].items() if v is not None),
            per_step_bound if r["bound_s"] > 0 else None,
            r["wall_s"] / r["bound_s"] if r["bound_s"] > 0 else None,
            f"{ov['orchestration_fraction']:.1%}" if ov else "-"])
    return markdown_table(header, rows)


# -- timelines ------------------------------------------------------------------------------------


def _lanes(intervals: list[tuple[float, float, str]]) -> list[tuple[int, float, float, str]]:
    """Greedy interval colouring: each task gets the lowest free lane of its worker."""
    free_at: list[float] = []
    out = []
    for start, stop, stage in sorted(intervals):
        for lane, t in enumerate(free_at):
            if t <= start:
                free_at[lane] = stop
                break
        else:
            lane = len(free_at)
            free_at.append(stop)
        out.append((lane, start, stop, stage))
    return out


def draw_timeline(ax, stream: dict, title: str, time_scale: float) -> None:
    """One row per worker (its tasks stacked in lanes), one colour per stage."""
    tasks = stream["tasks"]
    if not tasks:
        return
    t0 = min(start for _k, _w, start, _s in tasks)
    by_worker: dict[str, list] = defaultdict(list)
    for key, worker, start, stop in tasks:
        by_worker[worker].append(((start - t0) / time_scale, (stop - t0) / time_scale,
                                  key.partition("-")[0]))
    pool_of = stream.get("workers", {})
    workers = sorted(by_worker, key=lambda w: (pool_of.get(w, w), w))
    y, ticks, labels = 0.0, [], []
    for w in workers:
        lanes = _lanes(by_worker[w])
        depth = max(lane for lane, *_ in lanes) + 1
        height = 0.9 / depth
        bars: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
        for lane, start, stop, stage in lanes:
            bars[lane, stage].append((start, stop - start))
        for (lane, stage), xranges in bars.items():  # one artist per lane and stage
            ax.broken_barh(xranges, (y + lane * height, height),
                           facecolors=STAGE_COLOURS.get(stage, "#cccccc"), linewidth=0)
        ticks.append(y + 0.45)
        labels.append(f"{pool_of.get(w, '')} {w.rsplit(':', 1)[-1]}")
        y += 1.0
    ax.set_yticks(ticks, labels, fontsize=7)
    ax.set_xlabel("emulated seconds")
    ax.set_title(title, fontsize=9)


def save_timelines(streams: dict[str, dict], path: Path, time_scale: float) -> None:
    """Side-by-side timelines of the given systems in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(1, len(streams), figsize=(8 * len(streams), 6), squeeze=False)
    for ax, (name, stream) in zip(axes[0], streams.items(), strict=True):
        draw_timeline(ax, stream, name, time_scale)
    handles = [Patch(color=c, label=s) for s, c in STAGE_COLOURS.items()]
    fig.legend(handles=handles, loc="lower center", ncol=(len(handles) + 1) // 2, fontsize=7)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
