"""The work a finished run did, as the bench's lower bound (:mod:`flows.benchmarks.bound`) prices
it: each turn's virtual lengths and environment latency (``task_stream.json``'s ``turn_work``,
written by :class:`flows.training.turn_tasks.TurnLog`), each environment reset's time (its
task's interval, for a trajectory's own reset), and which trajectories each train step trained
(:class:`TrainedBatches`, recorded through ``run_training``'s ``on_transition`` and saved as
``trained.json`` beside the run's summary).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from flows.training.lifecycle import TrajectoryLedger, TrajState, Transition

TRAINED_FILE = "trained.json"


@dataclass(frozen=True)
class Turn:
    """One turn's work: ``prompt`` new tokens read after ``cached`` ones, ``response``
    generated, then ``env_latency_s`` of environment (emulated seconds)."""

    prompt: int
    cached: int
    response: int
    env_latency_s: float = 0.0

    @property
    def context(self) -> int:
        """The context the decode starts from."""
        return self.cached + self.prompt


@dataclass
class TrajectoryWork:
    """One attempt of one trajectory: its turns in order, and its environment reset's time."""

    key: str  # "trajectory-attempt"
    env_task: str = ""
    turns: list[Turn] = field(default_factory=list)
    reset_s: float = 0.0  # emulated seconds (0: not known, e.g. a reset shared by a cohort)

    @property
    def tokens(self) -> int:
        """Prompt and response tokens of every turn: its length as the trainer reads it."""
        return sum(t.prompt + t.response for t in self.turns)


@dataclass
class RunWork:
    """The trajectories each train step trained (in step order) and the tokens of the turns
    that no trained trajectory holds (dropped or restarted attempts, turns cut by the run's
    end). ``complete``: which trajectories were trained is known (else every recorded
    trajectory is taken as one step's)."""

    steps: list[list[TrajectoryWork]]
    untrained_tokens: int = 0
    complete: bool = True

    @property
    def trained(self) -> list[TrajectoryWork]:
        return [t for step in self.steps for t in step]

    @property
    def trained_tokens(self) -> int:
        return sum(t.tokens for t in self.trained)


class TrainedBatches:
    """An ``on_transition`` callback (:class:`flows.training.lifecycle.TrajectoryLedger`) that
    records the trajectories of each train step: the ``TRAINED`` transitions of one step come
    together, and every later step's follow a batch cut's ``TRAINING`` ones."""

    def __init__(self) -> None:
        self.steps: list[list[int]] = []
        self._open = False  # the last transition seen was a training trajectory trained

    def __call__(self, t: Transition, _ledger: TrajectoryLedger) -> None:
        if t.evaluation or t.new is not TrajState.TRAINED:
            self._open = False
            return
        if not self._open:
            self.steps.append([])
            self._open = True
        self.steps[-1].append(int(t.traj_id))

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"steps": self.steps}))


def _reset_seconds(stream: dict, time_scale: float) -> dict[str, float]:
    """Each trajectory attempt's own environment reset, emulated seconds, by
    "trajectory-attempt" (cohort resets, shared by their members, are left out)."""
    out = {}
    for key, _worker, start, stop in stream.get("tasks", []):
        stage, _, suffix = key.partition("-")
        if stage != "env_reset":
            continue
        parts = suffix.split("@")[0].split("-")
        if len(parts) == 3 and all(p.isdigit() for p in parts):
            out[f"{parts[0]}-{parts[2]}"] = (stop - start) / time_scale
    return out


def trajectories(stream: dict, time_scale: float) -> dict[str, TrajectoryWork]:
    """Every trajectory attempt with recorded turns, by "trajectory-attempt"."""
    resets = _reset_seconds(stream, time_scale)
    out: dict[str, TrajectoryWork] = {}
    for w in sorted(stream.get("turn_work", []), key=lambda w: (w["trajectory"], w["turn"])):
        key = w["trajectory"]
        traj = out.get(key)
        if traj is None:
            traj = out[key] = TrajectoryWork(key, w["env_task"], reset_s=resets.get(key, 0.0))
        traj.turns.append(Turn(w["prompt_tokens"], w["cached_tokens"], w["response_tokens"],
                               w["env_latency_s"]))
    return out


def run_work(stream: dict, time_scale: float, trained_steps: list[list[int]] | None) -> RunWork:
    """The run's work from its task stream and, when known, its trained batches (a trained
    trajectory is its last attempt)."""
    every = trajectories(stream, time_scale)
    if trained_steps is None:
        return RunWork([list(every.values())], 0, complete=False)
    last: dict[int, TrajectoryWork] = {}
    attempts: dict[int, int] = defaultdict(lambda: -1)
    for key, traj in every.items():
        tid, attempt = (int(x) for x in key.split("-"))
        if attempt > attempts[tid]:
            attempts[tid], last[tid] = attempt, traj
    steps = [[last[tid] for tid in step if tid in last] for step in trained_steps]
    held = {id(t) for step in steps for t in step}
    untrained = sum(t.tokens for t in every.values() if id(t) not in held)
    return RunWork(steps, untrained)


def read_run_work(run_dir: Path, time_scale: float) -> RunWork | None:
    """:func:`run_work` of a run directory (None without a task stream with turn work)."""
    stream_file = run_dir / "task_stream.json"
    if not stream_file.exists():
        return None
    stream = json.loads(stream_file.read_text())
    if "turn_work" not in stream:
        return None
    trained_file = run_dir / TRAINED_FILE
    trained = (json.loads(trained_file.read_text())["steps"] if trained_file.exists()
               else None)
    return run_work(stream, time_scale, trained)
