"""The bench's tables over repeated runs: each figure's median with its spread over repeats,
each system's $/h against the reference's, and paired ratios with their verdicts
(:mod:`flows.benchmarks.repeats`). Pure: run figures (:func:`flows.benchmarks.report.run_figures`)
in, dicts and Markdown out."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from statistics import median
from typing import Any

from flows.benchmarks.costs import COST_TOLERANCE, deviation
from flows.benchmarks.repeats import Ratio, Spread, ratio
from flows.benchmarks.report import markdown_table

# figures reported as median and spread over repeats
SPREAD_FIGURES = ("step_s_median", "trajectories_per_s", "trained_tokens_per_s",
                  "trained_tokens_per_usd", "cost_per_hour", "bound_s_per_step", "x_bound",
                  "generated_tokens_per_s", "wall_s")
# paired ratios against the reference: figure, lower is better
RATIOS: dict[str, tuple[Callable[[dict], float], bool]] = {
    "s/step": (lambda r: r["step_s_median"], True),
    "trained tok/s": (lambda r: r.get("trained_tokens_per_s") or 0.0, False),
    "trained tok/$": (lambda r: r.get("trained_tokens_per_usd") or 0.0, False),
}


def spread_of(runs: list[dict], key: str) -> Spread:
    return Spread.of([r[key] for r in runs if r.get(key) is not None])


def merge_repeats(runs: list[dict]) -> dict:
    """One system's repeats: the figures of the repeat with the median wall time, each figure
    of :data:`SPREAD_FIGURES` as its median over repeats (``spread`` holds median, low and
    high), and the drops by reason as medians."""
    ordered = sorted(runs, key=lambda r: r["wall_s"])
    out = dict(ordered[len(ordered) // 2])
    out["repeats"] = len(runs)
    out["spread"] = {k: asdict(spread_of(runs, k)) for k in SPREAD_FIGURES}
    for k in SPREAD_FIGURES:
        if any(r.get(k) is not None for r in runs):
            out[k] = out["spread"][k]["median"]
    reasons = sorted({k for r in runs for k in r["dropped"]})
    out["dropped"] = {k: median(r["dropped"].get(k, 0) for r in runs) for k in reasons}
    return out


def compare(runs: list[dict], reference: list[dict]) -> dict[str, Ratio]:
    """Paired ratios of a system's repeats against the reference's (above 1: the reference
    did better)."""
    return {name: ratio(runs, reference, fig, lower) for name, (fig, lower) in RATIOS.items()}


def _count(x: float) -> str:
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}"


def _spread(r: dict, key: str, digits: int = 2) -> str:
    s = r.get("spread", {}).get(key)
    if not s or s["median"] != s["median"]:  # absent or NaN
        return "-"
    return Spread(**s).text(digits)


def cost_text(r: dict, reference: dict) -> str:
    """``"$18.4 (+2.1%)"``: the median measured $/h and its deviation from the reference's,
    flagged when beyond the tolerance."""
    mine, ref = r.get("cost_per_hour"), reference.get("cost_per_hour")
    if mine is None:
        return "-"
    if ref is None or r is reference:
        return f"${mine:.1f}"
    d = deviation(mine, ref)
    flag = " !" if abs(d) > COST_TOLERANCE else ""
    return f"${mine:.1f} ({d:+.1%}){flag}"


def figures_table(results: dict[str, dict], reference: str) -> str:
    """Per system: hardware and $/h, then the medians (spread over repeats) of s/step, trained
    trajectories and tokens per second, trained tokens per dollar, the bound and x bound, and
    the median drops by reason."""
    ref = results[reference]
    header = ["system", "GPUs (provisioned $/h)", "$/h measured (vs " + reference + ")",
              "s/step", "trained traj/s", "trained tok/s", "trained tok/$", "dropped",
              "bound s/step", "x bound"]
    rows = []
    for name, r in results.items():
        rows.append([name, r.get("hardware", "-"), cost_text(r, ref), _spread(r, "step_s_median", 1),
                     _spread(r, "trajectories_per_s"), _spread(r, "trained_tokens_per_s", 0),
                     _spread(r, "trained_tokens_per_usd", 0),
                     ", ".join(f"{k} {_count(v)}" for k, v in r["dropped"].items()) or "0",
                     _spread(r, "bound_s_per_step", 1), _spread(r, "x_bound")])
    return markdown_table(header, rows)


def ratios_table(results: dict[str, dict], ratios: dict[str, dict[str, Ratio]],
                 reference: str) -> str:
    """Per system: paired ratios against ``reference`` (median [min, max] over repeats and the
    verdict), and what the median repeat measured of pools, trainer, staleness, success and
    orchestration."""
    header = ["system", *[f"x vs {reference}, {k}" for k in RATIOS], "busy per pool",
              "trainer busy", "staleness mean/max", "success", "orchestration"]
    rows = []
    for name, r in results.items():
        rs = ratios.get(name, {})
        ov = r.get("overhead", {})
        rows.append([
            name, *[rs[k].text() if k in rs else "1" for k in RATIOS],
            ", ".join(f"{k} {v:.0%}" for k, v in r["busy_fraction"].items()),
            f"{r['trainer_busy_fraction']:.0%}",
            f"{r['staleness_mean']:.2f}/{r['staleness_max']}",
            ", ".join(f"{k} {v:.2f}" for k, v in r["success"].items() if v is not None),
            f"{ov['orchestration_fraction']:.1%}" if ov else "-"])
    return markdown_table(header, rows)


def system_tables(results: dict[str, dict], ratios: dict[str, dict[str, Ratio]],
                  reference: str) -> str:
    """:func:`figures_table` and :func:`ratios_table`, one after the other."""
    return figures_table(results, reference) + "\n\n" + ratios_table(results, ratios, reference)


def ratio_dicts(ratios: dict[str, dict[str, Ratio]]) -> dict[str, dict[str, Any]]:
    """JSON-able form of ratios by system and figure."""
    return {name: {k: v.as_dict() for k, v in rs.items()} for name, rs in ratios.items()}
