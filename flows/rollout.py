"""Trajectory graphs: each trajectory is a dynamic Dask graph, one turn's sub-graph at a time.

A turn is ``prefill -> decode -> env_step``, submitted together with futures as arguments, so
the cache handle moves worker to worker (decode -> prefill -> decode) and never through the
driver; the driver waits only for env_step's small result, and hands it by value to the next
turn's tasks (one dependency fetch less per turn). env_step extracts the response from the
decode output itself (``Stages.response``): three tasks per turn, not four. Keys are
``"{stage}-{trajectory}-{turn}-{attempt}"``: the dashboard groups by stage and a restarted
trajectory never picks up an old key's result. The functions submitted are those of a
:class:`tasks.stages.Stages`; every change of a trajectory's state goes through the
:class:`flows.lifecycle.TrajectoryLedger`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from distributed import Client, Future, wait

from flows.config import EnvTaskConfig, TrainConfig
from flows.dispatch import ResponseLengths, TurnPlan, plan_turn
from flows.episode import RolloutRecord, sampling_params, turn_ends
from flows.lifecycle import DropReason, RunFailing, TrajectoryLedger, TrajState
from flows.orchestration import Router, decode_seed
from flows.workload import turn_shape
from resources.device_model import DeviceModel
from resources.pools import Stage, Tag, demand
from resources.worker import with_backend, with_envs, with_registry
from tasks.env_steps import env_step_after_decode
from tasks.records import EnvHandle, EnvObservation, SamplingParams, Trajectory, TurnShape
from tasks.stages import Stages

logger = logging.getLogger(__name__)


@dataclass
class TurnOutcome:
    # turns submitted: the trajectory's next one, or with rollout.env_barrier every turn held
    # at the barrier once the last of the batch arrived
    next_turns: list[Future] = field(default_factory=list)
    finished: tuple[RolloutRecord, Trajectory] | None = None  # the trajectory finished...
    dropped: RolloutRecord | None = None  # ...or was dropped (its reason is in the ledger)


# evaluation episodes' trajectory ids start here (training ids count up from 0)
EVAL_ID_OFFSET = 10**9


class RolloutFailing(RunFailing):
    pass


class RolloutDriver:
    """Submits and advances trajectories; reports finished and dropped ones."""

    def __init__(self, client: Client, cfg: TrainConfig, router: Router,
                 ledger: TrajectoryLedger, stages: Stages, run_id: str = "run",
                 devices: dict[str, DeviceModel] | None = None):
        self.client, self.cfg, self.router, self.ledger = client, cfg, router, ledger
        # rollout.dispatch=length_aware: each inference worker's device model (None: split)
        self.devices = devices
        self.lengths = ResponseLengths()
        self.stages, self.run_id = stages, run_id
        self.sampling = sampling_params(cfg)
        # consecutive failed turns, retries included, before the run stops with the last error
        self.max_error_streak = 4 * max(cfg.rollout.max_in_flight, cfg.batch_trajectories())
        # evaluation decodes greedily: the policy's best answer, not a sample
        self.eval_sampling = {name: SamplingParams(sp.temperature, sp.max_new_tokens, greedy=True)
                              for name, sp in self.sampling.items()}
        self.live: dict[int, RolloutRecord] = {}
        self._by_step: dict[str, int] = {}  # env_step key -> trajectory id
        self.truncated: dict[str, int] = {"context": 0, "max_turns": 0}
        self.stage_submitted: dict[str, int] = {}
        self._next_id = 0
        # evaluation episodes take ids of their own, so that they never shift the training
        # trajectories' ids and with them their sampling seeds
        self._next_eval_id = EVAL_ID_OFFSET
        self._stopping = False
        self.error_streak = 0
        self._closing: list[Future] = []
        # per turn (submitted, answered) wall-clock times and the emulated waits within: the
        # benchmark subtracts the tasks' compute intervals to get the orchestration overhead
        self.turn_log: list[tuple[str, float, float, float]] = []
        self._turn_submitted: dict[int, float] = {}
        # rollout.env_barrier: training trajectories whose next turn waits for the others'
        self._held: list[tuple[RolloutRecord, EnvObservation]] = []

    @property
    def stopping(self) -> bool:
        return self._stopping

    def stop(self) -> None:
        """Training is over: every rolling-out training trajectory ends after its current turn
        (evaluation episodes run to their end)."""
        self._stopping = True

    # -- submission -------------------------------------------------------------------------
    def _submit(self, stage: Stage, adapter, fn, *args, worker: str, key: str,
                tag: Tag | None = None, **kwargs) -> Future:
        self.stage_submitted[stage.value] = self.stage_submitted.get(stage.value, 0) + 1
        return self.client.submit(
            adapter, fn, *args, key=key, workers=[worker], allow_other_workers=False,
            resources=demand(stage, tag), pure=False, **kwargs)

    def start(self, group_id: str, env_task: EnvTaskConfig, seed: int,
              eval_round: int | None = None) -> Future:
        """Admit a new trajectory and submit its first turn; the future is its env_step."""
        if eval_round is None:
            tid, self._next_id = self._next_id, self._next_id + 1
        else:
            tid, self._next_eval_id = self._next_eval_id, self._next_eval_id + 1
        rec = RolloutRecord(tid, group_id, env_task, seed, eval_round=eval_round)
        self.ledger.admit(rec.traj_id, rec.evaluation)
        self.live[rec.traj_id] = rec
        return self._start(rec)

    def _start(self, rec: RolloutRecord) -> Future:
        self.ledger.transition(rec.traj_id, TrajState.ROLLING_OUT)
        rec.env_worker = self.router.choose(Tag.CPU_ENV)
        rec.handle = EnvHandle(rec.env_worker, f"{self.run_id}.{rec.traj_id}.{rec.attempt}")
        reset = self._submit(
            Stage.ENV_RESET, with_envs, self.stages.env_reset, rec.env_task.env, rec.seed,
            rec.handle.instance_id, self.cfg.policy.system_prompt, worker=rec.env_worker,
            key=f"env_reset-{rec.traj_id}-0-{rec.attempt}")
        return self._submit_turn(rec, reset)

    def _submit_turn(self, rec: RolloutRecord, observation: Future | EnvObservation) -> Future:
        """prefill -> decode -> env_step for turn ``rec.turn``; ``observation`` is the reset's
        future or the last turn's result."""
        suffix = f"{rec.traj_id}-{rec.turn}-{rec.attempt}"
        st = self.stages
        shape = turn_shape(rec.env_task.shape, self.cfg.seed, rec.traj_id, rec.turn, rec.attempt)
        rec.last_shape = shape
        plan = self._plan(rec, observation, shape)
        rec.prefill_worker, rec.decode_worker = plan.prefill_worker, plan.decode_worker
        pre = self._submit(Stage.PREFILL, with_backend, st.prefill, rec.last_decode, observation,
                           shape=shape, worker=rec.prefill_worker, tag=plan.prefill_tag,
                           key=f"prefill-{suffix}")
        dec = self._submit(
            Stage.DECODE, with_backend, st.decode, pre, rec.last_decode,
            params=(self.eval_sampling if rec.evaluation else self.sampling)[rec.env_task.name],
            seed=decode_seed(self.cfg.seed, rec.traj_id, rec.turn, rec.attempt), shape=shape,
            worker=rec.decode_worker, tag=plan.decode_tag, key=f"decode-{suffix}")
        step = self._submit(Stage.ENV_STEP, with_envs, env_step_after_decode, st.env_step,
                            st.response, observation, dec, worker=rec.env_worker,
                            key=f"env_step-{suffix}")
        for w in {rec.decode_worker, rec.prefill_worker, rec.env_worker}:
            self.router.started(w)
        self._turn_submitted[rec.traj_id] = time.time()
        rec.last_decode = dec
        self._by_step[step.key] = rec.traj_id
        return step

    def _plan(self, rec: RolloutRecord, observation: Future | EnvObservation,
              shape: TurnShape | None) -> TurnPlan:
        """Where the turn's prefill and decode run (:mod:`flows.dispatch`)."""
        if self.devices is None:
            # decode stays on the worker holding the cache; prefill joins it when that worker
            # can prefill too (colocation), else goes to the least-loaded compute worker
            dec = self.router.choose(Tag.GPU_BANDWIDTH, prefer=rec.decode_worker)
            pre = self.router.choose(Tag.GPU_COMPUTE, prefer=dec)
            return TurnPlan(pre, dec, Tag.GPU_COMPUTE, Tag.GPU_BANDWIDTH)
        if shape is not None:
            prompt = shape.prompt_tokens
        elif isinstance(observation, EnvObservation):
            prompt = len(observation.input_ids)
        else:
            prompt = 0  # the reset's prompt is not known here; the first turn splits
        context = rec.virtual_tokens if rec.env_task.shape is not None else len(rec.tokens)
        return plan_turn(self.devices, self.router.load,
                         self.router.workers_by_tag[str(Tag.GPU_COMPUTE)],
                         self.router.workers_by_tag[str(Tag.GPU_BANDWIDTH)],
                         rec.decode_worker if rec.last_decode is not None else None,
                         rec.decode_worker, prompt, context,
                         self.lengths.expected(rec.env_task.name) if prompt else None)

    def _release(self, rec: RolloutRecord) -> None:
        for w in {rec.decode_worker, rec.prefill_worker, rec.env_worker}:
            self.router.finished(w)

    # -- completion -------------------------------------------------------------------------
    def on_step(self, fut: Future, obs: EnvObservation) -> TurnOutcome:
        """A turn's env_step finished with ``obs``."""
        rec = self.live[self._by_step.pop(fut.key)]
        self._release(rec)
        self.error_streak = 0
        shape = rec.last_shape
        self.lengths.record(rec.env_task.name, obs.sample.virtual_tokens - shape.prompt_tokens
                            if shape is not None else len(obs.sample.token_ids))
        remote = float(obs.info.get("remote_latency_s", 0.0)) * self.cfg.engine.time_scale
        self.turn_log.append((f"{rec.traj_id}-{rec.turn}-{rec.attempt}",
                              self._turn_submitted.pop(rec.traj_id), time.time(),
                              obs.sample.emulated_wait_s + remote))
        rec.record_turn(obs)
        over, context_limited = turn_ends(rec, obs, self.sampling[rec.env_task.name]
                                          .max_new_tokens, self.cfg.policy.max_context)
        if over:
            if context_limited and not obs.done:
                self.close_env(rec)
            if context_limited:
                self.truncated["context"] += 1
            elif obs.truncated:
                self.truncated["max_turns"] += 1
            del self.live[rec.traj_id]
            self.ledger.transition(rec.traj_id, TrajState.EVALUATED if rec.evaluation
                                   else TrajState.AWAITING_SCORE)
            return TurnOutcome(finished=(rec, rec.to_trajectory(obs, context_limited)),
                               next_turns=self._release_barrier())
        if self._stopping and not rec.evaluation:  # run over: this turn was the last
            self.close_env(rec)
            self._drop(rec, DropReason.RUN_ENDED)
            return TurnOutcome(dropped=rec, next_turns=self._release_barrier())
        if self.cfg.rollout.env_barrier and not rec.evaluation:
            self._held.append((rec, obs))
            return TurnOutcome(next_turns=self._release_barrier())
        return TurnOutcome(next_turns=[self._submit_turn(rec, obs)])

    def _release_barrier(self) -> list[Future]:
        """Batch-level environment handling (a baseline): the held turns go on together once
        no training trajectory has a turn in flight."""
        if not self._held or any(not self.live[t].evaluation for t in self._by_step.values()):
            return []
        held, self._held = self._held, []
        return [self._submit_turn(rec, fut) for rec, fut in held]

    def on_error(self, fut: Future) -> TurnOutcome:
        """A turn failed (worker lost, task error). Restart the trajectory from a fresh
        environment while attempts remain, else drop it with the reason."""
        rec = self.live[self._by_step.pop(fut.key)]
        self._release(rec)
        self._turn_submitted.pop(rec.traj_id, None)
        exc = fut.exception() if fut.status == "error" else RuntimeError(
            f"{fut.status}: result lost")
        logger.warning("trajectory %s attempt %d failed: %s", rec.traj_id, rec.attempt, exc)
        self.close_env(rec)
        self.error_streak += 1
        if self.error_streak >= self.max_error_streak:
            # every turn failing (an environment that cannot start, ...) would spin the run
            raise RolloutFailing(f"the last {self.error_streak} turns failed, the last with "
                                 f"{type(exc).__name__}: {str(exc)[:300]}")
        if rec.attempt + 1 < self.cfg.rollout.max_attempts and (not self._stopping
                                                                 or rec.evaluation):
            rec.attempt += 1
            rec.reset_record()
            return TurnOutcome(next_turns=[self._start(rec)])
        self._drop(rec, DropReason.ROLLOUT_ERROR, f"{type(exc).__name__}: {str(exc)[:200]}")
        return TurnOutcome(dropped=rec, next_turns=self._release_barrier())

    def _drop(self, rec: RolloutRecord, reason: DropReason, detail: str = "") -> None:
        del self.live[rec.traj_id]
        self.ledger.drop(rec.traj_id, reason, detail)

    def close_env(self, rec: RolloutRecord) -> Future | None:
        """Close the live environment instance of an ended or dropped trajectory."""
        if rec.handle is None:
            return None
        fut = self._submit(Stage.ENV_CLOSE, with_registry, self.stages.env_close, rec.handle,
                           worker=rec.handle.worker,
                           key=f"env_close-{rec.traj_id}-{rec.turn}-{rec.attempt}")
        self._closing.append(fut)  # held until done: a released future may never run
        return fut

    def prune_closing(self) -> None:
        """Forget closes that ran; those aimed at a lost worker must not stall the run."""
        self._closing = [f for f in self._closing if not f.done()]

    def wait_closing(self, timeout: float = 60) -> None:
        try:
            wait(self._closing, timeout=timeout)
        except TimeoutError:
            logger.warning("%d environment closes did not finish", len(self._closing))
