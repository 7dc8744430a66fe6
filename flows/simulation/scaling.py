"""The four systems as the cluster grows: the config scaled to each size (pools, batch and
admission caps together, so each GPU rolls out the same share of the batch), the table of
step times and speedups, and its picture."""

from __future__ import annotations

import logging
from pathlib import Path

from flows.benchmarks.report import markdown_table
from flows.config import TrainConfig, with_overrides
from flows.simulation.settings import SimSettings
from flows.simulation.systems import SYSTEMS, run_systems, scaled

logger = logging.getLogger(__name__)

DEFAULT_SWEEP = (64, 128, 256, 512, 1024, 2048, 3072, 4096)  # GPUs


def sweep(cfg: TrainConfig, sim: SimSettings, gpus: list[int]) -> list[dict]:
    """The four systems at each cluster size (the config scaled to it)."""
    out = []
    for n in gpus:
        c = with_overrides(cfg, scaled(cfg, n))
        results = run_systems(c, sim)
        out.append({"gpus": n, "results": {k: v.as_dict() for k, v in results.items()}})
        logger.info("%d GPUs: %s", n, {k: round(v.step_s, 1) for k, v in results.items()})
    return out


def sweep_table(points: list[dict]) -> str:
    """Markdown: each size's step time per system, rollarc's speedups and its tasks/s."""
    rows = []
    for pt in points:
        r = pt["results"]
        rows.append([f"{pt['gpus']:,}"] + [f"{r[s]['step_s']:.1f}" for s in SYSTEMS]
                    + [f"{r[s]['step_s'] / r['rollarc']['step_s']:.2f}" for s in SYSTEMS[1:]]
                    + [f"{r['rollarc']['tasks_per_s']:,.0f}"])
    return markdown_table(["GPUs"] + [f"{s} s/step" for s in SYSTEMS]
                          + [f"x {s}" for s in SYSTEMS[1:]] + ["tasks/s"], rows)


def plot_scaling(points: list[dict], path: Path) -> None:
    """Rollarc's speedup over each baseline against GPUs, beside the paper's range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    xs = [p["gpus"] for p in points]
    for base in SYSTEMS[1:]:
        ys = [p["results"][base]["step_s"] / p["results"]["rollarc"]["step_s"] for p in points]
        ax.plot(xs, ys, marker="o", label=f"vs {base}")
    ax.axhspan(1.35, 2.05, color="grey", alpha=0.15, label="arXiv 2512.22560: 1.35-2.05x")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs], rotation=45)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("speedup of rollarc (step time ratio)")
    ax.set_title("RollArc against its baselines at equal hourly cost (simulated)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
