"""The simulator against the real pipeline on emulated devices: each system of a bench run
(``flows/bench.py --out DIR``) simulated with the same config and seeds, calibrated with what
the simulator cannot know, step time and busy shares compared."""

from __future__ import annotations

import json
from pathlib import Path

from flows.benchmarks.report import markdown_table
from flows.config import TrainConfig, load_config
from flows.monitoring.metrics import read_metrics
from flows.simulation.settings import sim_settings
from flows.simulation.simulator import simulate

VALIDATION_HEADER = ["workload", "system", "emulated s/step", "simulated s/step", "error",
                     "busy per pool, emulated / simulated",
                     "simulated without the measured orchestration"]


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
    config and seeds: step time and busy fraction per pool, emulated against simulated
    (table rows, and records written to ``out/validation.json`` if ``out`` is given)."""
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
                     f"{rec['step_error']:+.0%}", busy,
                     f"{bare_s:.1f} ({bare_s / step_e - 1:+.0%})"])
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "validation.json").write_text(json.dumps(records, indent=1))
    return rows, records


def validation_table(rows: list[list[str]]) -> str:
    """Markdown of :func:`validate`'s rows."""
    return markdown_table(VALIDATION_HEADER, rows)
