"""Does the residual kernel's spectrum at initialisation predict how an HC-PINN trains?

The job (:func:`run_case`) takes one :class:`StudyCase` (a problem, a boundary function, an
init seed, a training budget) and returns one :class:`StudyRun`: the kernel's spectrum at
initialisation (:func:`tasks.hc_pinn.ntk.analyse`) and how the same network trained
(:func:`tasks.hc_pinn.training.train`). The rest is the evidence drawn from many runs, pure
functions of run records:

- :func:`correlations`: Spearman's rho of each :class:`Predictor` with each convergence
  :class:`Measure`, per problem and pooled over problems;
- :func:`compare` and :func:`verdict`: does the effective rank rank the runs' convergence better
  than the condition number does;
- :func:`summarise` and :func:`collapsed`: which boundary functions collapse the spectrum so far
  that training stagnates (:data:`COLLAPSE_LOSS`).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from statistics import fmean

import torch

from tasks.hc_pinn.boundary import COMMON, BoundarySpec, boundary_function
from tasks.hc_pinn.ntk import analyse
from tasks.hc_pinn.problems import get_problem
from tasks.hc_pinn.training import DEFAULT_LR, DEFAULT_THRESHOLD, train

# A run collapses when it misses the loss threshold and its relative loss is still above this
# at the end of the budget: the network removed less than 90 % of the residual loss of u~ = A.
COLLAPSE_LOSS = 0.1
POOLED = "pooled"


# -- the job --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StudyCase:
    """One job: the kernel at initialisation and a training run, the network drawn from
    ``seed`` for both."""

    problem: str                # a name of tasks.hc_pinn.problems.PROBLEMS
    spec: BoundarySpec
    seed: int
    max_steps: int = 1000
    threshold: float = DEFAULT_THRESHOLD    # relative loss that counts as converged
    lr: float = DEFAULT_LR


class Failure(Enum):
    """Why a job left no measurement."""

    JOB_ERROR = "job error"         # the job raised
    WORKER_LOST = "worker lost"     # the workers running it died (Dask's KilledWorker)
    CLUSTER_LOST = "cluster lost"   # cancelled, or the scheduler went away


@dataclass(frozen=True)
class StudyRun:
    """What one job measured. Measures are NaN when ``failure`` is set (``reason`` says why)."""

    problem: str
    spec: str
    seed: int
    common: bool                # the spec is one of boundary.COMMON
    n_points: int               # collocation points: the kernel is n_points x n_points
    effective_rank: float       # of the kernel at initialisation
    condition_number: float
    log10_condition: float
    condition_at_limit: bool    # lambda_min at float64's round-off floor (ntk.roundoff_floor)
    numerical_rank: int
    top_share: float            # lambda_1 / trace
    steps: int                  # to the threshold, or max_steps when not reached
    max_steps: int
    reached: bool
    final_loss: float           # relative to the loss of u~ = A
    l2_error: float             # relative, against the exact solution
    boundary_b_max: float       # max |B| on the prescribed faces: u~ - A there is B N
    seconds: float
    failure: Failure | None = None
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.failure is None

    @classmethod
    def failed(cls, case: StudyCase, failure: Failure, reason: str) -> StudyRun:
        nan = math.nan
        return cls(problem=case.problem, spec=str(case.spec), seed=case.seed,
                   common=str(case.spec) in COMMON, n_points=0, effective_rank=nan,
                   condition_number=nan, log10_condition=nan, condition_at_limit=False,
                   numerical_rank=0, top_share=nan, steps=case.max_steps,
                   max_steps=case.max_steps, reached=False, final_loss=nan, l2_error=nan,
                   boundary_b_max=nan, seconds=0.0, failure=failure, reason=reason)


def run_case(case: StudyCase) -> StudyRun:
    """The spectrum of the residual kernel at initialisation, then training from that same
    initialisation, on one thread (the cluster runs one job per core)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t0 = time.perf_counter()
        problem = get_problem(case.problem)
        spectrum, _ = analyse(problem, case.spec, case.seed)
        result = train(problem, case.spec, case.seed, max_steps=case.max_steps,
                       threshold=case.threshold, lr=case.lr)
        with torch.no_grad():
            b_max = float(boundary_function(case.spec, problem)(problem.boundary_points())
                          .abs().max())
        return StudyRun(problem=case.problem, spec=str(case.spec), seed=case.seed,
                        common=str(case.spec) in COMMON, n_points=spectrum.n,
                        effective_rank=spectrum.effective_rank,
                        condition_number=spectrum.condition_number,
                        log10_condition=spectrum.log10_condition,
                        condition_at_limit=spectrum.condition_at_limit,
                        numerical_rank=spectrum.numerical_rank, top_share=spectrum.top_share,
                        steps=result.steps, max_steps=case.max_steps, reached=result.reached,
                        final_loss=result.final_loss, l2_error=result.l2_error,
                        boundary_b_max=b_max, seconds=time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)


# -- correlations -----------------------------------------------------------------------------------


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


def _log10_or_inf(x: float) -> float:
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
                                    else (1, 0, _log10_or_inf(r.final_loss)) for r in runs])
    if measure is Measure.LOSS:
        return [_log10_or_inf(r.final_loss) for r in runs]
    return [_log10_or_inf(r.l2_error) for r in runs]


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


# -- collapse ------------------------------------------------------------------------------------


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
            log10_final_loss=_mean([_log10_or_inf(r.final_loss) for r in ok]),
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

