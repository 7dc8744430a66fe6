"""The trajectory state machine: legal edges only, and the accounts add up at every event."""

from __future__ import annotations

import pytest

from flows.training.lifecycle import DropReason, IllegalTransition, TrajectoryLedger, TrajState

S = TrajState


def _through(ledger, tid, *states):
    for s in states:
        ledger.transition(tid, s)


def test_a_trajectory_runs_its_course_and_the_accounts_add_up_at_every_event():
    seen = []
    ledger = TrajectoryLedger(on_transition=lambda t, lg: seen.append(
        (lg.training.started, lg.training.trained, lg.training.dropped_total,
         lg.training.in_flight)))
    for tid in range(4):
        ledger.admit(tid)
    _through(ledger, 0, S.ROLLING_OUT, S.AWAITING_SCORE, S.SCORING, S.IN_GROUP, S.TRAINING,
             S.TRAINED)
    _through(ledger, 1, S.ROLLING_OUT, S.ROLLING_OUT)  # a restart after a failed attempt
    ledger.drop(1, DropReason.ROLLOUT_ERROR, "KilledWorker: lost")
    _through(ledger, 2, S.ROLLING_OUT, S.AWAITING_SCORE, S.SCORING)
    ledger.drop(2, DropReason.REWARD_ITEM_ERROR)
    _through(ledger, 3, S.ROLLING_OUT)
    assert ledger.rolling_out == 1 and ledger.unconsumed == 1
    # the counts each transition left: trajectory 0 trained while three were in flight, and
    # at the end two dropped and one still rolling out
    assert (4, 1, 0, 3) in seen and seen[-1] == (4, 1, 2, 1)
    assert len(seen) == ledger.transitions == 4 + 6 + 3 + 3 + 1 + 1
    s = ledger.summary()
    assert (s["started"], s["trained"], s["in_flight"]) == (4, 1, 1)
    assert s["dropped"] == {"reward_item_error": 1, "rollout_error": 1}
    assert s["finished"] == 2
    assert ledger.drop_details[0] == {"trajectory": 1, "reason": "rollout_error",
                                      "detail": "KilledWorker: lost"}


@pytest.mark.parametrize("path,bad", [
    ([], S.AWAITING_SCORE),  # admitted, never rolled out
    ([S.ROLLING_OUT], S.TRAINED),  # trained without a score
    ([S.ROLLING_OUT, S.AWAITING_SCORE], S.IN_GROUP),  # grouped without a score
    ([S.ROLLING_OUT], S.EVALUATED),  # a training trajectory is never an evaluation
])
def test_illegal_edges_are_refused(path, bad):
    ledger = TrajectoryLedger()
    ledger.admit(7)
    _through(ledger, 7, *path)
    with pytest.raises(IllegalTransition):
        ledger.transition(7, bad)


def test_a_drop_needs_a_reason_and_a_dropped_trajectory_stays_dropped():
    ledger = TrajectoryLedger()
    ledger.admit(0)
    with pytest.raises(IllegalTransition):
        ledger.transition(0, S.DROPPED)
    with pytest.raises(IllegalTransition):
        ledger.transition(0, S.ROLLING_OUT, DropReason.STALE)
    ledger.drop(0, DropReason.RUN_ENDED)
    with pytest.raises(IllegalTransition):
        ledger.drop(0, DropReason.RUN_ENDED)  # counted once, never twice
    with pytest.raises(IllegalTransition):
        ledger.admit(5) or ledger.admit(5)
    assert ledger.summary()["dropped"] == {"run_ended": 1}


def test_evaluation_episodes_are_accounted_apart_from_training():
    ledger = TrajectoryLedger()
    ledger.admit(0, evaluation=True)
    ledger.admit(1, evaluation=True)
    _through(ledger, 0, S.ROLLING_OUT, S.EVALUATED)
    ledger.transition(1, S.ROLLING_OUT)
    with pytest.raises(IllegalTransition):
        ledger.transition(1, S.AWAITING_SCORE)  # evaluations are never scored or trained
    ledger.drop(1, DropReason.ROLLOUT_ERROR)
    s = ledger.summary()
    assert s["started"] == 0 and s["evaluation"] == {
        "started": 2, "reported": 1, "dropped": {"rollout_error": 1}}
    assert ledger.live(evaluation=True) == [] and ledger.drop_details == []


def test_reward_errors_map_to_their_reason():
    assert DropReason.of_reward_error("reward_function_error: ValueError: x") is \
        DropReason.REWARD_FUNCTION_ERROR
    assert DropReason.of_reward_error("reward_item_error: KeyError") is \
        DropReason.REWARD_ITEM_ERROR
    # anything else, including a non-reward reason, is a generic reward error
    assert DropReason.of_reward_error("stale: x") is DropReason.REWARD_ERROR
    assert DropReason.of_reward_error(None) is DropReason.REWARD_ERROR
