"""A rollout driver's faults: a worker lost, a turn overdue, a member's turn failed.

:class:`RolloutFaults` decides what a fault does; the
:class:`flows.training.rollout.RolloutDriver` carries its answers out on its own records (it
restarts, drops and releases them). What it keeps is the faults' own state: the workers lost,
the cohorts given up on (a worker they needed left, or their turn passed
``rollout.turn_timeout_s``: the watchdog) with the reason their members carry, the streak of
failed turns that stops a run (:class:`RolloutFailing`) and the restarts by their reason. It
reads the driver's cohorts and trajectories and writes none of them.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping

from distributed import Future

from flows.config import TrainConfig
from flows.config.derived import batch_trajectories
from flows.training.episode import RolloutRecord
from flows.training.lifecycle import DropReason, RunFailing
from flows.training.turn_tasks import Cohort
from tasks.cohort import MemberError

logger = logging.getLogger(__name__)


class RolloutFailing(RunFailing):
    """Every turn is failing (an environment that cannot start, ...): the run stops."""


def strands_resume(worker: str, rec: RolloutRecord) -> bool:
    """A member a stage left running lost its turn's worker or its cache with ``worker``."""
    return worker in rec.turn_key_workers()


def strands_waiting(worker: str, rec: RolloutRecord) -> bool:
    """A trajectory waiting for its next turn lost its environment or its cache with
    ``worker`` (one not placed yet has neither)."""
    return rec.handle is not None and worker in (rec.env_worker, rec.kv_worker)


class RolloutFaults:
    """The fault handling of one rollout driver: which cohorts to give up on, what their
    members fail with, and whether a failed member restarts or drops."""

    def __init__(self, cfg: TrainConfig):
        self.max_attempts = cfg.rollout.max_attempts
        # consecutive failed turns, retries included, before the run stops with the last error
        self.max_error_streak = 4 * max(cfg.rollout.max_in_flight, batch_trajectories(cfg))
        self.error_streak = 0
        self.restarts: Counter[str] = Counter()  # trajectories restarted, by the reason
        self.lost_workers: set[str] = set()
        # cohorts given up on (a worker lost, a turn past rollout.turn_timeout_s):
        # env_step key -> (reason, detail), read when the cancelled future comes back
        self._abandoned: dict[str, tuple[DropReason, str]] = {}

    def is_lost(self, worker: str) -> bool:
        return worker in self.lost_workers

    def worker_lost(self, worker: str, cohorts: Mapping[str, Cohort]) -> tuple[str, list[Future]]:
        """``worker`` left the cluster: the cohorts (by the key of their env_step) that needed
        it are abandoned. Returns the detail their members fail with, and their futures, for
        the caller to cancel."""
        detail = f"{DropReason.WORKER_LOST}: {worker}"
        self.lost_workers.add(worker)
        lost = []
        for key, cohort in cohorts.items():
            if worker in cohort.workers and key not in self._abandoned:
                self._abandoned[key] = (DropReason.WORKER_LOST, detail)
                lost.append(cohort.step)
        return detail, lost

    def overdue(self, cohorts: Mapping[str, Cohort], live: Mapping[int, RolloutRecord],
                timeout_s: float | None) -> list[Future]:
        """The cohorts whose turn has not answered within ``timeout_s`` (the watchdog): each
        is abandoned with a warning naming the environment or stage that stopped answering;
        their futures are for the caller to cancel."""
        if not timeout_s:
            return []
        now, late = time.time(), []
        for key, cohort in cohorts.items():
            # a look-ahead turn counts from when it became a turn in flight
            if key in self._abandoned or cohort.ahead or now - cohort.submitted < timeout_s:
                continue
            members = [live[t] for t in cohort.traj_ids if t in live]
            if not members:  # nobody's turn any more (a look-ahead turn given up)
                continue
            env_w = members[0].env_worker
            if cohort.decode is None or cohort.decode.status == "finished":  # None: past it
                where = (f"environment {cohort.env_task} on {env_w} (instances "
                         f"{[r.handle.instance_id for r in members if r.handle][:4]})")
            else:
                where = f"prefill/decode of {cohort.env_task} (env_step-{cohort.suffix})"
            logger.warning("watchdog: %s did not answer within %.0f s", where, timeout_s)
            self._abandoned[key] = (DropReason.TURN_TIMEOUT, f"{DropReason.TURN_TIMEOUT}: "
                                    f"{where} did not answer within {timeout_s:.0f} s")
            late.append(cohort.step)
        return late

    def results(self, fut: Future, results: list | None,
                members: int) -> tuple[list, DropReason]:
        """A cohort's env_step came back with ``results`` (None: the whole cohort failed or
        was lost): each member's result, and the reason a failed member restarts or drops
        for. A cohort given up on fails every member with why, whatever came back."""
        abandoned = self._abandoned.pop(fut.key, None)
        if abandoned is not None:
            reason, detail = abandoned
            return [MemberError(detail)] * members, reason
        if results is None:
            exc = fut.exception() if fut.status == "error" else RuntimeError(
                f"{fut.status}: result lost")
            return [MemberError.of(exc)] * members, DropReason.ROLLOUT_ERROR
        return results, DropReason.ROLLOUT_ERROR

    def stepped(self) -> None:
        """A member's turn went through: the streak of failed turns is broken."""
        self.error_streak = 0

    def failed(self, rec: RolloutRecord, error: str, reason: DropReason, stopping: bool) -> bool:
        """A turn of ``rec`` failed (task error, worker lost, timed out): True to restart it
        from a fresh environment (counted as a restart for ``reason``) while attempts remain
        and the run goes on (an evaluation episode's, even then); False to drop it. Raises
        :class:`RolloutFailing` once too many turns failed in a row."""
        logger.warning("trajectory %s attempt %d failed: %s", rec.traj_id, rec.attempt, error)
        # a lost worker fails many turns at once without anything being wrong with them
        if reason is not DropReason.WORKER_LOST:
            self.error_streak += 1
        if self.error_streak >= self.max_error_streak:
            # every turn failing (an environment that cannot start, ...) would spin the run
            raise RolloutFailing(f"the last {self.error_streak} turns failed, the last with "
                                 f"{error}")
        if rec.attempt + 1 < self.max_attempts and (not stopping or rec.evaluation):
            self.restarts[str(reason)] += 1
            return True
        return False
