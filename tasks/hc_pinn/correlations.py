"""Does the effective rank of the residual kernel rank the study's runs by convergence better
than its condition number does? Spearman's rho of each :class:`Predictor` with each convergence
:class:`Measure`, per problem and pooled over problems (:func:`correlations`), and the rule that
turns them into a verdict (:func:`compare`, :func:`verdict`). Pure functions of
:class:`~tasks.hc_pinn.study.StudyRun` records.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from statistics import fmean
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the job's module imports torch; these statistics need not
    from tasks.hc_pinn.study import StudyRun

POOLED = "pooled"


class Predictor(Enum):
    """A spectral measure at initialisation, and the sign of its correlation with slowness
    that the theory expects: a richer spectrum (higher effective rank) trains faster; a worse
    conditioned or more dominated one (higher condition number, top share) slower."""

    EFFECTIVE_RANK = "effective rank"
    LOG10_CONDITION = "log10 condition number"
    TOP_SHARE = "top share"

    @property
    def expected_sign(self) -> int:
        return -1 if self is Predictor.EFFECTIVE_RANK else 1

    def of(self, run: StudyRun) -> float:
        return {Predictor.EFFECTIVE_RANK: run.effective_rank,
                Predictor.LOG10_CONDITION: run.log10_condition,
                Predictor.TOP_SHARE: run.top_share}[self]


class Measure(Enum):
    """How slowly a run converged; larger is slower or worse."""

    STEPS = "steps to threshold"
    LOSS = "log10 final loss"
    L2 = "log10 L2 error"


def log10_or_inf(x: float) -> float:
    # a diverged run (NaN or inf loss) ranks after every finite one
    return math.log10(x) if math.isfinite(x) and x > 0 else (-math.inf if x == 0 else math.inf)


def lexicographic_ranks(keys: Sequence[tuple]) -> list[float]:
    """Ranks 1..n of ``keys`` in ascending tuple order, ties given their average rank."""
    order = sorted(range(len(keys)), key=lambda i: keys[i])
    ranks = [0.0] * len(keys)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and keys[order[j + 1]] == keys[order[i]]:
            j += 1
        for k in order[i:j + 1]:
            ranks[k] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def convergence(runs: Sequence[StudyRun], measure: Measure) -> list[float]:
    """Each run's slowness by ``measure``. Steps to threshold is a rank: the runs that reached
    the threshold by their steps, then the others by their final loss."""
    if measure is Measure.STEPS:
        return lexicographic_ranks([(0, r.steps, 0.0) if r.reached
                                    else (1, 0, log10_or_inf(r.final_loss)) for r in runs])
    if measure is Measure.LOSS:
        return [log10_or_inf(r.final_loss) for r in runs]
    return [log10_or_inf(r.l2_error) for r in runs]


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rho, NaN where undefined: fewer than 3 pairs, a constant side or a NaN."""
    from scipy.stats import spearmanr

    if len(x) < 3 or len(set(x)) < 2 or len(set(y)) < 2 or any(map(math.isnan, [*x, *y])):
        return math.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(spearmanr(x, y).statistic)


@dataclass(frozen=True)
class Correlation:
    """Spearman's rho of every predictor with one convergence measure, over the runs of one
    problem (``scope``) or of all problems (:data:`POOLED`)."""

    scope: str
    measure: Measure
    n: int
    rho: dict[Predictor, float]

    def stronger(self, a: Predictor = Predictor.EFFECTIVE_RANK,
                 b: Predictor = Predictor.LOG10_CONDITION) -> Predictor | None:
        """The predictor of ``a`` and ``b`` with the larger |rho|; None on a tie or NaN."""
        ra, rb = abs(self.rho[a]), abs(self.rho[b])
        if math.isnan(ra) or math.isnan(rb) or ra == rb:
            return None
        return a if ra > rb else b

    def strongest(self) -> Predictor | None:
        defined = {p: abs(r) for p, r in self.rho.items() if not math.isnan(r)}
        return max(defined, key=defined.__getitem__) if defined else None


def correlations(runs: Iterable[StudyRun]) -> list[Correlation]:
    """Per problem (in order of appearance), then pooled when there are several; failed runs
    left out."""
    ok = [r for r in runs if r.ok]
    scopes = {r.problem: [x for x in ok if x.problem == r.problem] for r in ok}
    if len(scopes) > 1:
        scopes[POOLED] = ok
    out = []
    for scope, mine in scopes.items():
        for measure in Measure:
            y = convergence(mine, measure)
            out.append(Correlation(scope, measure, len(mine),
                                   {p: spearman([p.of(r) for r in mine], y) for p in Predictor}))
    return out


# -- the verdict ---------------------------------------------------------------------------------


class Outcome(Enum):
    SUPPORTED = "supported"
    CONTRADICTED = "contradicted"
    MIXED = "mixed"
    INCONCLUSIVE = "inconclusive"


