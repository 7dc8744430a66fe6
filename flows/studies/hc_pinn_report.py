"""The HC-PINN study's report (``flows/hc_pinn_study.py``): the tables printed and saved as
``summary.md``, the figure, and ``results.json`` / ``results.csv``. Pure functions of the runs
and of the statistics drawn from them (:mod:`tasks.hc_pinn.correlations`,
:mod:`tasks.hc_pinn.collapse`), files out."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from collections.abc import Sequence
from enum import Enum
from pathlib import Path

from flows.benchmarks.report import markdown_table
from tasks.hc_pinn.collapse import SpecSummary, collapsed, contrast
from tasks.hc_pinn.correlations import POOLED, Correlation, Measure, Predictor, Verdict
from tasks.hc_pinn.grammar import COMMON, parse_spec
from tasks.hc_pinn.ntk import analyse
from tasks.hc_pinn.problems import get_problem
from tasks.hc_pinn.study import StudyRun

# -- tables ---------------------------------------------------------------------------------------


def _num(x: float, fmt: str = ".2f") -> str:
    return "-" if math.isnan(x) else f"{x:{fmt}}"


def spec_table(summaries: Sequence[SpecSummary]) -> str:
    rows = []
    for s in summaries:
        cond = _num(s.log10_condition, ".1f")
        if s.condition_at_limit:
            cond += f" (at float64 limit {s.condition_at_limit}/{s.runs})"
        runs = f"{s.runs}" + (f" ({s.failed} failed)" if s.failed else "")
        rows.append([s.problem, s.spec, "COMMON" if s.common else "",
                     f"{'COLLAPSE' if s.collapses else 'no'} {s.collapsed}/{s.runs}",
                     _num(s.effective_rank, ".3f"), cond, _num(s.top_share, ".3f"),
                     _num(s.steps, ".0f"), _num(s.reached), _num(s.log10_final_loss),
                     _num(s.l2_error, ".3g"), runs])
    return markdown_table(["problem", "B", "common", "collapse (runs)", "eff. rank",
                           "log10 cond", "top share", "steps", "reached", "log10 loss",
                           "L2 error", "runs"], rows)


def correlation_table(corrs: Sequence[Correlation]) -> str:
    rows = []
    for c in corrs:
        rank, cond = Predictor.EFFECTIVE_RANK, Predictor.LOG10_CONDITION
        stronger = c.stronger()
        strongest = c.strongest()
        rows.append([c.scope, c.measure.value, c.n] + [_num(c.rho[p], "+.2f") for p in Predictor]
                    + [f"{stronger.value if stronger else 'neither'} "
                       f"({_num(abs(c.rho[rank]))} vs {_num(abs(c.rho[cond]))})",
                       strongest.value if strongest else "-"])
    return markdown_table(["scope", "slowness", "runs", "rho eff. rank (expect -)",
                           "rho log10 cond (expect +)", "rho top share (expect +)",
                           "stronger, |rho| rank vs cond", "strongest"], rows)


def collapse_lines(summaries: Sequence[SpecSummary], threshold: float, collapse_loss: float,
                   steps: int) -> list[str]:
    lines = [f"Collapse rule: a run collapses when it misses the threshold {threshold:g} "
             f"and its relative loss is still above {collapse_loss:g} after {steps} "
             f"steps; a boundary function collapses on a problem when more than half of its "
             f"seeds do."]
    bad = [s for s in summaries if s.collapses]
    for problem in dict.fromkeys(s.problem for s in summaries):
        mine = [f"{s.spec}{' (COMMON)' if s.common else ''}" for s in bad if s.problem == problem]
        lines.append(f"Collapsing on {problem}: {', '.join(mine) or 'none'}")
    tried = [c for c in COMMON if any(s.spec == c for s in summaries)]
    common_bad = {c: [s.problem for s in bad if s.spec == c] for c in tried}
    common_bad = {c: ps for c, ps in common_bad.items() if ps}
    lines.append("Collapsing COMMON forms: " + ("; ".join(
        f"{c} (on {', '.join(ps)})" for c, ps in common_bad.items()) or "none")
        + f" (of {', '.join(tried) or 'none tried'})")
    b_max = max((s.boundary_b_max for s in bad if not math.isnan(s.boundary_b_max)), default=None)
    if b_max is not None:
        exact = "exactly (to round-off)" if b_max < 1e-12 else "NOT exactly"
        lines.append(f"The collapsing runs meet the boundary values {exact}: max |B| on the "
                     f"prescribed faces is {b_max:.1e}, so u~ = A there.")
    return lines


def summary(runs: Sequence[StudyRun], summaries: Sequence[SpecSummary],
            corrs: Sequence[Correlation], verdict_: Verdict, seconds: float, *,
            threshold: float, collapse_loss: float, steps: int) -> str:
    """The text printed and saved as ``summary.md``: the run count, the table per problem and
    ``B``, the correlations, the verdict, the collapse lines and every failed run."""
    failed = [r for r in runs if not r.ok]
    sections = [
        f"{len(runs)} runs ({len(failed)} failed) in {seconds:.0f} s",
        spec_table(summaries),
        "Spearman rho of each predictor at initialisation with slowness (steps to threshold: "
        "reached runs by steps, then the others by final loss; log10 final loss; log10 L2 "
        "error). Higher effective rank should mean faster convergence (rho < 0).",
        correlation_table(corrs),
        verdict_.text(),
        *collapse_lines(summaries, threshold, collapse_loss, steps),
        *[f"FAILED {r.problem} {r.spec} seed {r.seed}: {r.failure.value}: {r.reason}"
          for r in failed],
    ]
    return "\n\n".join(sections)


# -- the figure -----------------------------------------------------------------------------------


def _pooled_rho(corrs: Sequence[Correlation], predictor: Predictor) -> float:
    """rho with the final loss over all runs: the pooled scope, or the only problem's."""
    pooled = [c for c in corrs if c.scope == POOLED] or list(corrs)
    return next((c.rho[predictor] for c in pooled if c.measure is Measure.LOSS), math.nan)


