"""The four systems as the cluster grows (the config scaled to each size: pools, batch and
admission caps together, so each GPU rolls out the same share of the batch), and as a price or
a device constant moves (the decode GPU's price against the compute GPU's, the engines'
per-step floor): the tables of step times and speedups, and the picture of the first."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from flows.benchmarks.report import markdown_table
from flows.config import TrainConfig, with_overrides
from flows.config.derived import device_model
from flows.simulation.settings import SimSettings
from flows.simulation.systems import SYSTEMS, run_systems, scaled
from resources.catalog import get_profile
from resources.device_model import DeviceModel
from resources.pools import Role

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


# -- how the ratios move with a price or a device constant ---------------------------------------

# the bandwidth GPU's price over the compute GPU's: the catalog's H20 over H800 is 0.95 / 2.20
# = 0.43; RollArc's gain over a monolithic H800 cluster comes from decoding on the cheaper
# bandwidth, so the ratio moves with it
PRICE_RATIOS = (0.25, 0.35, 0.43, 0.6, 0.8, 1.0)
# the engines' per-step floor (resources.catalog: the host's step plus each layer's kernels) as a
# multiple of the catalog's: 0 is the roofline alone, 1 today's, 4 a slow host or a large MoE's
# expert dispatch; a floor makes small batches and lone stragglers dear, which the synchronous
# baselines' tails feel most
FLOOR_SCALES = (0.0, 0.5, 1.0, 2.0, 4.0)
FLOOR_FIELDS = ("step_floor_s", "layer_floor_s", "moe_layer_floor_s")
SENSITIVITY = {"price_ratio": PRICE_RATIOS, "floor_scale": FLOOR_SCALES}


def price_ratio_overrides(cfg: TrainConfig, ratio: float) -> list[str]:
    """The decode (bandwidth) pools' profile priced at ``ratio`` x the compute profile's (the
    monolithic one), its pools resized to keep their hourly cost: the budget stays the same,
    and it buys more or fewer decode GPUs."""
    compute = get_profile(cfg.cluster.monolithic_profile, cfg.affinity.profiles)
    inference = [p for p in cfg.cluster.pools if p.role is Role.INFERENCE]
    cheap = min((get_profile(p.profile, cfg.affinity.profiles) for p in inference),
                key=lambda h: h.peak_flops)
    price = ratio * compute.price_per_hour
    profile = cheap.model_copy(update={"price_per_hour": price}).model_dump()
    out = [f"affinity.profiles.{cheap.name}={json.dumps(profile)}"]
    for i, p in enumerate(cfg.cluster.pools):
        if p.profile == cheap.name and p.role is Role.INFERENCE:
            workers = max(1, round(p.workers * cheap.price_per_hour / price))
            out.append(f"cluster.pools.{i}.workers={workers}")
    return out


def floor_scale_overrides(cfg: TrainConfig, scale: float) -> list[str]:
    """Every GPU profile of the config with its per-step floors at ``scale`` x the catalog's."""
    names = {p.profile for p in cfg.cluster.pools} | {cfg.cluster.monolithic_profile}
    out = []
    for name in sorted(names):
        hw = get_profile(name, cfg.affinity.profiles)
        if hw.accelerator:
            profile = hw.model_copy(update={f: getattr(hw, f) * scale for f in FLOOR_FIELDS})
            out.append(f"affinity.profiles.{name}={json.dumps(profile.model_dump())}")
    return out


def sensitivity(cfg: TrainConfig, sim: SimSettings, kind: str,
                values: list[float] | None = None) -> list[dict]:
    """The four systems (monolithic ones at the same budget) at each value of ``kind``: the
    price ratio of the decode GPU to the compute GPU, or the engines' per-step floor as a
    multiple of the catalog's."""
    make = {"price_ratio": price_ratio_overrides, "floor_scale": floor_scale_overrides}[kind]
    out = []
    for v in values or SENSITIVITY[kind]:
        c = with_overrides(cfg, make(cfg, v))
        results = run_systems(c, sim)
        out.append({kind: v, **decode_engine(c),
                    "results": {k: r.as_dict() for k, r in results.items()}})
        logger.info("%s %g: %s", kind, v, {k: round(r.steady_step_s, 1)
                                            for k, r in results.items()})
    return out


def decode_engine(cfg: TrainConfig) -> dict:
    """The decode pool's price over the compute profile's, and its engines' per-step floor."""
    inference = [p for p in cfg.cluster.pools if p.role is Role.INFERENCE]
    pool = min(inference, key=lambda p: get_profile(p.profile, cfg.affinity.profiles).peak_flops)
    hw = get_profile(pool.profile, cfg.affinity.profiles)
    compute = get_profile(cfg.cluster.monolithic_profile, cfg.affinity.profiles)
    return {"decode_price_ratio": hw.price_per_hour / compute.price_per_hour,
            "decode_floor_ms": 1e3 * DeviceModel(device_model(cfg), hw, pool.gpus).step_floor}


def sensitivity_table(points: list[dict], kind: str) -> str:
    """Markdown: each value's decode price ratio and floor, cost, step time per system and
    rollarc's ratios."""
    rows = []
    for pt in points:
        r = pt["results"]
        ref = r["rollarc"]["steady_step_s"]
        rows.append([f"{pt[kind]:g}", f"{pt['decode_price_ratio']:.2f}",
                     f"{pt['decode_floor_ms']:.2f}",
                     f"${r['rollarc']['cost_per_hour']:,.0f} / "
                     f"${r[SYSTEMS[-1]]['cost_per_hour']:,.0f}"]
                    + [f"{r[s]['steady_step_s']:.1f}" for s in SYSTEMS]
                    + [f"{r[s]['steady_step_s'] / ref:.2f}" for s in SYSTEMS[1:]])
    return markdown_table([kind, "decode $ / compute $", "decode step floor ms",
                           "$/h rollarc / monolithic"] + [f"{s} s/step" for s in SYSTEMS]
                          + [f"x {s}" for s in SYSTEMS[1:]], rows)
