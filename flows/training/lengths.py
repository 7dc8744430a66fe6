"""Each env task's running estimate of its trajectories' lengths (first prompt, later turns'
new tokens, responses, turns), from the config's ``shape`` and the environment's ``max_turns``
as priors, updated from the turns that come back. Pure: the turn placement
(:mod:`flows.training.turn_placement`) prices turns and trajectories with it, in the rollout
driver and in the simulator alike."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from resources.affinity import TrajectoryShape

if TYPE_CHECKING:
    from flows.config import EnvTaskConfig

# the config's shape counts as this many trajectories' (or turns') worth of observations
PRIOR_WEIGHT = 4
# the running means never weigh a new observation below this: they follow the lengths as the
# policy's responses grow or shrink during training (about the last 50 observations)
MIN_STEP = 0.02
# an estimate is a new version (decisions are priced again) once a mean moved this much
VERSION_STEP = 0.02


@dataclass
class RunningMean:
    """A mean that starts from a prior worth ``weight`` observations and weighs each new one at
    least :data:`MIN_STEP` (an exponential moving average once it has seen enough)."""

    value: float | None = None
    weight: float = 0.0

    def update(self, x: float) -> None:
        self.weight += 1.0
        if self.value is None:
            self.value = float(x)
            return
        self.value += max(1.0 / self.weight, MIN_STEP) * (x - self.value)


@dataclass
class EnvTaskLengths:
    """One env task's running estimate of its trajectories' lengths."""

    prompt: RunningMean = field(default_factory=RunningMean)  # the first turn's prompt
    turn: RunningMean = field(default_factory=RunningMean)  # each later turn's new tokens
    response: RunningMean = field(default_factory=RunningMean)  # each turn's response
    turns: RunningMean = field(default_factory=RunningMean)  # turns per trajectory
    trajectories: int = 0  # finished trajectories seen
    responses: tuple[float, int] = (0.0, 0)  # observed response tokens: their sum and count
    version: int = 0
    _priced: tuple[float, ...] = ()  # the means at the last version

    @classmethod
    def from_prior(cls, prior: TrajectoryShape | None) -> EnvTaskLengths:
        if prior is None:
            return cls()
        return cls(RunningMean(prior.prompt_tokens, PRIOR_WEIGHT),
                   RunningMean(prior.turn_tokens, PRIOR_WEIGHT),
                   RunningMean(prior.response_tokens, PRIOR_WEIGHT),
                   RunningMean(prior.turns, PRIOR_WEIGHT))

    def shape(self) -> TrajectoryShape | None:
        """The estimate (None until a prompt and a response are known)."""
        if self.prompt.value is None or self.response.value is None:
            return None
        turn = self.turn.value if self.turn.value is not None else self.prompt.value
        return TrajectoryShape(self.prompt.value, turn, self.response.value,
                               self.turns.value if self.turns.value is not None else 1.0)

    def bump(self) -> None:
        """A new version when a mean moved more than :data:`VERSION_STEP` since the last."""
        now = tuple(m.value or 0.0 for m in (self.prompt, self.turn, self.response, self.turns))
        if not self._priced or any(abs(a - b) > VERSION_STEP * max(abs(b), 1.0)
                                   for a, b in zip(now, self._priced, strict=True)):
            self._priced = now
            self.version += 1


def max_turns(env_spec: Any) -> int | None:
    """The ``max_turns`` an environment's component spec sets, wrappers searched too."""
    if isinstance(env_spec, dict):
        if isinstance(env_spec.get("max_turns"), int):
            return env_spec["max_turns"]
        for value in env_spec.values():
            found = max_turns(value)
            if found is not None:
                return found
    return None


class LengthEstimates:
    """Per env task, running estimates of its trajectories' lengths (:class:`EnvTaskLengths`);
    :meth:`expected` is the mean response of its turns (what ``length_aware`` asks)."""

    def __init__(self, priors: dict[str, TrajectoryShape] | None = None):
        self.priors = dict(priors or {})
        self.tasks: dict[str, EnvTaskLengths] = {}

    @classmethod
    def from_env_tasks(cls, env_tasks: Iterable[EnvTaskConfig]) -> LengthEstimates:
        """Priors from each env task's ``shape`` (its distributions' means) and its
        environment's ``max_turns`` (trajectories assumed to use them all until some end)."""
        priors = {}
        for t in env_tasks:
            if t.shape is not None:
                mean = [min(d.mean, d.max) for d in (t.shape.prompt_tokens, t.shape.turn_tokens,
                                                     t.shape.response_tokens)]
                priors[t.name] = TrajectoryShape(*mean, float(max_turns(t.env) or 1))
        return cls(priors)

    def of(self, env_task: str) -> EnvTaskLengths:
        if env_task not in self.tasks:
            self.tasks[env_task] = EnvTaskLengths.from_prior(self.priors.get(env_task))
            self.tasks[env_task].bump()
        return self.tasks[env_task]

    def record(self, env_task: str, tokens: int, prompt: int | None = None,
               first: bool = False) -> None:
        """A turn of ``env_task`` generated ``tokens`` after reading ``prompt`` new tokens
        (``first``: the trajectory's first turn, whose prompt is the task's)."""
        e = self.of(env_task)
        e.response.update(tokens)
        e.responses = (e.responses[0] + tokens, e.responses[1] + 1)
        if prompt is not None:
            (e.prompt if first else e.turn).update(prompt)
        e.bump()

    def finished(self, env_task: str, turns: int) -> None:
        """A trajectory of ``env_task`` ended after ``turns`` turns."""
        e = self.of(env_task)
        e.turns.update(turns)
        e.trajectories += 1
        e.bump()

    def expected(self, env_task: str) -> float | None:
        """The plain mean of the responses ``env_task``'s turns produced (None before its
        first: ``length_aware`` splits until then)."""
        e = self.tasks.get(env_task)
        if e is None or not e.responses[1]:
            return None
        return e.responses[0] / e.responses[1]

    def shape(self, env_task: str) -> TrajectoryShape | None:
        return self.of(env_task).shape()


# the name the simulator and ``length_aware`` know it by
ResponseLengths = LengthEstimates
