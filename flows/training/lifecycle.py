"""A trajectory's life as a state machine with one transition function.

::

    admitted -> rolling_out -> awaiting_score -> scoring -> in_group -> training -> trained
        |           |  ^ (restart)    |  ^ (re-sent) |          |           |
        +-----------+--+--------------+--+-----------+----------+-----------+--> dropped(reason)
                    +-> evaluated            (evaluation episodes: reported, never trained)

:class:`TrajectoryLedger` is the only writer of a trajectory's state and of the counters that
must add up. Every change goes through :meth:`TrajectoryLedger.transition`, which refuses an
illegal edge and checks ``started == trained + dropped + in flight`` (training trajectories; the
same for evaluation episodes apart) after every event, so the accounting holds by construction.
Pure: no Dask, unit-tested like :mod:`flows.training.orchestration`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum


class TrajState(StrEnum):
    ADMITTED = "admitted"
    ROLLING_OUT = "rolling_out"
    AWAITING_SCORE = "awaiting_score"
    SCORING = "scoring"
    IN_GROUP = "in_group"
    TRAINING = "training"  # in a batch whose train step is running
    TRAINED = "trained"
    EVALUATED = "evaluated"
    DROPPED = "dropped"


class DropReason(StrEnum):
    """Why a trajectory was dropped: the keys of ``summary.json``'s ``dropped``."""

    STALE = "stale"  # staler than rollout.max_staleness when its batch was cut
    GROUP_INCOMPLETE = "group_incomplete"  # its group kept fewer than two members
    RUN_ENDED = "run_ended"  # the run ended first (trainer.max_steps reached, or closed)
    INTERRUPTED = "interrupted"  # the run was interrupted (Ctrl-C, a notebook's interrupt)
    ROLLOUT_ERROR = "rollout_error"  # a turn's task failed on every attempt (worker lost, ...)
    WORKER_LOST = "worker_lost"  # a worker it needed left the cluster, on its last attempt
    TURN_TIMEOUT = "turn_timeout"  # a turn did not answer within rollout.turn_timeout_s
    TRAINER_LOST = "trainer_lost"  # its train step was lost with the trainer's worker
    REWARD_TASK_ERROR = "reward_task_error"  # the score task itself raised
    REWARD_TASK_LOST = "reward_task_lost"  # the score task's result was lost with its worker
    REWARD_FUNCTION_ERROR = "reward_function_error"  # the function raised, retries spent
    REWARD_CALL_FAILED = "reward_call_failed"  # the call failed (throttled, HTTP error, ...)
    REWARD_ITEM_ERROR = "reward_item_error"  # the reward function failed on this trajectory
    REWARD_BAD_EVENT = "reward_bad_event"  # the handler rejected the event
    REWARD_BAD_RESPONSE = "reward_bad_response"  # the answer was not a handler response
    REWARD_MISSING_RESULT = "reward_missing_result"  # the answer lacked this trajectory
    REWARD_ERROR = "reward_error"  # any other reward failure

    @classmethod
    def of_reward_error(cls, error: str | None) -> DropReason:
        """The reason of a reward error written ``"<reason>: <message>"``."""
        kind = (error or "").split(":", 1)[0].strip()
        try:
            reason = cls(kind)
        except ValueError:
            return cls.REWARD_ERROR
        return reason if reason.value.startswith("reward_") else cls.REWARD_ERROR


TERMINAL = frozenset({TrajState.TRAINED, TrajState.EVALUATED, TrajState.DROPPED})
S = TrajState
EDGES: dict[TrajState, frozenset[TrajState]] = {
    S.ADMITTED: frozenset({S.ROLLING_OUT, S.DROPPED}),
    S.ROLLING_OUT: frozenset({S.ROLLING_OUT, S.AWAITING_SCORE, S.EVALUATED, S.DROPPED}),
    S.AWAITING_SCORE: frozenset({S.SCORING, S.DROPPED}),
    # back to awaiting_score: its score task was lost with its worker and is sent again
    S.SCORING: frozenset({S.IN_GROUP, S.AWAITING_SCORE, S.DROPPED}),
    S.IN_GROUP: frozenset({S.TRAINING, S.DROPPED}),
    S.TRAINING: frozenset({S.TRAINED, S.DROPPED}),
}


class IllegalTransition(RuntimeError):
    pass


class RunFailing(RuntimeError):
    """Every trajectory keeps failing the same way: the run stops with this one line rather
    than spin."""


@dataclass(frozen=True)
class Transition:
    traj_id: int
    evaluation: bool
    old: TrajState | None  # None: admitted just now
    new: TrajState
    reason: DropReason | None = None
    detail: str = ""


@dataclass
class Accounts:
    """Counters of one kind of trajectory (training, or evaluation episodes)."""

    started: int = 0
    finished: int = 0  # finished rolling out (whatever came of them after)
    trained: int = 0  # evaluation: episodes reported
    dropped: Counter[DropReason] = field(default_factory=Counter)
    in_state: Counter[TrajState] = field(default_factory=Counter)  # live ones, by state

    @property
    def in_flight(self) -> int:
        return sum(self.in_state.values())

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    def balanced(self) -> bool:
        return self.started == self.trained + self.dropped_total + self.in_flight


