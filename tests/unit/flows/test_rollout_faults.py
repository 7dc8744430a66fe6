"""RolloutFaults' decisions (flows/training/rollout_faults.py) on real records and config, no
cluster: restart or drop, the failed-turn streak that stops a run, the cohorts given up on when a
worker leaves or a turn is overdue, and what their members fail with."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import pytest
from distributed import Future

from flows.config import TrainConfig, load_config
from flows.training.episode import RolloutRecord
from flows.training.lifecycle import DropReason, RunFailing
from flows.training.rollout_faults import RolloutFailing, RolloutFaults
from flows.training.turn_tasks import Cohort
from tasks.cohort import MemberError
from tasks.records import EnvHandle

# trainer.groups_per_step=1 over groups of 8: 8 trajectories a batch, as many as max_in_flight
SMALL = ["rollout.max_in_flight=8", "trainer.groups_per_step=1"]


def _cfg(*overrides: str) -> TrainConfig:
    return load_config(overrides=[*SMALL, *overrides])


def _rec(cfg: TrainConfig, traj_id: int = 0, attempt: int = 0, eval_round: int | None = None,
         env_worker: str | None = None) -> RolloutRecord:
    rec = RolloutRecord(traj_id, f"g{traj_id}", cfg.env_tasks[0], seed=traj_id, attempt=attempt,
                        eval_round=eval_round, env_worker=env_worker)
    if env_worker is not None:
        rec.handle = EnvHandle(env_worker, f"inst-{traj_id}")
    return rec


def _cohort(name: str, traj_ids: list[int], workers: set[str], submitted: float | None = None,
            decode: object = None) -> Cohort:
    # unbound futures (no client): the class only reads their keys and hands them back
    return Cohort(traj_ids=traj_ids, suffix=name, submitted=time.time() if submitted is None
                  else submitted, step=Future(f"env_step-{name}"), decode=decode,
                  workers=frozenset(workers), env_task="frozenlake")


@dataclass
class _Settled:
    """A future that came back: its key, status and error (what ``results`` reads of it)."""

    key: str
    status: str
    error: BaseException | None = None

    def exception(self) -> BaseException | None:
        return self.error


# -- restart or drop ------------------------------------------------------------------------


def test_a_failed_turn_restarts_while_attempts_remain_then_drops():
    cfg = _cfg("rollout.max_attempts=3")
    faults = RolloutFaults(cfg)
    assert faults.failed(_rec(cfg, attempt=0), "boom", DropReason.ROLLOUT_ERROR, stopping=False)
    assert faults.failed(_rec(cfg, attempt=1), "boom", DropReason.ROLLOUT_ERROR, stopping=False)
    assert not faults.failed(_rec(cfg, attempt=2), "boom", DropReason.ROLLOUT_ERROR,
                             stopping=False)
    assert faults.restarts == {"rollout_error": 2}  # the drop is not a restart


def test_one_attempt_never_restarts():
    cfg = _cfg("rollout.max_attempts=1")
    faults = RolloutFaults(cfg)
    assert not faults.failed(_rec(cfg), "boom", DropReason.ROLLOUT_ERROR, stopping=False)
    assert not faults.restarts


def test_restarts_are_counted_by_their_reason():
    cfg = _cfg("rollout.max_attempts=2")
    faults = RolloutFaults(cfg)
    for reason in (DropReason.WORKER_LOST, DropReason.TURN_TIMEOUT, DropReason.WORKER_LOST):
        assert faults.failed(_rec(cfg), "gone", reason, stopping=False)
    assert faults.restarts == {"worker_lost": 2, "turn_timeout": 1}


def test_a_stopping_run_drops_a_training_trajectory_with_attempts_left():
    cfg = _cfg("rollout.max_attempts=3")
    faults = RolloutFaults(cfg)
    assert not faults.failed(_rec(cfg), "boom", DropReason.ROLLOUT_ERROR, stopping=True)
    assert not faults.restarts


def test_a_stopping_run_still_restarts_an_evaluation_episode_with_attempts_left():
    cfg = _cfg("rollout.max_attempts=2")
    faults = RolloutFaults(cfg)
    assert faults.failed(_rec(cfg, eval_round=0), "boom", DropReason.ROLLOUT_ERROR,
                         stopping=True)
    assert not faults.failed(_rec(cfg, attempt=1, eval_round=0), "boom",
                             DropReason.ROLLOUT_ERROR, stopping=True)
    assert faults.restarts == {"rollout_error": 1}


# -- the streak of failed turns --------------------------------------------------------------


def _fail(faults: RolloutFaults, cfg: TrainConfig, n: int, reason=DropReason.ROLLOUT_ERROR,
          error: str = "EnvError: cannot start") -> None:
    for i in range(n):
        faults.failed(_rec(cfg, traj_id=i), error, reason, stopping=False)


@pytest.mark.parametrize("overrides, limit", [
    ([], 4 * 8),  # max_in_flight and a batch both 8
    (["trainer.groups_per_step=4"], 4 * 32),  # a batch of 32 outweighs max_in_flight
    (["rollout.max_in_flight=24"], 4 * 24),  # max_in_flight outweighs a batch of 8
])
def test_the_run_stops_once_every_turn_is_failing(overrides, limit):
    cfg = _cfg(*overrides)
    faults = RolloutFaults(cfg)
    _fail(faults, cfg, limit - 1)
    assert faults.error_streak == limit - 1
    with pytest.raises(RolloutFailing, match=rf"last {limit} turns failed.*EnvError: cannot"):
        faults.failed(_rec(cfg), "EnvError: cannot start", DropReason.TURN_TIMEOUT,
                      stopping=False)
    assert issubclass(RolloutFailing, RunFailing)


def test_a_lost_worker_does_not_add_to_the_failure_streak():
    cfg = _cfg()
    faults = RolloutFaults(cfg)
    limit = faults.max_error_streak
    _fail(faults, cfg, limit - 1)
    _fail(faults, cfg, 3 * limit, DropReason.WORKER_LOST)  # no raise
    assert faults.error_streak == limit - 1
    with pytest.raises(RolloutFailing):
        _fail(faults, cfg, 1)


def test_a_turn_that_goes_through_breaks_the_streak():
    cfg = _cfg()
    faults = RolloutFaults(cfg)
    limit = faults.max_error_streak
    _fail(faults, cfg, limit - 1)
    faults.stepped()
    assert faults.error_streak == 0
    _fail(faults, cfg, limit - 1)  # would have raised without the step between
    with pytest.raises(RolloutFailing):
        _fail(faults, cfg, 1)


# -- a worker lost ---------------------------------------------------------------------------


def test_a_lost_worker_abandons_exactly_the_cohorts_that_need_it():
    faults = RolloutFaults(_cfg())
    a, b, c = (_cohort("a", [0], {"w1", "w2"}), _cohort("b", [1], {"w3"}),
               _cohort("c", [2, 3], {"w2", "w4"}))
    cohorts = {co.step.key: co for co in (a, b, c)}
    detail, lost = faults.worker_lost("w2", cohorts)
    assert detail == "worker_lost: w2"
    assert [f.key for f in lost] == [a.step.key, c.step.key]
    assert lost[0] is a.step and lost[1] is c.step
    assert faults.is_lost("w2") and not faults.is_lost("w3")
    # already given up on: not handed back again when another of their workers leaves
    assert faults.worker_lost("w4", cohorts) == ("worker_lost: w4", [])
    assert faults.is_lost("w4")


def test_a_cohort_lost_with_a_worker_fails_every_member_with_why_whatever_came_back():
    faults = RolloutFaults(_cfg())
    lost, kept = _cohort("a", [0, 1, 2], {"w1"}), _cohort("b", [3], {"w2"})
    detail, _ = faults.worker_lost("w1", {co.step.key: co for co in (lost, kept)})
    results, reason = faults.results(_Settled(lost.step.key, "finished"), ["r0", "r1", "r2"], 3)
    assert results == [MemberError(detail)] * 3 and reason is DropReason.WORKER_LOST
    # the cohort it did not need answers with its own results
    assert faults.results(_Settled(kept.step.key, "finished"), ["r3"], 1) == (
        ["r3"], DropReason.ROLLOUT_ERROR)


def test_an_abandoned_cohort_is_forgotten_once_it_came_back():
    faults = RolloutFaults(_cfg())
    co = _cohort("a", [0], {"w1"})
    faults.worker_lost("w1", {co.step.key: co})
    faults.results(_Settled(co.step.key, "cancelled"), None, 1)
    # a later future under the same key is no longer the abandoned one
    assert faults.results(_Settled(co.step.key, "finished"), ["ok"], 1) == (
        ["ok"], DropReason.ROLLOUT_ERROR)


# -- what a cohort's members come back with ----------------------------------------------------


def test_a_cohort_that_raised_fails_every_member_with_its_error():
    faults = RolloutFaults(_cfg())
    fut = _Settled("env_step-x", "error", ValueError("bad action"))
    assert faults.results(fut, None, 2) == (
        [MemberError("ValueError: bad action")] * 2, DropReason.ROLLOUT_ERROR)


@pytest.mark.parametrize("status", ["cancelled", "lost"])
def test_a_cohort_whose_result_was_lost_fails_every_member_naming_its_status(status):
    faults = RolloutFaults(_cfg())
    results, reason = faults.results(_Settled("env_step-x", status), None, 3)
    assert results == [MemberError(f"RuntimeError: {status}: result lost")] * 3
    assert reason is DropReason.ROLLOUT_ERROR


def test_a_cohort_that_answered_keeps_each_members_result():
    faults = RolloutFaults(_cfg())
    answered = ["obs0", MemberError("KeyError: 'x'"), "obs2"]
    assert faults.results(_Settled("env_step-x", "finished"), answered, 3) == (
        answered, DropReason.ROLLOUT_ERROR)


# -- the watchdog ----------------------------------------------------------------------------


def test_overdue_abandons_the_cohorts_past_the_timeout(caplog):
    cfg = _cfg()
    faults = RolloutFaults(cfg)
    live = {i: _rec(cfg, traj_id=i, env_worker="env-1") for i in range(4)}
    long_ago = time.time() - 1000
    late = _cohort("late", [0, 1], {"env-1"}, submitted=long_ago)
    fresh = _cohort("fresh", [2], {"env-1"})
    decoding = _cohort("dec", [3], {"env-1"}, submitted=long_ago,
                       decode=_Settled("decode-dec", "pending"))
    cohorts = {co.step.key: co for co in (late, fresh, decoding)}
    with caplog.at_level(logging.WARNING, logger="flows.training.rollout_faults"):
        overdue = faults.overdue(cohorts, live, 300.0)
    assert overdue == [late.step, decoding.step]
    assert overdue[0] is late.step and overdue[1] is decoding.step
    # the environment past its decode is named with its worker and instances
    assert "environment frozenlake on env-1 (instances ['inst-0', 'inst-1'])" in caplog.text
    assert "prefill/decode of frozenlake (env_step-dec)" in caplog.text
    # given up on already: not picked again
    assert faults.overdue(cohorts, live, 300.0) == []

    results, reason = faults.results(_Settled(late.step.key, "cancelled"), None, 2)
    assert reason is DropReason.TURN_TIMEOUT
    assert results == [MemberError(
        "turn_timeout: environment frozenlake on env-1 (instances ['inst-0', 'inst-1']) did "
        "not answer within 300 s")] * 2
    results, reason = faults.results(_Settled(decoding.step.key, "cancelled"), None, 1)
    assert reason is DropReason.TURN_TIMEOUT and "prefill/decode" in results[0].error
    # the fresh cohort was left alone
    assert faults.results(_Settled(fresh.step.key, "finished"), ["ok"], 1) == (
        ["ok"], DropReason.ROLLOUT_ERROR)


def test_a_finished_decode_blames_the_environment():
    cfg = _cfg()
    faults = RolloutFaults(cfg)
    live = {0: _rec(cfg, env_worker="env-2")}
    co = _cohort("x", [0], {"env-2"}, submitted=time.time() - 1000,
                 decode=_Settled("decode-x", "finished"))
    assert faults.overdue({co.step.key: co}, live, 60.0) == [co.step]
    results, _ = faults.results(_Settled(co.step.key, "cancelled"), None, 1)
    assert results[0].error.startswith("turn_timeout: environment frozenlake on env-2")


@pytest.mark.parametrize("timeout_s", [None, 0])
def test_no_timeout_means_no_watchdog(timeout_s):
    cfg = _cfg()
    faults = RolloutFaults(cfg)
    co = _cohort("x", [0], {"env-1"}, submitted=0.0)
    assert faults.overdue({co.step.key: co}, {0: _rec(cfg, env_worker="env-1")}, timeout_s) == []


def test_a_cohort_lost_with_a_worker_is_not_also_overdue():
    cfg = _cfg()
    faults = RolloutFaults(cfg)
    co = _cohort("x", [0], {"env-1"}, submitted=0.0)
    faults.worker_lost("env-1", {co.step.key: co})
    assert faults.overdue({co.step.key: co}, {0: _rec(cfg, env_worker="env-1")}, 60.0) == []
    assert faults.results(_Settled(co.step.key, "cancelled"), None, 1)[1] is (
        DropReason.WORKER_LOST)