def draw(runs: Sequence[StudyRun], corrs: Sequence[Correlation],
         summaries: Sequence[SpecSummary], path: Path, *, threshold: float,
         collapse_loss: float, steps: int, seed: int) -> None:
    """Final loss against effective rank and against log10 condition number (one colour per
    problem, x: collapsed runs), and the normalised spectra of a collapsing and a healthy B
    (the network drawn from ``seed``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 5.2))
    ok = [r for r in runs if r.ok]
    problems = list(dict.fromkeys(r.problem for r in ok))
    for ax, pred in zip(axes[:2], (Predictor.EFFECTIVE_RANK, Predictor.LOG10_CONDITION),
                        strict=True):
        for i, problem in enumerate(problems):
            mine = [r for r in ok if r.problem == problem and math.isfinite(pred.of(r))]
            label = problem  # on the first group drawn
            for collapse in (False, True):
                for limit in (False, True):
                    pts = [r for r in mine if collapsed(r, collapse_loss) is collapse
                           and (r.condition_at_limit and pred is Predictor.LOG10_CONDITION)
                           is limit]
                    if not pts:
                        continue
                    ax.scatter([pred.of(r) for r in pts],
                               [math.log10(max(r.final_loss, 1e-300)) for r in pts],
                               marker="x" if collapse else "o", s=28, linewidths=1.2,
                               edgecolors=None if collapse else f"C{i}",
                               facecolors="none" if limit and not collapse else f"C{i}",
                               label=label)
                    label = None
        ax.axhline(math.log10(threshold), color="green", ls=":", lw=1, label="threshold")
        ax.axhline(math.log10(collapse_loss), color="red", ls=":", lw=1,
                   label="collapse (x: collapsed runs)")
        ax.set_xlabel(pred.value + (" (hollow: at float64's limit, round-off)"
                                    if pred is Predictor.LOG10_CONDITION else ""))
        ax.set_ylabel(f"log10 final relative loss after <= {steps} steps")
        ax.set_title(f"convergence vs {pred.value}: Spearman rho over all runs = "
                     f"{_pooled_rho(corrs, pred):+.2f}", fontsize=10)
        ax.legend(fontsize=7)
    ax = axes[2]
    pair = contrast(summaries)
    if pair:
        for s, colour in zip(pair, ("red", "green"), strict=True):
            spectrum, values = analyse(get_problem(s.problem), parse_spec(s.spec), seed)
            norm = (values / values[0]).tolist()
            ks = [k + 1 for k, v in enumerate(norm) if v > 0]
            ax.semilogy(ks, [v for v in norm if v > 0], color=colour, lw=1.5,
                        label=f"{s.spec}: eff. rank {spectrum.effective_rank:.2f}, "
                              f"{'collapses' if s.collapses else 'reached ' + _num(s.reached)}")
            ax.axvline(spectrum.numerical_rank, color=colour, ls=":", lw=0.8)
        ax.set_title(f"{pair[0].problem}, seed {seed}: normalised spectrum of K "
                     "(dotted: numerical rank)", fontsize=10)
        ax.legend(fontsize=8)
    ax.set_xlabel("k")
    ax.set_ylabel("lambda_k / lambda_1")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- files -----------------------------------------------------------------------------------------


def _plain(x):
    """JSON-safe: enums by value, non-finite floats as null."""
    if isinstance(x, Enum):
        return x.value
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {(k.value if isinstance(k, Enum) else k): _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    if dataclasses.is_dataclass(x):
        return _plain({f.name: getattr(x, f.name) for f in dataclasses.fields(x)})
    return x


def write_results(out: Path, config: dict, runs: Sequence[StudyRun],
                  summaries: Sequence[SpecSummary], corrs: Sequence[Correlation],
                  verdict_: Verdict) -> None:
    """``results.json`` (the config, every run, the summaries, correlations and verdict) and
    ``results.csv`` (every run)."""
    (out / "results.json").write_text(json.dumps(_plain({
        "config": config, "runs": list(runs),
        "summaries": [{**_plain(s), "collapses": s.collapses} for s in summaries],
        "correlations": list(corrs), "verdict": {**_plain(verdict_), "text": verdict_.text()},
    }), indent=1))
    names = [f.name for f in dataclasses.fields(StudyRun)]
    with (out / "results.csv").open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(names)
        for r in runs:
            writer.writerow(_plain([getattr(r, n) for n in names]))
