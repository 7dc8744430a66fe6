"""The simulator against emulated runs it was not calibrated on.

A calibration (:mod:`flows.simulation.calibration`) is fitted on one bench invocation (one
workload, one seed). Each system of another invocation is then simulated from its config alone,
with the calibration's quantities: the predicted run's turn counts and orchestration are never
read (:meth:`~flows.simulation.calibration.BenchDigest.without_measures` drops them before the
prediction). Two errors are reported: each system's steady time per step, and each baseline's
ratio to ``rollarc`` (baseline s/step over rollarc's), the figure a bench reports.

A simulated run draws its turn counts and lengths from the config's seed, and one draw of a
short run is noisy: over 5 seeds the simulated steady step of one config spans 10-25 % (long_tail
rollarc, 6 steps: 41.1 to 51.8 s). The emulated figure being the median over a bench's repeats,
the simulated one is the median over :data:`SIM_SEEDS` seeds (the config's and the next ones),
reported with its spread.
"""

from __future__ import annotations

import json
import logging
from itertools import accumulate
from pathlib import Path
from statistics import median

from flows.benchmarks.report import markdown_table
from flows.config import with_overrides
from flows.simulation.calibration import BenchDigest, Calibration, steady_step_s
from flows.simulation.settings import sim_settings
from flows.simulation.simulator import simulate

logger = logging.getLogger(__name__)

STEP_TARGET = 0.15  # |simulated / emulated - 1| of a step time
RATIO_TARGET = 0.10  # and of a ratio between systems
REFERENCE = "rollarc"  # the system ratios are taken against
SIM_SEEDS = 5  # simulated runs per system, seeds cfg.seed, cfg.seed + 1, ...

VALIDATION_HEADER = ["workload", "seed", "system", "emulated s/step", "simulated s/step",
                     "simulated, lowest-highest seed", "step error", "x rollarc, emulated",
                     "x rollarc, simulated", "ratio error", "simulated, devices only"]


def predict(cal: Calibration, bench: BenchDigest, devices_only: bool = True,
            seeds: int = SIM_SEEDS) -> list[dict]:
    """Each system of ``bench`` simulated from its config and ``cal``, the median over
    ``seeds`` seeds, against its emulated steady step time (the median over its repeats);
    records with ``step_error`` and (baselines) ``ratio_error``; ``devices_only``: also each
    without the calibration's orchestration."""
    bench = bench.without_measures()  # what is predicted is not read
    by_system: dict[str, list] = {}
    for run in bench.runs:  # repeats of a system: the median of their step times
        by_system.setdefault(run.system, []).append(run)
    records = []
    for system, runs in by_system.items():
        cfg = bench.config(runs[0])
        over = cal.overrides(cfg)
        steps = _steady_steps(cfg, over, system, seeds)
        bare = None
        if devices_only:  # the devices and the drawn turns alone: what the host adds
            bare = median(_steady_steps(cfg, [o for o in over if ".turns." in o], system,
                                        seeds))
        emulated = median(r.steady_step_s for r in runs)
        simulated = median(steps)
        records.append({"workload": bench.workload, "seed": bench.seed, "system": system,
                        "repeats": len(runs),
                        "emulated_step_s": emulated, "simulated_step_s": simulated,
                        "simulated_steps_s": steps,
                        "step_error": simulated / emulated - 1,
                        "devices_only_step_s": bare, "overrides": over})
    ref = next((r for r in records if r["system"] == REFERENCE), None)
    for r in records:
        if ref is None or r is ref:
            continue
        r["emulated_ratio"] = r["emulated_step_s"] / ref["emulated_step_s"]
        r["simulated_ratio"] = r["simulated_step_s"] / ref["simulated_step_s"]
        r["ratio_error"] = r["simulated_ratio"] / r["emulated_ratio"] - 1
    return records


def _steady_steps(cfg, overrides: list[str], system: str, seeds: int) -> list[float]:
    """The steady step time of ``system`` simulated with ``seeds`` seeds from the config's
    (measured as the emulated run is: from its step ends)."""
    out = []
    for k in range(seeds):
        run_cfg = with_overrides(cfg, [f"seed={cfg.seed + k}"]) if k else cfg
        sim = simulate(run_cfg, sim_settings({}, overrides), system)
        out.append(steady_step_s(list(accumulate(sim.step_times))))
    return out


def summary(records: list[dict]) -> dict:
    """The largest errors and whether they meet the targets."""
    steps = [abs(r["step_error"]) for r in records]
    ratios = [abs(r["ratio_error"]) for r in records if "ratio_error" in r]
    out = {"runs": len(records), "step_error_max": max(steps, default=0.0),
           "step_error_mean": sum(steps) / max(len(steps), 1),
           "ratio_error_max": max(ratios, default=0.0),
           "ratio_error_mean": sum(ratios) / max(len(ratios), 1)}
    out["step_within_target"] = out["step_error_max"] <= STEP_TARGET
    out["ratio_within_target"] = out["ratio_error_max"] <= RATIO_TARGET
    return out


def validation_table(records: list[dict]) -> str:
    """Markdown of :func:`predict`'s records, with the largest errors against the targets."""
    rows = []
    for r in records:
        ratio = "ratio_error" in r
        rows.append([r["workload"], r["seed"], r["system"], f"{r['emulated_step_s']:.1f}",
                     f"{r['simulated_step_s']:.1f}",
                     f"{min(r['simulated_steps_s']):.1f}-{max(r['simulated_steps_s']):.1f}",
                     f"{r['step_error']:+.0%}",
                     f"{r['emulated_ratio']:.2f}" if ratio else "-",
                     f"{r['simulated_ratio']:.2f}" if ratio else "-",
                     f"{r['ratio_error']:+.0%}" if ratio else "-",
                     f"{r['devices_only_step_s']:.1f}" if r["devices_only_step_s"] else "-"])
    s = summary(records)
    return (markdown_table(VALIDATION_HEADER, rows)
            + f"\n\nlargest step-time error {s['step_error_max']:.0%} (target "
              f"{STEP_TARGET:.0%}), largest ratio error {s['ratio_error_max']:.0%} (target "
              f"{RATIO_TARGET:.0%}), over {s['runs']} runs")


def save(records: list[dict], cal: Calibration, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "validation.json").write_text(json.dumps(
        {"calibration": cal.model_dump(), "summary": summary(records), "records": records},
        indent=1))
    (out / "validation.md").write_text(validation_table(records) + "\n")
