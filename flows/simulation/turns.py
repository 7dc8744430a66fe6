"""Simulated turns: a trajectory's prefill, decode and environment step on the simulated
cluster, in cohorts as the rollout driver forms them.

A turn's placement is the flow's (:func:`flows.training.turn_placement.place_turn`) and its
shape the workload's (:func:`flows.training.workload.turn_shape`), both looked up on their
modules at call time. The KV cache moves over the link when prefill or decode changes engine;
each engine runs its share as continuous batching (:class:`resources.sim_engine.SimEngine`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flows.config import TrainConfig
from flows.simulation import environments
from flows.simulation.cluster import ControlPlane, SimCluster
from flows.simulation.settings import SimSettings
from flows.training import turn_placement, workload
from resources.pools import Tag
from resources.sim_engine import Clock

FALLBACK_PROMPT_TOKENS = 64  # an env task without a workload shape
FALLBACK_RESPONSE_TOKENS = 16


@dataclass(eq=False)
class SimTrajectory:
    """A rolling-out trajectory of the simulation: where it is and what it holds."""

    tid: int
    group_id: str
    env_task: Any
    seed: int
    turns: int
    attempt: int = 0
    turn: int = 0
    context: int = 0  # virtual tokens so far
    oldest: int | None = None
    env_worker: str | None = None
    decode_worker: str | None = None  # sticky decode worker
    kv_at: str | None = None  # the engine holding its KV
    shard: int = 0
    env_rngs: list[random.Random] = field(default_factory=list)  # its environment's draws
    failed: bool = False  # its environment raised during this turn
    cohort: dict | None = None  # the cohort of its turn in flight


class TurnRunner:
    """Ready turns out and through the cluster; ``on_turn(members)`` is called as a cohort's
    completion reaches the driver."""

    def __init__(self, cfg: TrainConfig, sim: SimSettings, clock: Clock, cluster: SimCluster,
                 control: ControlPlane,
                 on_turn: Callable[[list[SimTrajectory]], None]):
        self.cfg, self.sim, self.clock = cfg, sim, clock
        self.cluster, self.control, self.on_turn = cluster, control, on_turn
        self.lengths = turn_placement.ResponseLengths()
        self.env_latency = environments.env_latencies(cfg)
        self.generated = 0  # response tokens decoded

    def flush(self, ready: list[SimTrajectory]) -> None:
        """Every ready turn out, in cohorts of trajectories that share their workers (as
        RolloutDriver.flush forms them): one set of tasks per cohort through the scheduler, one
        completion per cohort to the driver, when its last member has stepped."""
        pool_workers = self.cluster.pool_workers
        open_cohorts: dict[tuple, dict] = {}
        size = self.cfg.rollout.cohort_max
        placed: dict[str, tuple] = {}  # simulate.group_placement: a group's plan this flush
        for t in ready:
            fresh = t.env_worker is None
            shape = workload.turn_shape(t.env_task.shape, self.cfg.seed, t.tid, t.turn,
                                        t.attempt)
            prompt = shape.prompt_tokens if shape is not None else FALLBACK_PROMPT_TOKENS
            response = shape.response_tokens if shape is not None else FALLBACK_RESPONSE_TOKENS
            if self.sim.group_placement and t.group_id in placed:
                env_worker, plan = placed[t.group_id]
                t.env_worker = t.env_worker or env_worker
            else:
                if fresh:
                    t.env_worker = pool_workers.choose(Tag.CPU_ENV)
                plan = turn_placement.place_turn(
                    pool_workers, self.cluster.turn_devices, t.decode_worker, t.kv_at, prompt,
                    t.context, self.lengths.expected(t.env_task.name))
                placed[t.group_id] = (t.env_worker, plan)
            for w in {plan.decode_worker, plan.prefill_worker, t.env_worker}:
                pool_workers.started(w)
            key = (fresh, t.env_task.name if self.cfg.rollout.cohort_per_env_task else None,
                   t.env_worker, plan.prefill_worker, plan.decode_worker, t.shard)
            cohort = open_cohorts.get(key)
            if cohort is None or len(cohort["members"]) >= size:
                # a new cohort: its tasks reach the workers once its shard's scheduler has
                # placed them
                n_tasks = 3 + fresh
                for stage in ("prefill", "decode", "env_step") + (("env_reset",) if fresh else ()):
                    self.control.tasks[stage] += 1
                cohort = {"members": [], "left": 0,
                          "wait": self.control.schedulers[t.shard].delay(n_tasks)}
                open_cohorts[key] = cohort
            cohort["members"].append(t)
            cohort["left"] += 1
            t.cohort = cohort
            self.clock.after(cohort["wait"] + self.sim.turn_overhead_s, self._start, t,
                             plan, prompt, response, fresh)

    def _slots(self, worker: str, tag: Tag):
        return self.cluster.worker_slots[(worker, tag)]

    def _start(self, t: SimTrajectory, plan, prompt: int, response: int, fresh: bool) -> None:
        if fresh:
            t.env_rngs = [lat.stream(t.seed) for lat in self.env_latency[t.env_task.name]]
            self._slots(t.env_worker, Tag.CPU_ENV).acquire(
                self._env_call, t, False, self._prefill, (t, plan, prompt, response))
        else:
            self._prefill(t, plan, prompt, response)

    def _env_call(self, t: SimTrajectory, step: bool, then, args) -> None:
        seconds, failed = environments.call_time(self.env_latency[t.env_task.name], t.env_rngs,
                                                 step, self.sim.local_env_step_s)
        if failed:  # the call raises after its latency
            t.failed = True
        seconds *= self.cluster.env_slowdown.get(t.env_worker, 1.0)
        self.clock.after(seconds, self._env_done, t, then, args)

    def _env_done(self, t: SimTrajectory, then, args) -> None:
        self._slots(t.env_worker, Tag.CPU_ENV).release()
        if t.failed and then is self._prefill:  # a failed reset ends the turn there
            self._turn_done(t, args[1])
            return
        then(*args)

    def _prefill(self, t: SimTrajectory, plan, prompt: int, response: int) -> None:
        self._slots(plan.prefill_worker, plan.prefill_tag).acquire(
            self._prefill_run, t, plan, prompt, response)

    def _prefill_run(self, t: SimTrajectory, plan, prompt: int, response: int) -> None:
        engine = self.cluster.engines[plan.prefill_worker]
        move = engine.device.kv_transfer_time(t.context) if (
            t.kv_at is not None and t.kv_at != plan.prefill_worker) else 0.0

        def done() -> None:
            self._slots(plan.prefill_worker, plan.prefill_tag).release()
            self._decode(t, plan, prompt, response)

        self.clock.after(move, engine.submit, True, prompt, t.context, done)

    def _decode(self, t: SimTrajectory, plan, prompt: int, response: int) -> None:
        self._slots(plan.decode_worker, plan.decode_tag).acquire(
            self._decode_run, t, plan, prompt, response)

    def _decode_run(self, t: SimTrajectory, plan, prompt: int, response: int) -> None:
        engine = self.cluster.engines[plan.decode_worker]
        move = 0.0
        if plan.prefill_worker != plan.decode_worker:
            moved = prompt
            if t.kv_at is not None and t.kv_at != plan.decode_worker:
                moved = t.context + prompt
            move = engine.device.kv_transfer_time(moved)
        t.oldest = engine.version if t.oldest is None else min(t.oldest, engine.version)
        context = t.context + prompt

        def done() -> None:
            self._slots(plan.decode_worker, plan.decode_tag).release()
            t.context = context + response
            self.generated += response
            t.kv_at = t.decode_worker = plan.decode_worker
            self.lengths.record(t.env_task.name, response)
            self._slots(t.env_worker, Tag.CPU_ENV).acquire(
                self._env_call, t, True, self._turn_done, (t, plan))

        self.clock.after(move, engine.submit, False, response, context, done)

    def _turn_done(self, t: SimTrajectory, plan) -> None:
        cohort = t.cohort
        cohort["left"] -= 1
        if cohort["left"]:
            return  # the cohort's env_step returns when its last member has stepped
        for m in cohort["members"]:
            for w in {plan.decode_worker, plan.prefill_worker, m.env_worker}:
                self.cluster.pool_workers.finished(w)
        # the completion reaches the driver through its queue
        self.clock.after(self.control.driver_of(t.shard).delay(), self.on_turn,
                         cohort["members"])
