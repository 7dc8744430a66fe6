"""The HC-PINN spectral study's job: does the residual kernel's spectrum at initialisation
predict how an HC-PINN trains?

The job (:func:`run_case`) takes one :class:`StudyCase` (a problem, a boundary function, an
init seed, a training budget) and returns one :class:`StudyRun`: the kernel's spectrum at
initialisation (:func:`tasks.hc_pinn.ntk.analyse`) and how the same network trained
(:func:`tasks.hc_pinn.training.train`). The evidence drawn from many runs, pure functions of
run records, is in :mod:`tasks.hc_pinn.correlations` (Spearman's rho of each predictor with each
convergence measure, and the verdict) and :mod:`tasks.hc_pinn.collapse` (which boundary
functions collapse the spectrum so far that training stagnates).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from enum import Enum

import torch

from tasks.hc_pinn.boundary import COMMON, BoundarySpec, boundary_function
from tasks.hc_pinn.ntk import analyse
from tasks.hc_pinn.problems import get_problem
from tasks.hc_pinn.training import DEFAULT_LR, DEFAULT_THRESHOLD, train


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
