"""The HC-PINN study's sweep (``flows/hc_pinn_study.py``): one job per (problem, boundary
function, seed), :func:`tasks.hc_pinn.study.run_case`, run in this process or on a Dask cluster
(a local one, or a running ``--scheduler``), one ``CPU_ENV`` slot each; a job that raises, a
lost worker and a lost cluster are recorded as failed runs with their reason, never dropped."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError

from resources.pools import Tag, tags_of
from tasks.hc_pinn.study import Failure, StudyCase, StudyRun, run_case

logger = logging.getLogger(__name__)

Job = Callable[[StudyCase], StudyRun]
CONNECT_TIMEOUT_S = 30


def job_key(case: StudyCase) -> str:
    """The Dask key: the stage, the case, and a token of its budget (so runs of another budget
    on a shared scheduler never share a result; equal cases may: the job is deterministic)."""
    from dask.base import tokenize

    spec = f"{case.spec.family}{case.spec.param}"
    return f"hc-pinn-{case.problem}-{spec}-{case.seed}-{tokenize(case)[:8]}"


def _failure(exc: BaseException) -> Failure:
    from distributed import KilledWorker

    if isinstance(exc, KilledWorker):
        return Failure.WORKER_LOST
    if isinstance(exc, CancelledError):  # the scheduler forgot it, or the client lost it
        return Failure.CLUSTER_LOST
    return Failure.JOB_ERROR


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _progress(done: int, total: int, run: StudyRun) -> None:
    if not run.ok:
        logger.warning("%s %s seed %d failed (%s): %s", run.problem, run.spec, run.seed,
                       run.failure.value, run.reason)
    if done == total or done % max(1, total // 10) == 0:
        logger.info("%d/%d runs done", done, total)


def run_in_process(cases: Sequence[StudyCase], job: Job = run_case) -> list[StudyRun]:
    """The jobs one after another in this process; a job that raises is recorded as failed."""
    out = []
    for case in cases:
        try:
            run = job(case)
        except Exception as exc:
            run = StudyRun.failed(case, Failure.JOB_ERROR, _reason(exc))
        out.append(run)
        _progress(len(out), len(cases), run)
    return out


def run_on_dask(client, cases: Sequence[StudyCase], job: Job = run_case) -> list[StudyRun]:
    """The jobs on ``client``'s cluster, in the order of ``cases``; each failure (the job
    raised, its workers died, the cluster went away) recorded with its reason."""
    from distributed import as_completed

    # CPU work of the environment kind: one CPU_ENV slot each, as on a RollArc cluster's env
    # workers (the local cluster below advertises one slot per single-threaded worker)
    futures = client.map(job, cases, key=[job_key(c) for c in cases],
                         resources={Tag.CPU_ENV.value: 1})
    case_of = {f.key: c for f, c in zip(futures, cases, strict=True)}
    done: dict[StudyCase, StudyRun] = {}
    try:
        for fut in as_completed(futures):
            case = case_of[fut.key]
            try:
                run = fut.result()
            except Exception as exc:
                run = StudyRun.failed(case, _failure(exc), _reason(exc))
            done[case] = run
            _progress(len(done), len(cases), run)
    except Exception as exc:  # the client lost its scheduler: what is left is lost with it
        logger.error("lost the cluster with %d runs to go: %s", len(cases) - len(done),
                     _reason(exc))
        for case in cases:
            done.setdefault(case, StudyRun.failed(case, Failure.CLUSTER_LOST, _reason(exc)))
    return [done[c] for c in cases]


class SchedulerUnusable(RuntimeError):
    """``--scheduler`` names no scheduler this process can connect to, or one without a
    worker for the study's jobs."""


def run_jobs(cases: Sequence[StudyCase], workers: int, scheduler: str | None) -> list[StudyRun]:
    """On ``scheduler``'s cluster, else on a local one of ``workers`` processes, else (0
    workers) in this process."""
    if scheduler is None and workers == 0:
        return run_in_process(cases)
    from distributed import Client, LocalCluster

    # distributed sets its own logger to INFO on import: the local scheduler's and nannies'
    # chatter would bury the study's progress
    logging.getLogger("distributed").setLevel(logging.WARNING)
    if scheduler:
        try:
            client = Client(scheduler, timeout=CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError, ValueError) as exc:
            raise SchedulerUnusable(f"cannot connect to {scheduler!r}: {_reason(exc)}") \
                from None
        with client:
            workers = client.scheduler_info()["workers"].values()
            if not any(tags_of(w.get("resources")).get(Tag.CPU_ENV.value) for w in workers):
                raise SchedulerUnusable(
                    f"{scheduler!r} has no worker with the {Tag.CPU_ENV.value} resource, which "
                    f"the study's jobs ask for (dask worker ... --resources "
                    f"{Tag.CPU_ENV.value}=N)")
            return run_on_dask(client, cases)
    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                      dashboard_address=":0", resources={Tag.CPU_ENV.value: 1}) as cluster, \
            Client(cluster) as client:
        logger.info("local cluster: %d workers, dashboard %s", workers, client.dashboard_link)
        return run_on_dask(client, cases)
