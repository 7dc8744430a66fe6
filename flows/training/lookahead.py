"""A rollout driver's look-ahead turns (``rollout.lookahead``).

While a trajectory's turn is in flight, its next turn goes to the same workers as a *look-ahead
cohort* (:meth:`flows.training.turn_tasks.TurnTasks.cohort` with ``ahead``), reading the turn's
observation and cache as futures: Dask starts it as soon as they exist, and the driver's round
trip between two turns is off the trajectory's path. When the turn comes back and the episode
goes on, the look-ahead turn becomes the trajectory's turn in flight (it is *promoted*) and the
one after it goes ahead with the next flush; when the episode ends, or the turn failed or was
left running, the look-ahead turn is given up (*voided*): whatever it returns is ignored.

:class:`LookAheads` keeps what that takes beside the driver's records, and decides which
trajectories go ahead: those promoted since the last flush and those whose turn was submitted
now, each once (twice, its environment would be stepped twice), while training goes on, for real
lengths only (an emulated env task's turn shapes are drawn per turn) and none of their workers
lost. It keeps the look-ahead answers taken before the turn before them (the order of a batch's
events is not promised), and the environments whose close waits for a look-ahead turn that may
still step them. The :class:`flows.training.rollout.RolloutDriver` submits, promotes and
closes.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import replace

from flows.training.episode import RolloutRecord
from flows.training.lifecycle import DropReason
from flows.training.rollout_faults import RolloutFaults
from flows.training.turn_tasks import Cohort, CohortKey


class LookAheads:
    """The look-ahead turns of one rollout driver: who goes ahead next, early answers, and
    closes deferred until a look-ahead turn came back."""

    def __init__(self, enabled: bool, live: Mapping[int, RolloutRecord],
                 cohorts: Mapping[str, Cohort], faults: RolloutFaults):
        """``live`` and ``cohorts``: the driver's trajectories and cohorts in flight (by the
        key of their env_step); this reads them and never adds or removes one."""
        self.enabled = enabled
        self.live, self.cohorts, self.faults = live, cohorts, faults
        # promoted since the last flush: the turn after theirs goes ahead with it
        self._promoted: dict[int, RolloutRecord] = {}
        # look-ahead answers that came back before the turn before them: by trajectory
        self._early: dict[int, tuple[object, DropReason]] = {}
        # ended trajectories whose environment closes once their look-ahead turn came back (or
        # was given up): by that turn's env_step key
        self._closes: dict[str, list[RolloutRecord]] = {}

    def chosen(self, submitted: Iterable[RolloutRecord], stopping: bool
               ) -> dict[CohortKey, list[RolloutRecord]]:
        """The trajectories whose next turn goes ahead now, by the workers of their turn in
        flight: those promoted since the last call and those whose turn was ``submitted``,
        each once."""
        recs, self._promoted = self._promoted, {}
        recs.update((rec.traj_id, rec) for rec in submitted)
        groups: dict[CohortKey, list[RolloutRecord]] = {}
        for rec in recs.values():
            if self._suits(rec, stopping):
                groups.setdefault(replace(rec.turn_key, fresh=False), []).append(rec)
        return groups

    def _suits(self, rec: RolloutRecord, stopping: bool) -> bool:
        """Its turn is in flight with none ahead yet, its lengths are real ones, training goes
        on (an evaluation episode runs to its end), and none of its workers left."""
        return (self.enabled and rec.ahead is None and rec.env_task.shape is None
                and self.live.get(rec.traj_id) is rec and rec.turn_step is not None
                and rec.turn_step[0].key in self.cohorts
                and (rec.evaluation or not stopping)
                and not any(self.faults.is_lost(w) for w in rec.turn_key_workers()))

    def submitted(self, cohorts: list[Cohort]) -> None:
        """Each member's look-ahead turn is its place in one of ``cohorts``."""
        for cohort in cohorts:
            for i, tid in enumerate(cohort.traj_ids):
                self.live[tid].ahead = (cohort, i)

    def answered(self, cohort: Cohort, tid: int, result: object, reason: DropReason) -> None:
        """``cohort`` came back and is not trajectory ``tid``'s turn in flight: if it is its
        look-ahead turn, the turn before is still to come back and the answer waits for it."""
        rec = self.live.get(tid)
        if rec is not None and rec.ahead is not None and rec.ahead[0] is cohort:
            self._early[tid] = (result, reason)

    def promote(self, rec: RolloutRecord, now: float
                ) -> tuple[Cohort, tuple[object, DropReason] | None]:
        """``rec``'s turn came back and its episode goes on: its look-ahead turn becomes its
        turn in flight (the record now reads it; the one after goes ahead with the next flush).
        Returns that cohort, and its answer if it came back first (for the driver to take)."""
        cohort, i = rec.ahead
        rec.ahead = None
        if cohort.ahead:  # its first member to go on: from now it is a turn in flight
            cohort.ahead, cohort.submitted = False, now
        key = cohort.key
        rec.turn_key, rec.turn_past, rec.turn_obs = key, rec.last_decode, rec.turn_step
        rec.turn_submitted, rec.last_shape = now, None
        rec.turn_step, rec.last_decode = (cohort.step, i), (cohort.decode, i)
        rec.prefill_worker, rec.decode_worker = key.prefill_worker, key.decode_worker
        rec.kv_worker = key.decode_worker
        self._promoted[rec.traj_id] = rec
        return cohort, self._early.pop(rec.traj_id, None)

    def void(self, rec: RolloutRecord) -> None:
        """Give up ``rec``'s look-ahead turn: its results, whenever they come, are ignored."""
        rec.ahead = None
        self._early.pop(rec.traj_id, None)

    # -- environment closes -------------------------------------------------------------------
    def close_after(self, rec: RolloutRecord) -> bool:
        """True when ``rec``'s environment must close after its look-ahead turn, which may
        still step it: kept until that turn comes back (as the record is now: a restart
        reuses it)."""
        ahead = rec.ahead[0].step.key if rec.ahead is not None else None
        if ahead not in self.cohorts:
            return False
        self._closes.setdefault(ahead, []).append(copy.copy(rec))
        return True

    def closes_due(self, key: str) -> list[RolloutRecord]:
        """The trajectories whose environment closes now that the cohort of ``key`` came
        back."""
        return self._closes.pop(key, [])

    def holds(self, worker: str) -> bool:
        """A deferred close is for an environment on ``worker``."""
        return any(r.env_worker == worker for rs in self._closes.values() for r in rs)

    def clear(self) -> list[RolloutRecord]:
        """An aborted run: nothing goes ahead any more; the trajectories whose close was
        deferred, to close now."""
        self._promoted, self._early = {}, {}
        waiting, self._closes = self._closes, {}
        return [rec for recs in waiting.values() for rec in recs]
