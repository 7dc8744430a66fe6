"""Which boundary functions collapse the residual kernel's spectrum so far that training
stagnates: the collapse rule for one run (:func:`collapsed`), a boundary function's runs on one
problem over their seeds (:func:`summarise`), and a collapsing and a healthy one to picture
side by side (:func:`contrast`). Pure functions of :class:`~tasks.hc_pinn.study.StudyRun`
records.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from statistics import fmean
from typing import TYPE_CHECKING

from tasks.hc_pinn.correlations import log10_or_inf
from tasks.hc_pinn.grammar import COMMON

if TYPE_CHECKING:  # the job's module imports torch; these statistics need not
    from tasks.hc_pinn.study import StudyRun

# A run collapses when it misses the loss threshold and its relative loss is still above this
# at the end of the budget: the network removed less than 90 % of the residual loss of u~ = A.
COLLAPSE_LOSS = 0.1


def collapsed(run: StudyRun, collapse_loss: float = COLLAPSE_LOSS) -> bool:
    """The run stagnated: it missed the threshold and its final relative loss is still above
    ``collapse_loss`` (a diverged run, its loss not finite, is not counted as stagnating)."""
    return run.ok and not run.reached and math.isfinite(run.final_loss) \
        and run.final_loss > collapse_loss


def _mean(xs: Sequence[float]) -> float:
    return fmean(xs) if xs else math.nan


@dataclass(frozen=True)
class SpecSummary:
    """One boundary function on one problem, over its seeds."""

    problem: str
    spec: str
    common: bool
    runs: int                   # finished runs (failed ones not counted)
    failed: int
    effective_rank: float       # means over the finished runs
    log10_condition: float
    condition_at_limit: int     # runs at float64's limit
    top_share: float
    steps: float
    reached: float              # fraction
    log10_final_loss: float
    l2_error: float
    boundary_b_max: float       # the largest over the runs
    collapsed: int              # runs that collapsed (:func:`collapsed`)

    @property
    def collapses(self) -> bool:
        """Most of its runs collapsed."""
        return self.collapsed > self.runs / 2


def summarise(runs: Iterable[StudyRun], collapse_loss: float = COLLAPSE_LOSS
              ) -> list[SpecSummary]:
    """One :class:`SpecSummary` per (problem, spec), in order of appearance."""
    groups: dict[tuple[str, str], list[StudyRun]] = {}
    for r in runs:
        groups.setdefault((r.problem, r.spec), []).append(r)
    out = []
    for (problem, spec), mine in groups.items():
        ok = [r for r in mine if r.ok]
        out.append(SpecSummary(
            problem=problem, spec=spec, common=spec in COMMON, runs=len(ok),
            failed=len(mine) - len(ok),
            effective_rank=_mean([r.effective_rank for r in ok]),
            log10_condition=_mean([r.log10_condition for r in ok]),
            condition_at_limit=sum(r.condition_at_limit for r in ok),
            top_share=_mean([r.top_share for r in ok]), steps=_mean([r.steps for r in ok]),
            reached=_mean([float(r.reached) for r in ok]),
            log10_final_loss=_mean([log10_or_inf(r.final_loss) for r in ok]),
            l2_error=_mean([r.l2_error for r in ok]),
            boundary_b_max=max((r.boundary_b_max for r in ok), default=math.nan),
            collapsed=sum(collapsed(r, collapse_loss) for r in ok)))
    return out


def contrast(summaries: Sequence[SpecSummary]) -> tuple[SpecSummary, SpecSummary] | None:
    """A (collapsing, healthy) pair of boundary functions on one problem, for a picture of
    their spectra: on the first problem that has both, the collapsing one that stagnated
    worst and the healthy one (most runs reached the threshold) that was fastest. Without
    such a pair, the worst and the best of the problem with the widest gap between them."""
    def worst(xs):
        return max(xs, key=lambda s: (-s.reached, s.log10_final_loss))

    def best(xs):
        return min(xs, key=lambda s: (-s.reached, s.steps, s.log10_final_loss))

    by_problem: dict[str, list[SpecSummary]] = {}
    for s in summaries:
        if s.runs:
            by_problem.setdefault(s.problem, []).append(s)
    for mine in by_problem.values():
        bad = [s for s in mine if s.collapses]
        good = [s for s in mine if s.reached > 0.5]
        if bad and good:
            return worst(bad), best(good)
    pairs = [(worst(m), best(m)) for m in by_problem.values() if len(m) > 1]
    if not pairs:
        return None
    return max(pairs, key=lambda p: p[0].log10_final_loss - p[1].log10_final_loss)
