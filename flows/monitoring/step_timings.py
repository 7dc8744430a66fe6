"""What the driver records for the critical path of its train steps
(:mod:`flows.monitoring.critical_path`): each trajectory's finished turns as they came back, and
each step's cut, end and trajectories; both bounded (the oldest are forgotten)."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

KEEP_STEPS = 20
KEEP_TRAJECTORIES = 8192


def trajectory_key(traj_id: Any, attempt: int) -> str:
    """A trajectory's attempt, as turns and steps name it."""
    return f"{traj_id}-{attempt}"


def joined_legs(suffixes: Iterable[str]) -> str:
    """A turn's cohorts (their tasks' key suffixes, the one it finished with last) as one
    string, the way the task stream records a turn (a member continued after its cohort's
    stage returned went through several)."""
    return "+".join(suffixes)


def legs_of(joined: str) -> list[str]:
    """The cohorts' key suffixes of a turn recorded by :func:`joined_legs`."""
    return joined.split("+")


@dataclass(frozen=True)
class TurnTiming:
    """One finished turn of a trajectory, wall-clock seconds."""

    turn: int
    submitted: float
    answered: float  # the driver held its env_step's result
    workers: tuple[str, str, str]  # env, prefill, decode
    # each cohort the member went through: its tasks' key suffix, and the stage it was left
    # running in there (None: the cohort it finished with)
    legs: tuple[tuple[str, str | None], ...]
    prefill_s: float  # measured on the workers (emulated engines; 0 on a real one)
    kv_s: float
    decode_s: float
    env_s: float  # the environment step's own time (env_reset's is not measured)


class TurnTimings:
    """Each trajectory's finished turns (one driver's); the oldest trajectories are forgotten."""

    def __init__(self, keep: int = KEEP_TRAJECTORIES):
        self.keep = keep
        self._turns: OrderedDict[str, list[TurnTiming]] = OrderedDict()
        self._legs: OrderedDict[str, list[tuple[str, str | None]]] = OrderedDict()

    def deferred(self, trajectory: str, suffix: str, stage: str) -> None:
        """The member left cohort ``suffix`` still running ``stage``."""
        self._legs.setdefault(trajectory, []).append((suffix, stage))
        self._legs.move_to_end(trajectory)
        while len(self._legs) > self.keep:
            self._legs.popitem(last=False)

    def turn(self, trajectory: str, turn: int, submitted: float, answered: float,
             workers: tuple[str, str, str], suffix: str, obs: Any) -> TurnTiming:
        """A turn came back with ``obs`` (a :class:`tasks.records.EnvObservation`)."""
        s = obs.sample
        prefill, kv = s.prefill_wait_s, s.kv_transfer_s
        legs = (*self._legs.pop(trajectory, ()), (suffix, None))
        timing = TurnTiming(turn, submitted, answered, workers, legs, prefill, kv,
                            max(0.0, s.emulated_wait_s - prefill - kv), obs.step_seconds)
        self._turns.setdefault(trajectory, []).append(timing)
        self._turns.move_to_end(trajectory)
        while len(self._turns) > self.keep:
            self._turns.popitem(last=False)
        return timing

    def of(self, trajectory: str) -> list[TurnTiming] | None:
        return self._turns.get(trajectory)


@dataclass
class StepTiming:
    """One train step: when its batch was cut and trained, and whom it trained."""

    step: int  # the policy version it publishes
    after: float | None  # the previous step's end (None: the first step of this run)
    cut: float
    trajectories: tuple[str, ...]
    end: float | None = None  # None: not trained (yet, or lost)


class StepLog:
    """The last ``keep`` steps' timings."""

    def __init__(self, keep: int = KEEP_STEPS):
        self.steps: deque[StepTiming] = deque(maxlen=keep)
        self._last_end: float | None = None

    def cut(self, step: int, trajectories: Iterable[str], now: float) -> None:
        self.steps.append(StepTiming(step, self._last_end, now, tuple(trajectories)))

    def trained(self, now: float) -> None:
        if self.steps and self.steps[-1].end is None:
            self.steps[-1].end = self._last_end = now
