"""The benchmark's figures and timelines, from a finished run's directory. Pure (files in,
dicts and text out), so ``flows/bench.py`` and a notebook read runs the same way; the tables
over repeats are :mod:`flows.benchmarks.tables`.

Every time is reported in *emulated* seconds (real seconds / ``engine.time_scale``): what the run
would take on the production cluster it emulates. Ratios are the same either way. A run's cost
is its provisioned GPUs' $/h over its emulated wall time plus the serverless reward model's
billed GPU-seconds (:func:`flows.benchmarks.costs.run_cost`); its *trained tokens* are the
prompt and response tokens (virtual lengths) of the trajectories its train steps trained; its
bound is :mod:`flows.benchmarks.bound`'s.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from statistics import median
from typing import Any

from flows.benchmarks.bound import lower_bound
from flows.benchmarks.costs import run_cost
from flows.benchmarks.work import read_run_work
from flows.config import TrainConfig, load_config
from flows.config.derived import is_emulated
from flows.monitoring.metrics import read_metrics
from flows.monitoring.step_timings import legs_of

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
    its tasks: each member's turn counts their whole compute time, in every cohort it went
    through (a member continued after its stage returned went through several)."""
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
        task += sum(compute.get(leg, 0.0) for leg in legs_of(suffix))
    n = max(len(stream["turns"]), 1)
    wall = max(wall, 1e-12)
    return {"turns": len(stream["turns"]), "turn_wall_ms": 1e3 * wall / n,
            "orchestration_ms": 1e3 * (wall - task) / n,
            "orchestration_fraction": (wall - task) / wall,
            "emulated_fraction": emulated / wall,
            "real_work_fraction": (task - emulated) / wall}


def _engines(summary: dict) -> tuple[dict[str, dict], int, float, dict[str, float]]:
    """Per pool its engines' busy seconds, the tokens decoded, the emulated trainer's busy
    seconds, and the reward model's dedicated-busy and serverless-billed seconds."""
    pools: dict[str, dict] = defaultdict(lambda: {"engines": 0, "busy_s": 0.0})
    decoded = 0
    trainer_busy = 0.0
    judge = {"dedicated_busy_s": 0.0, "serverless_billed_s": 0.0, "serverless_gpu_s": 0.0}
    for w in summary["workers"].values():
        for stats in (w.get("reward_judge") or {}).values():
            judge["dedicated_busy_s"] += stats.get("dedicated_busy_s", 0.0)
            billed = stats.get("serverless_billed_s", 0.0)
            judge["serverless_billed_s"] += billed
            judge["serverless_gpu_s"] += billed * stats.get("gpus", 1)
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
    return pools, decoded, trainer_busy, judge


def run_figures(run_dir: Path, cfg: TrainConfig | None = None) -> dict[str, Any]:
    """Every figure of one run (see the module docstring for units); ``cfg``: the run's
    config (default: its ``config.yaml``)."""
    if cfg is None:
        cfg = load_config(run_dir / "config.yaml")
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = read_metrics(run_dir)
    time_scale = cfg.engine.time_scale
    to_emu = 1.0 / time_scale
    wall = summary["elapsed_s"] * to_emu
    ends = [0.0] + [r["perf/elapsed_s"] * to_emu for r in rows]
    steps = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    last = rows[-1] if rows else {}
    envs = sorted({k.split("/")[1] for k in last if k.startswith("env/")})
    pools, decoded, trainer_busy, judge = _engines(summary)
    busy = {name: p["busy_s"] / max(p["engines"], 1) / wall for name, p in pools.items()}
    trained = summary["trajectories"]["trained"]
    cost = run_cost(cfg, wall, judge["serverless_billed_s"])
    out: dict[str, Any] = {
        "wall_s": wall, "steps": len(rows),
        "step_s_median": median(steps) if steps else float("nan"),
        "step_s_p10": _quantile(steps, 0.1), "step_s_p90": _quantile(steps, 0.9),
        "trajectories_per_s": trained / wall,
        "generated_tokens_per_s": decoded / wall,
        "busy_fraction": busy, "trainer_busy_fraction": trainer_busy / wall,
        "bubble_s": {name: wall * (1 - f) for name, f in busy.items()},
        "staleness_mean": (sum(r["rollout/staleness_mean"] for r in rows) / len(rows)
                           if rows else 0.0),
        "staleness_max": max((r["rollout/staleness_max"] for r in rows), default=0),
        "dropped": summary["trajectories"]["dropped"],
        "success": {e: last.get(f"env/{e}/success") for e in envs},
        "pools": {n: dict(p) for n, p in pools.items()},
        "cost": cost, "cost_per_hour": cost["per_hour"],
        # a reward model's GPUs: the dedicated pool's busy share, the serverless seconds billed
        "reward_gpu_busy_fraction": judge["dedicated_busy_s"] / wall,
        "reward_serverless_billed_s": judge["serverless_billed_s"],
        "reward_serverless_gpu_s": judge["serverless_gpu_s"],
        "bound_s": 0.0,
    }
    stream_file = run_dir / "task_stream.json"
    if stream_file.exists():
        out["overhead"] = turn_overhead(json.loads(stream_file.read_text()))
    work = read_run_work(run_dir, time_scale)
    if work is not None and work.trained and is_emulated(cfg.engine):
        bound = lower_bound(work, cfg)
        out |= {"bound_s": bound["bound_s"], "bound_terms_s": bound["terms_s"],
                "bound_binding": bound["binding"], "bound_complete": bound["complete"],
                "x_bound": wall / bound["bound_s"] if bound["bound_s"] > 0 else None,
                "trained_tokens": work.trained_tokens,
                "untrained_tokens": work.untrained_tokens}
        out["trained_tokens_per_s"] = work.trained_tokens / wall
        out["trained_tokens_per_usd"] = (work.trained_tokens / cost["usd"] if cost["usd"] > 0
                                         else None)
    out["bound_s_per_step"] = out["bound_s"] / max(len(rows), 1)
    return out


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
