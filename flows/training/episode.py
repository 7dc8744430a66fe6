"""One trajectory's record while it rolls out, and the requests that score it. Pure: the Dask
flow (:mod:`flows.training.rollout`, :mod:`flows.training.reward_bursts`) and the reference loop
(:mod:`flows.reference`) share it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from tasks.records import EnvHandle, EnvObservation, SamplingParams, ScoreRequest, Trajectory

if TYPE_CHECKING:
    from flows.config import EnvTaskConfig, TrainConfig


def sampling_params(cfg: TrainConfig, greedy: bool = False) -> dict[str, SamplingParams]:
    """Per env task: its sampling settings (the task's own, else rollout.sampling); with
    ``greedy``, greedy whatever they say (evaluation)."""
    return {t.name: SamplingParams(temperature=sc.temperature, max_new_tokens=sc.max_new_tokens,
                                   greedy=greedy or sc.greedy)
            for t in cfg.env_tasks for sc in [t.sampling or cfg.rollout.sampling]}


# evaluation episodes' trajectory ids start here (training ids count up from 0)
EVAL_ID_OFFSET = 10**9


@dataclass
class TrajectoryIds:
    """A rollout driver's trajectory ids, kept in checkpoints. Evaluation episodes take ids of
    their own, counting on from :data:`EVAL_ID_OFFSET`, so that they never shift the training
    trajectories' ids and with them their sampling seeds."""

    next_training: int = 0
    next_evaluation: int = EVAL_ID_OFFSET

    def take(self, evaluation: bool = False) -> int:
        if evaluation:
            self.next_evaluation += 1
            return self.next_evaluation - 1
        self.next_training += 1
        return self.next_training - 1

    def state(self) -> dict:
        return {"next_trajectory": self.next_training,
                "next_eval_trajectory": self.next_evaluation}

    def restore(self, state: dict) -> None:
        self.next_training = int(state["next_trajectory"])
        self.next_evaluation = int(state["next_eval_trajectory"])


@dataclass
class RolloutRecord:
    """A trajectory while it rolls out: where it lives, and its turns so far."""

    traj_id: int
    group_id: str
    env_task: EnvTaskConfig
    seed: int
    eval_round: int | None = None  # set for evaluation episodes (reported, never trained)
    attempt: int = 0
    turn: int = 0
    env_worker: str | None = None
    decode_worker: str | None = None
    prefill_worker: str | None = None
    # the last turn's decode output (the cache so far): (its cohort's future, the index in it)
    last_decode: Any = None
    kv_worker: str | None = None  # the worker holding ``last_decode`` (the cache)
    env_reset: Any = None  # the future of the reset creating its instance, until it answered
    next_obs: Any = None  # the observation the next turn reads (None: reset first)
    tokens: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    forward_oldest: int | None = None
    env_rewards: list[float] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)
    env_step_s: float = 0.0
    handle: EnvHandle | None = None
    virtual_tokens: int = 0
    virtual_response_tokens: int = 0
    last_shape: Any = None  # the TurnShape of the turn in flight (None: real lengths)
    # the turn in flight, kept for the continuation of a stage left running: its cohort's
    # workers (a CohortKey), the cache and observation it reads, when it was submitted
    turn_key: Any = None
    turn_past: Any = None
    turn_obs: Any = None
    turn_submitted: float = 0.0
    turn_step: Any = None  # the turn in flight's env_step: (its cohort's future, the index)
    # its next turn, submitted ahead (rollout.lookahead): (its Cohort, the index in it)
    ahead: Any = None

    @property
    def evaluation(self) -> bool:
        return self.eval_round is not None

    def turn_key_workers(self) -> set[str]:
        """The workers the turn in flight runs on or reads its cache from."""
        key = self.turn_key
        held = {self.kv_worker} if self.kv_worker else set()
        if key is None:
            return held
        return {key.env_worker, key.prefill_worker, key.decode_worker} | held

    def reset_record(self) -> None:
        self.turn = 0
        self.last_decode = self.kv_worker = self.env_reset = None
        self.next_obs = self.turn_step = self.ahead = None
        self.tokens, self.mask, self.logprobs, self.versions = [], [], [], []
        self.forward_oldest = None
        self.env_rewards, self.responses, self.env_step_s, self.handle = [], [], 0.0, None
        self.virtual_tokens = self.virtual_response_tokens = 0

    def record_turn(self, obs: EnvObservation) -> None:
        """Append one finished turn: the tokens read before the action, then the action."""
        s = obs.sample
        self.handle = obs.handle
        self.tokens += obs.consumed_ids + s.token_ids
        self.mask += [False] * len(obs.consumed_ids) + [True] * len(s.token_ids)
        self.logprobs += [0.0] * len(obs.consumed_ids) + s.logprobs
        self.versions += [-1] * len(obs.consumed_ids) + s.versions
        if s.oldest_version >= 0:
            self.forward_oldest = (s.oldest_version if self.forward_oldest is None
                                   else min(self.forward_oldest, s.oldest_version))
        self.env_rewards.append(obs.reward)
        self.responses.append(s.text)
        self.env_step_s += obs.step_seconds
        self.virtual_tokens += s.virtual_tokens
        self.virtual_response_tokens += s.virtual_response_tokens
        self.turn += 1

    def to_trajectory(self, last: EnvObservation, context_limited: bool) -> Trajectory:
        return Trajectory(
            traj_id=str(self.traj_id), group_id=self.group_id, env_name=self.env_task.name,
            seed=self.seed, token_ids=np.asarray(self.tokens, dtype=np.int64),
            loss_mask=np.asarray(self.mask, dtype=bool),
            behaviour_logprobs=np.asarray(self.logprobs, dtype=np.float32),
            versions=np.asarray(self.versions, dtype=np.int64), env_rewards=self.env_rewards,
            responses=self.responses, info=dict(last.info), num_turns=self.turn,
            truncated=context_limited or last.truncated, context_truncated=context_limited,
            attempt=self.attempt, success=bool(last.info.get("success", False)),
            format_errors=int(last.info.get("format_errors", 0)), env_step_s=self.env_step_s,
            evaluation=self.evaluation, forward_oldest_version=self.forward_oldest,
            virtual_tokens=self.virtual_tokens,
            virtual_response_tokens=self.virtual_response_tokens,
        )


def turn_ends(rec: RolloutRecord, obs: EnvObservation, max_new_tokens: int,
              max_context: int) -> tuple[bool, bool]:
    """(episode over, cut by the context limit) after ``obs``: the context is full, or the next
    turn's observation and response could not fit."""
    context_limited = obs.sample.context_full or (
        not obs.done and len(rec.tokens) + len(obs.input_ids) + max_new_tokens > max_context)
    return obs.done or context_limited, context_limited


def score_requests(trajs: list[Trajectory], reward_fns: dict[str, str],
                   run_id: str) -> list[ScoreRequest]:
    """JSON-able scoring requests; the idempotency key names the run, trajectory and attempt."""
    return [ScoreRequest(id=str(t.traj_id), idempotency_key=f"{run_id}/{t.traj_id}/{t.attempt}",
                         reward_fn=reward_fns[t.env_name],
                         env_name=t.env_name, env_rewards=t.env_rewards, responses=t.responses,
                         info=t.info, virtual_tokens=t.virtual_tokens) for t in trajs]
