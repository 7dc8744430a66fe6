"""Trajectory graphs: each trajectory is a dynamic Dask graph, one turn's sub-graph at a time.

A turn is ``prefill -> decode -> response -> env_step``, submitted together with futures as
arguments, so the KV cache moves worker to worker (decode -> prefill -> decode) and never through
the driver; the driver waits only for env_step's small result. Keys are
``"{stage}-{trajectory}-{turn}-{attempt}"``: the dashboard groups by stage and a restarted
trajectory never picks up an old key's result.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from distributed import Client, Future

from flows.config import EnvTaskConfig, TrainConfig
from flows.orchestration import Router
from resources.pools import Stage, Tag, demand
from resources.worker import plain, with_engine, with_engine_tokenizer, with_envs, with_registry
from tasks.env_tasks import env_close, env_reset, env_step
from tasks.generation import decode, prefill, response_of
from tasks.records import EnvHandle, EnvObservation, SamplingParams, ScoreRequest, Trajectory

logger = logging.getLogger(__name__)


@dataclass
class TrajectoryState:
    traj_id: int
    group_id: str
    task: EnvTaskConfig
    seed: int
    attempt: int = 0
    turn: int = 0
    env_worker: str | None = None
    decode_worker: str | None = None
    prefill_worker: str | None = None
    last_decode: Future | None = None  # DecodeOutput future (the KV so far)
    tokens: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    env_rewards: list[float] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)
    env_step_s: float = 0.0
    handle: EnvHandle | None = None
    evaluation: bool = False

    def reset_record(self) -> None:
        self.turn = 0
        self.last_decode = None
        self.tokens, self.mask, self.logprobs, self.versions = [], [], [], []
        self.env_rewards, self.responses, self.env_step_s, self.handle = [], [], 0.0, None


def _seed(*parts) -> int:
    h = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFF_FFFF


class RolloutDriver:
    """Submits and advances trajectories; reports finished ones and drops with reasons."""

    def __init__(self, client: Client, cfg: TrainConfig, router: Router, stop_ids: list[int],
                 run_id: str = "run"):
        self.client, self.cfg, self.router, self.stop_ids = client, cfg, router, stop_ids
        self.run_id = run_id
        self.sampling = {t.name: SamplingParams(temperature=sc.temperature,
                                                max_new_tokens=sc.max_new_tokens)
                         for t in cfg.env_tasks for sc in [t.sampling or cfg.rollout.sampling]}
        # evaluation decodes greedily: the policy's best answer, not a sample
        self.eval_sampling = {name: SamplingParams(sp.temperature, sp.max_new_tokens, greedy=True)
                              for name, sp in self.sampling.items()}
        self.live: dict[int, TrajectoryState] = {}
        self.step_futures: dict[str, int] = {}  # env_step key -> trajectory id
        self.started = 0
        self.eval_started = 0
        self.eval_dropped: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self.drop_details: list[dict] = []
        self.truncated: Counter[str] = Counter()
        self.stage_submitted: Counter[str] = Counter()
        self._next_id = 0
        self.stopping = False
        self.closing: list[Future] = []

    # -- submission -------------------------------------------------------------------------
    def _submit(self, stage: Stage, adapter, fn, *args, worker: str, key: str,
                tag: Tag | None = None, **kwargs) -> Future:
        self.stage_submitted[stage.value] += 1
        return self.client.submit(
            adapter, fn, *args, key=key, workers=[worker], allow_other_workers=False,
            resources=demand(stage, tag), pure=False, **kwargs)

    def new_trajectory(self, group_id: str, task: EnvTaskConfig, seed: int,
                       evaluation: bool = False) -> Future:
        tid = self._next_id
        self._next_id += 1
        if evaluation:
            self.eval_started += 1
        else:
            self.started += 1
        st = TrajectoryState(tid, group_id, task, seed, evaluation=evaluation)
        self.live[tid] = st
        return self._start(st)

    def _start(self, st: TrajectoryState) -> Future:
        st.env_worker = self.router.choose(Tag.CPU_ENV)
        st.handle = EnvHandle(st.env_worker, f"{self.run_id}.{st.traj_id}.{st.attempt}")
        reset = self._submit(
            Stage.ENV_RESET, with_envs, env_reset, st.task.env, st.seed, st.handle.instance_id,
            self.cfg.policy.system_prompt, worker=st.env_worker,
            key=f"env_reset-{st.traj_id}-0-{st.attempt}")
        return self._submit_turn(st, reset)

    def _submit_turn(self, st: TrajectoryState, observation: Future) -> Future:
        """prefill -> decode -> response -> env_step for turn ``st.turn``."""
        suffix = f"{st.traj_id}-{st.turn}-{st.attempt}"
        # Decode stays on the worker holding the cache; prefill joins it when that worker can
        # prefill too (colocation), else goes to the least-loaded compute worker.
        st.decode_worker = self.router.choose(Tag.GPU_BANDWIDTH, prefer=st.decode_worker)
        st.prefill_worker = self.router.choose(Tag.GPU_COMPUTE, prefer=st.decode_worker)
        pre = self._submit(Stage.PREFILL, with_engine, prefill, st.last_decode, observation,
                           worker=st.prefill_worker, key=f"prefill-{suffix}")
        dec = self._submit(
            Stage.DECODE, with_engine_tokenizer, decode, pre, st.last_decode,
            params=(self.eval_sampling if st.evaluation else self.sampling)[st.task.name],
            stop_ids=self.stop_ids,
            max_context=self.cfg.policy.max_context,
            seed=_seed(self.cfg.seed, st.traj_id, st.turn, st.attempt),
            worker=st.decode_worker, key=f"decode-{suffix}")
        resp = self._submit(Stage.RESPONSE, plain, response_of, dec, worker=st.decode_worker,
                            key=f"response-{suffix}")
        step = self._submit(Stage.ENV_STEP, with_envs, env_step, observation, resp,
                            worker=st.env_worker, key=f"env_step-{suffix}")
        for w in {st.decode_worker, st.prefill_worker, st.env_worker}:
            self.router.started(w)
        st.last_decode = dec
        self.step_futures[step.key] = st.traj_id
        return step

    def _release(self, st: TrajectoryState) -> None:
        for w in {st.decode_worker, st.prefill_worker, st.env_worker}:
            self.router.finished(w)

    # -- completion -------------------------------------------------------------------------
    def on_step(self, fut: Future, obs: EnvObservation) -> tuple[Trajectory | None, Future | None]:
        """Handle a finished env_step and its result: returns (finished trajectory, next turn's
        future)."""
        st = self.live[self.step_futures.pop(fut.key)]
        self._release(st)
        s = obs.sample
        st.handle = obs.handle
        st.tokens += obs.consumed_ids + s.token_ids
        st.mask += [False] * len(obs.consumed_ids) + [True] * len(s.token_ids)
        st.logprobs += [0.0] * len(obs.consumed_ids) + s.logprobs
        st.versions += [-1] * len(obs.consumed_ids) + s.versions
        st.env_rewards.append(obs.reward)
        st.responses.append(s.text)
        st.env_step_s += obs.step_seconds
        st.turn += 1
        context_limited = s.context_full or (
            not obs.done
            and len(st.tokens) + len(obs.input_ids) + self.sampling[st.task.name].max_new_tokens
            > self.cfg.policy.max_context)
        if obs.done or context_limited:
            if context_limited and not obs.done:
                self.close_env(st)
            return self._finish(st, obs, context_limited), None
        if self.stopping and not st.evaluation:  # run over: this turn was the last
            self.close_env(st)
            self.drop(st, "run_ended")
            return None, None
        return None, self._submit_turn(st, fut)

    def _finish(self, st: TrajectoryState, obs: EnvObservation, context_limited: bool) -> Trajectory:
        del self.live[st.traj_id]
        truncated = context_limited or obs.truncated
        if context_limited:
            self.truncated["context"] += 1
        elif obs.truncated:
            self.truncated["max_turns"] += 1
        return Trajectory(
            traj_id=str(st.traj_id), group_id=st.group_id, env_name=st.task.name, seed=st.seed,
            token_ids=np.asarray(st.tokens, dtype=np.int64),
            loss_mask=np.asarray(st.mask, dtype=bool),
            behaviour_logprobs=np.asarray(st.logprobs, dtype=np.float32),
            versions=np.asarray(st.versions, dtype=np.int64), env_rewards=st.env_rewards,
            responses=st.responses, info=dict(obs.info), num_turns=st.turn,
            truncated=truncated, context_truncated=context_limited, attempt=st.attempt,
            success=bool(obs.info.get("success", False)),
            format_errors=int(obs.info.get("format_errors", 0)),
            env_step_s=st.env_step_s, evaluation=st.evaluation,
        )

    def on_error(self, fut: Future) -> tuple[Future | None, str | None]:
        """A turn failed (worker lost, task error). Restart the trajectory from a fresh
        environment while attempts remain, else drop it with the reason. Returns (new future,
        group id of a dropped trajectory)."""
        st = self.live[self.step_futures.pop(fut.key)]
        self._release(st)
        exc = fut.exception() if fut.status == "error" else RuntimeError(f"{fut.status}: result lost")
        reason = f"error:{type(exc).__name__}"
        logger.warning("trajectory %s attempt %d failed: %s", st.traj_id, st.attempt, exc)
        self.close_env(st)
        if st.attempt + 1 < self.cfg.rollout.max_attempts and (not self.stopping
                                                                or st.evaluation):
            st.attempt += 1
            st.reset_record()
            return self._start(st), None
        self.drop(st, reason, str(exc)[:200])
        return None, st.group_id

    def drop(self, st: TrajectoryState, reason: str, detail: str = "") -> None:
        self.live.pop(st.traj_id, None)
        if st.evaluation:  # evaluation episodes are accounted apart from training
            self.eval_dropped[reason] += 1
            return
        self.record_drop(st.traj_id, reason, detail)

    def record_drop(self, traj_id: int | str, reason: str, detail: str = "") -> None:
        """Count a dropped trajectory by reason (the first 100 are kept with details)."""
        self.dropped[reason] += 1
        if len(self.drop_details) < 100:
            self.drop_details.append({"trajectory": traj_id, "reason": reason, "detail": detail})

    @property
    def training_live(self) -> int:
        """Training trajectories rolling out (evaluation episodes excluded)."""
        return sum(not st.evaluation for st in self.live.values())

    def close_env(self, st: TrajectoryState) -> Future | None:
        """Close the live environment instance of an ended or dropped trajectory."""
        if st.handle is None:
            return None
        fut = self._submit(Stage.ENV_CLOSE, with_registry, env_close, st.handle,
                            worker=st.handle.worker,
                            key=f"env_close-{st.traj_id}-{st.turn}-{st.attempt}")
        self.closing.append(fut)  # held until done: a released future may never run
        return fut


def score_requests(trajs: list[Trajectory], reward_fns: dict[str, str],
                   run_id: str) -> list[ScoreRequest]:
    """JSON-able scoring requests; the idempotency key names the run, trajectory and attempt."""
    return [ScoreRequest(id=str(t.traj_id), idempotency_key=f"{run_id}/{t.traj_id}/{t.attempt}",
                         reward_fn=reward_fns[t.env_name],
                         env_name=t.env_name, env_rewards=t.env_rewards, responses=t.responses,
                         info=t.info) for t in trajs]