class TrajectoryLedger:
    """The states of all live trajectories and the counters that add up.

    ``on_transition(transition, ledger)`` is called after every event (tests use it to watch the
    invariant at each one; a dashboard could use it to plot trajectories per state).
    """

    MAX_DETAILS = 100

    def __init__(self, on_transition: Callable[[Transition, TrajectoryLedger], None] | None = None):
        self._live: dict[int, tuple[TrajState, bool]] = {}  # id -> (state, evaluation)
        self.training = Accounts()
        self.evaluation = Accounts()
        self.drop_details: list[dict] = []
        self.on_transition = on_transition
        self.transitions = 0

    def _accounts(self, evaluation: bool) -> Accounts:
        return self.evaluation if evaluation else self.training

    def admit(self, traj_id: int, evaluation: bool = False) -> None:
        if traj_id in self._live:
            raise IllegalTransition(f"trajectory {traj_id} admitted twice")
        acc = self._accounts(evaluation)
        acc.started += 1
        acc.in_state[TrajState.ADMITTED] += 1
        self._live[traj_id] = (TrajState.ADMITTED, evaluation)
        self._after(Transition(traj_id, evaluation, None, TrajState.ADMITTED))

    def transition(self, traj_id: int, new: TrajState, reason: DropReason | None = None,
                   detail: str = "") -> None:
        """Move a trajectory to ``new`` (``reason`` required exactly when dropping)."""
        try:
            old, evaluation = self._live[traj_id]
        except KeyError:
            raise IllegalTransition(f"trajectory {traj_id} is not live (-> {new})") from None
        if new not in EDGES[old]:
            raise IllegalTransition(f"trajectory {traj_id}: {old} -> {new} is not allowed")
        if (new is TrajState.DROPPED) != (reason is not None):
            raise IllegalTransition(f"trajectory {traj_id}: a drop, and only a drop, has a reason")
        if evaluation and new in (S.AWAITING_SCORE, S.SCORING, S.IN_GROUP, S.TRAINED):
            raise IllegalTransition(f"evaluation episode {traj_id} cannot be {new}")
        if not evaluation and new is S.EVALUATED:
            raise IllegalTransition(f"training trajectory {traj_id} cannot be {new}")
        acc = self._accounts(evaluation)
        acc.in_state[old] -= 1
        if new in (S.AWAITING_SCORE, S.EVALUATED):
            acc.finished += 1
        if new in TERMINAL:
            del self._live[traj_id]
            if new is TrajState.DROPPED:
                acc.dropped[reason] += 1
                if not evaluation and len(self.drop_details) < self.MAX_DETAILS:
                    self.drop_details.append({"trajectory": traj_id, "reason": str(reason),
                                              "detail": detail})
            else:
                acc.trained += 1
        else:
            acc.in_state[new] += 1
            self._live[traj_id] = (new, evaluation)
        self._after(Transition(traj_id, evaluation, old, new, reason, detail))

    def drop(self, traj_id: int, reason: DropReason, detail: str = "") -> None:
        self.transition(traj_id, TrajState.DROPPED, reason, detail)

    def _after(self, t: Transition) -> None:
        self.transitions += 1
        acc = self._accounts(t.evaluation)
        if not acc.balanced():  # unreachable unless this class is wrong: fail where it happens
            raise AssertionError(f"accounting broken after {t}: started {acc.started} != "
                                 f"trained {acc.trained} + dropped {acc.dropped_total} + "
                                 f"in flight {acc.in_flight}")
        if self.on_transition is not None:
            self.on_transition(t, self)

    # -- questions --------------------------------------------------------------------------
    def state(self, traj_id: int) -> TrajState | None:
        entry = self._live.get(traj_id)
        return entry[0] if entry else None

    def live(self, evaluation: bool = False) -> list[int]:
        """Ids of the trajectories not yet trained, evaluated or dropped."""
        return [i for i, (_, ev) in self._live.items() if ev == evaluation]

    def count(self, state: TrajState, evaluation: bool = False) -> int:
        return self._accounts(evaluation).in_state[state]

    @property
    def rolling_out(self) -> int:
        """Training trajectories admitted and not finished rolling out."""
        acc = self.training
        return acc.in_state[S.ADMITTED] + acc.in_state[S.ROLLING_OUT]

    @property
    def unconsumed(self) -> int:
        """Training trajectories admitted and not yet in a train step, trained or dropped."""
        return self.training.in_flight - self.training.in_state[S.TRAINING]

    def summary(self) -> dict:
        t, e = self.training, self.evaluation
        return {"started": t.started, "finished": t.finished, "trained": t.trained,
                "dropped": {str(k): v for k, v in sorted(t.dropped.items())},
                "in_flight": t.in_flight, "rolling_out": self.rolling_out,
                "evaluation": {"started": e.started, "reported": e.trained,
                               "dropped": {str(k): v for k, v in sorted(e.dropped.items())}}}
