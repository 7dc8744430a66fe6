"""Held-out greedy evaluation, beside training.

Every ``eval.every_steps`` train steps (and after the last), one round of greedy episodes on
held-out seeds per env task runs on the weights the engines hold: the version requested, or a
newer one that arrived meanwhile, or — until the requested version is loaded everywhere — the
one before. A round's record says which: ``eval/policy_version_oldest`` is the oldest version any
of its tokens came from. Episodes are recognised by their own round number, not by a name.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from flows.config import EnvTaskConfig
from flows.monitoring.metrics import eval_metrics
from tasks.envs.base import eval_seed
from tasks.records import Trajectory

logger = logging.getLogger(__name__)


@dataclass
class EvalRound:
    round_id: int
    version: int  # the policy version the round was started for
    pending: int
    episodes: list[Trajectory] = field(default_factory=list)
    failed: int = 0
    t0: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class EpisodeSpec:
    group_id: str
    env_task: EnvTaskConfig
    seed: int
    round_id: int


class Evaluator:
    def __init__(self, env_tasks: list[EnvTaskConfig], every_steps: int, episodes: int,
                 max_steps: int):
        self.env_tasks, self.every_steps, self.episodes = env_tasks, every_steps, episodes
        self.max_steps = max_steps
        self._rounds: dict[int, EvalRound] = {}
        self._next_round = 0
        self.last: dict = {}

    def due(self, version: int) -> bool:
        return bool(self.every_steps) and (version % self.every_steps == 0
                                           or version >= self.max_steps)

    def start(self, version: int) -> list[EpisodeSpec]:
        """Open a round for ``version``; the episodes to launch."""
        r = EvalRound(self._next_round, version, self.episodes * len(self.env_tasks))
        self._next_round += 1
        self._rounds[r.round_id] = r
        return [EpisodeSpec(f"eval{r.round_id}.{t.name}", t, eval_seed(i), r.round_id)
                for t in self.env_tasks for i in range(self.episodes)]

    def on_episode(self, round_id: int, traj: Trajectory | None) -> dict | None:
        """An episode ended (``None``: it failed). The round's metrics once it is complete."""
        r = self._rounds[round_id]
        r.pending -= 1
        if traj is None:
            r.failed += 1
        else:
            r.episodes.append(traj)
        if r.pending:
            return None
        del self._rounds[round_id]
        self.last = eval_metrics(r.version, r.episodes, r.failed, time.perf_counter() - r.t0)
        logger.info("evaluation at v%d: %s", r.version,
                    {k: round(v, 3) for k, v in self.last.items() if k.endswith("/success")})
        return self.last