@dataclass(frozen=True)
class Comparison:
    """Effective rank against the condition number on one measure, over the problems where
    both rhos are defined."""

    measure: Measure
    problems: int
    rank_wins: int              # problems where |rho| of the effective rank is the larger
    condition_wins: int
    mean_abs_rank: float        # mean |rho| over those problems
    mean_abs_condition: float
    mean_rho_rank: float        # signed: negative when higher rank means faster convergence
    pooled_abs_rank: float      # NaN without a pooled scope
    pooled_abs_condition: float
    outcome: Outcome

    def text(self) -> str:
        pooled = "" if math.isnan(self.pooled_abs_rank) else (
            f", pooled {self.pooled_abs_rank:.2f} vs {self.pooled_abs_condition:.2f}")
        sign = "" if self.mean_rho_rank < 0 or math.isnan(self.mean_rho_rank) else \
            " (but a higher effective rank went with slower convergence)"
        return (f"{self.measure.value}: mean |rho| {self.mean_abs_rank:.2f} (effective rank) vs "
                f"{self.mean_abs_condition:.2f} (condition number), effective rank stronger on "
                f"{self.rank_wins}/{self.problems} problems{pooled}{sign}")


def compare(corrs: Sequence[Correlation], measure: Measure) -> Comparison:
    """The effective rank is the better predictor on ``measure`` (SUPPORTED) when its mean
    |rho| over problems is the larger, it is stronger on most problems, and its mean rho has
    the expected (negative) sign; the condition number is (CONTRADICTED) when the same holds
    for it, or when the effective rank wins with the wrong sign; MIXED otherwise."""
    rank, cond = Predictor.EFFECTIVE_RANK, Predictor.LOG10_CONDITION
    mine = [c for c in corrs if c.measure is measure and c.scope != POOLED
            and not math.isnan(c.rho[rank]) and not math.isnan(c.rho[cond])]
    pooled = next((c for c in corrs if c.measure is measure and c.scope == POOLED), None)
    p_rank = abs(pooled.rho[rank]) if pooled else math.nan
    p_cond = abs(pooled.rho[cond]) if pooled else math.nan
    if not mine:
        return Comparison(measure, 0, 0, 0, math.nan, math.nan, math.nan, p_rank, p_cond,
                          Outcome.INCONCLUSIVE)
    rank_wins = sum(c.stronger() is rank for c in mine)
    cond_wins = sum(c.stronger() is cond for c in mine)
    m_rank = fmean(abs(c.rho[rank]) for c in mine)
    m_cond = fmean(abs(c.rho[cond]) for c in mine)
    signed = fmean(c.rho[rank] for c in mine)
    rank_better = m_rank > m_cond and rank_wins > len(mine) / 2
    cond_better = m_cond > m_rank and cond_wins > len(mine) / 2
    if rank_better and signed < 0:
        outcome = Outcome.SUPPORTED
    elif cond_better or rank_better:
        outcome = Outcome.CONTRADICTED
    else:
        outcome = Outcome.MIXED
    return Comparison(measure, len(mine), rank_wins, cond_wins, m_rank, m_cond, signed,
                      p_rank, p_cond, outcome)


@dataclass(frozen=True)
class Verdict:
    """Whether the runs support "the effective rank of the residual kernel predicts
    convergence better than the condition number", on every measure."""

    outcome: Outcome
    comparisons: tuple[Comparison, ...]
    runs: int
    condition_at_limit: int     # runs whose condition number is at float64's limit

    def text(self) -> str:
        claim = "the effective rank predicts convergence better than the condition number"
        head = {Outcome.SUPPORTED: f"the measurements SUPPORT the claim that {claim}",
                Outcome.CONTRADICTED: f"the measurements CONTRADICT the claim that {claim}",
                Outcome.MIXED: f"the measurements are MIXED on the claim that {claim} ("
                               + ", ".join(f"{c.outcome.value} on {c.measure.value}"
                                           for c in self.comparisons) + ")",
                Outcome.INCONCLUSIVE: f"too few runs to test the claim that {claim}"}[self.outcome]
        parts = [f"Verdict: {head}."]
        parts += [f"On {c.text()}." for c in self.comparisons
                  if c.outcome is not Outcome.INCONCLUSIVE]
        if self.condition_at_limit:
            parts.append(f"The condition number was at float64's limit in "
                         f"{self.condition_at_limit}/{self.runs} runs: its order there is "
                         f"round-off.")
        return " ".join(parts)


def verdict(corrs: Sequence[Correlation], runs: Sequence[StudyRun]) -> Verdict:
    """SUPPORTED or CONTRADICTED when :func:`compare` says so on every measure, INCONCLUSIVE
    when it can say nothing on any, MIXED otherwise."""
    comps = tuple(compare(corrs, m) for m in Measure)
    outcomes = {c.outcome for c in comps}
    outcome = outcomes.pop() if len(outcomes) == 1 else Outcome.MIXED
    ok = [r for r in runs if r.ok]
    return Verdict(outcome, comps, len(ok), sum(r.condition_at_limit for r in ok))
