"""Simulated turns: a trajectory's env reset, prefill, decode and environment step on the
simulated cluster, in cohorts as the rollout driver submits them.

A turn's placement is the flow's (:func:`flows.training.turn_placement.place_turn`) and its
shape the workload's (:func:`flows.training.workload.turn_shape`), both looked up on their
modules at call time. The KV cache moves over the link when prefill or decode changes engine;
each engine runs its share as continuous batching (:class:`resources.sim_engine.SimEngine`).

Cohorts behave as :mod:`tasks.cohort` runs them: the turns ready at one flush on the same
workers go as one task per stage (``rollout.cohort_max`` members at most, 1: a task per
trajectory), each task holding one slot of its worker's resource while it runs and its members
working side by side inside it. With ``rollout.cohort_barrier`` a stage's task returns when its
last member is done and the next stage starts only then. Without it, a stage's task returns once
a member is done and either no other finished within ``rollout.cohort_grace_s`` or the first one
done has waited ``HOLD_FRACTION`` of its stage time (at least twice the grace); the members
still running go on in the background, ride through the later stages untouched, and come back
to the driver, which continues them at its next flush with a ``collect`` on that stage's worker
(under the same rule) and the stages after it. A decode leaves the trajectory's KV held on its
engine while it waits for its environment, and the next turn there resumes it, as the emulated
backend does (:class:`resources.sim_engine.SimEngine`'s ``hold`` and ``resume``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flows.config import TrainConfig
from flows.simulation import environments
from flows.simulation.calibration import turn_hops
from flows.simulation.cluster import ControlPlane, SimCluster
from flows.simulation.settings import SimSettings
from flows.training import turn_placement, workload
from flows.training.turn_placement import TurnPlan
from resources.pools import Stage, Tag
from resources.sim_engine import Clock
from tasks.cohort import HOLD_FRACTION

FALLBACK_PROMPT_TOKENS = 64  # an env task without a workload shape
FALLBACK_RESPONSE_TOKENS = 16
STAGES = (Stage.ENV_RESET, Stage.PREFILL, Stage.DECODE, Stage.ENV_STEP)  # a turn's, in order


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
    responses: int = 0  # of them, decoded (the positions the loss reads)
    oldest: int | None = None
    env_worker: str | None = None
    decode_worker: str | None = None  # sticky decode worker
    kv_at: str | None = None  # the engine holding its KV
    kv_key: tuple | None = None  # the key its KV is held under there while it waits
    shard: int = 0
    env_rngs: list[random.Random] = field(default_factory=list)  # its environment's draws
    failed: bool = False  # its environment raised during this turn
    prompt: int = 0  # this turn's new tokens
    response: int = 0  # and the tokens it decodes
    task: StageTask | None = None  # the stage task waiting for its work, if any
    done_in_background: bool = False  # its stage's work ended after its task returned


@dataclass(eq=False)
class SimCohort:
    """The members of one turn submission (a new turn, or a continuation) and their workers."""

    members: list[SimTrajectory]
    plan: TurnPlan
    env_worker: str
    shard: int
    deferred: dict[StageTask, list[SimTrajectory]] = field(default_factory=dict)

    def worker(self, stage: Stage) -> tuple[str, Tag]:
        if stage is Stage.PREFILL:
            return self.plan.prefill_worker, self.plan.prefill_tag
        if stage is Stage.DECODE:
            return self.plan.decode_worker, self.plan.decode_tag
        return self.env_worker, Tag.CPU_ENV


@dataclass(eq=False)
class StageTask:
    """One stage's Dask task for some of a cohort's members (or a ``collect`` of members a
    stage left running), from the moment it holds its slot."""

    stage: Stage
    cohort: SimCohort
    pending: dict[SimTrajectory, None]  # an ordered set: the members still working
    done: list[SimTrajectory]
    started: float = 0.0
    deadline: float | None = None  # set by the first member done
    finishes: int = 0
    returned: bool = False


class TurnRunner:
    """Ready turns out and through the cluster; ``on_turn(members)`` is called as a submission's
    answer reaches the driver, with the members whose turn ended (a member a stage left running
    is continued at the next :meth:`flush`)."""

    def __init__(self, cfg: TrainConfig, sim: SimSettings, clock: Clock, cluster: SimCluster,
                 control: ControlPlane,
                 on_turn: Callable[[list[SimTrajectory]], None]):
        self.cfg, self.sim, self.clock = cfg, sim, clock
        self.cluster, self.control, self.on_turn = cluster, control, on_turn
        # the rollout driver's turn placement, over the simulated workers' device models
        self.placer = turn_placement.TurnPlacer(cfg, cluster.turn_devices)
        self.env_latency = environments.env_latencies(cfg)
        self.generated = 0  # response tokens decoded
        self.in_flight = 0  # trajectories with a turn submitted and not yet answered
        self.in_env = 0  # ... of those, inside an environment call (holding no core)
        rollout = cfg.rollout
        # the grace is wall seconds; the clock counts emulated ones
        self.grace_s = (None if rollout.cohort_barrier
                        else rollout.cohort_grace_s / cfg.engine.time_scale)
        self._resumes: dict[StageTask, list[SimTrajectory]] = {}
        self._work = {Stage.ENV_RESET: self._reset, Stage.PREFILL: self._prefill,
                      Stage.DECODE: self._decode, Stage.ENV_STEP: self._step}

    # -- submission ------------------------------------------------------------------------------
    def flush(self, ready: list[SimTrajectory]) -> None:
        """The continuations of members left running, then every ready turn in cohorts of
        trajectories that share their workers (as RolloutDriver.flush forms them)."""
        resumes, self._resumes = self._resumes, {}
        for task, members in resumes.items():
            c = task.cohort
            self._submit(SimCohort(members, c.plan, c.env_worker, c.shard), task.stage,
                         collect=True)
        pool_workers = self.cluster.pool_workers
        groups: dict[tuple, list[tuple[SimTrajectory, TurnPlan]]] = {}
        placed: dict[str, tuple] = {}  # simulate.group_placement: a group's plan this flush
        for t in ready:
            fresh = t.env_worker is None
            shape = workload.turn_shape(t.env_task.shape, self.cfg.seed, t.tid, t.turn,
                                        t.attempt)
            t.prompt = shape.prompt_tokens if shape is not None else FALLBACK_PROMPT_TOKENS
            t.response = (shape.response_tokens if shape is not None
                          else FALLBACK_RESPONSE_TOKENS)
            if self.sim.group_placement and t.group_id in placed:
                env_worker, plan = placed[t.group_id]
                t.env_worker = t.env_worker or env_worker
            else:
                if fresh:
                    t.env_worker = pool_workers.choose(Tag.CPU_ENV)
                plan = self.placer.place(pool_workers, t.env_task.name, t.decode_worker,
                                         t.kv_at, t.prompt, t.context)
                placed[t.group_id] = (t.env_worker, plan)
            for w in {plan.decode_worker, plan.prefill_worker, t.env_worker}:
                pool_workers.started(w)
            key = (fresh, t.env_task.name if self.cfg.rollout.cohort_per_env_task else None,
                   t.env_worker, plan.prefill_worker, plan.prefill_tag, plan.decode_worker,
                   plan.decode_tag, t.shard)
            groups.setdefault(key, []).append((t, plan))
        size = self.cfg.rollout.cohort_max
        self.in_flight += sum(len(members) for members in groups.values())
        for key, members in groups.items():
            for i in range(0, len(members), size):
                chunk = members[i:i + size]
                first = chunk[0][0]
                self._submit(SimCohort([t for t, _ in chunk], chunk[0][1], first.env_worker,
                                       first.shard), Stage.ENV_RESET if key[0] else Stage.PREFILL,
                             collect=False)

    def _submit(self, cohort: SimCohort, first: Stage, collect: bool) -> None:
        """One submission's tasks through its shard's scheduler (``collect``: the first is a
        collect of members left running); its first stage starts once they are placed and the
        turn's time outside its tasks has passed."""
        stages = STAGES[STAGES.index(first):]
        for stage in stages:
            self.control.tasks[stage.value] += 1
        wait = self.control.schedulers[cohort.shard].delay(len(stages))
        # the host's orchestration (driver, scheduler, messages, the tiny policy's real work):
        # fixed, plus a share per turn in flight competing for the same cores (not those
        # waiting on their environment), more with each hand-off between worker processes
        # (flows.simulation.calibration)
        p = cohort.plan
        hops = turn_hops(cohort.env_worker, p.prefill_worker, p.decode_worker)
        overhead = self.sim.turn_overhead_s + (self.in_flight - self.in_env) * (
            self.sim.turn_overhead_per_turn_in_flight_s
            + self.sim.turn_overhead_per_hop_in_flight_s * hops)
        self.clock.after(wait + overhead, self._stage, cohort, first, cohort.members, collect)

    # -- a stage's task --------------------------------------------------------------------------
    def _stage(self, cohort: SimCohort, stage: Stage, members: list[SimTrajectory],
               collect: bool) -> None:
        worker, tag = cohort.worker(stage)
        self.cluster.worker_slots[(worker, tag)].acquire(self._stage_started, cohort, stage,
                                                         members, collect)

    def _stage_started(self, cohort: SimCohort, stage: Stage, members: list[SimTrajectory],
                       collect: bool) -> None:
        task = StageTask(stage, cohort, {}, [], started=self.clock.now)
        for m in members:
            if m.failed or (collect and m.done_in_background):
                task.done.append(m)  # a failed member passes through; a collected one is done
                m.done_in_background = False
            else:
                task.pending[m] = None
        if not task.pending:
            self._return(task)
            return
        for m in list(task.pending):
            m.task = task
            if not collect:
                self._work[stage](cohort, m)

    def _member_done(self, m: SimTrajectory) -> None:
        """``m``'s work in its stage ended: its task takes it, or it waits to be collected."""
        task, m.task = m.task, None
        if task is None or task.returned:
            m.done_in_background = True
            return
        task.pending.pop(m, None)
        task.done.append(m)
        task.finishes += 1
        if not task.pending:
            self._return(task)
        elif self.grace_s is not None:
            now = self.clock.now
            if task.deadline is None:  # tasks.cohort's rule: the first done waits at most this
                task.deadline = now + max(2 * self.grace_s, HOLD_FRACTION * (now - task.started))
            self.clock.after(max(0.0, min(self.grace_s, task.deadline - now)), self._grace_over,
                             task, task.finishes)

    def _grace_over(self, task: StageTask, finishes: int) -> None:
        """No member finished within the grace, or the first done has waited long enough."""
        if not task.returned and (task.finishes == finishes
                                  or self.clock.now >= task.deadline - 1e-12):
            self._return(task)

    def _return(self, task: StageTask) -> None:
        """The task's answer: its done members go on to the next stage; those still running
        ride along to the driver."""
        task.returned = True
        cohort = task.cohort
        worker, tag = cohort.worker(task.stage)
        self.cluster.worker_slots[(worker, tag)].release()
        if task.pending:
            cohort.deferred[task] = list(task.pending)
        i = STAGES.index(task.stage)
        if i + 1 < len(STAGES):
            self._stage(cohort, STAGES[i + 1], task.done, False)
        else:  # the answer reaches the driver through its queue
            self.clock.after(self.control.driver_of(cohort.shard).delay(), self._answered,
                             cohort, task.done)

    def _answered(self, cohort: SimCohort, ended: list[SimTrajectory]) -> None:
        for task, members in cohort.deferred.items():
            self._resumes.setdefault(task, []).extend(members)
        for m in ended:
            self.in_flight -= 1
            for w in {cohort.plan.decode_worker, cohort.plan.prefill_worker, m.env_worker}:
                self.cluster.pool_workers.finished(w)
            if not m.failed:  # the driver records the lengths of the turns that came back
                self.placer.lengths.record(m.env_task.name, m.response, m.prompt, first=m.turn == 0)
        self.on_turn(ended)

    # -- a member's work in each stage -----------------------------------------------------------
    def _env_call(self, t: SimTrajectory, step: bool) -> None:
        seconds, failed = environments.call_time(self.env_latency[t.env_task.name], t.env_rngs,
                                                 step, self.sim.local_env_step_s)
        if failed:  # the call raises after its latency; the later stages pass the member on
            t.failed = True
        seconds *= self.cluster.env_slowdown.get(t.env_worker, 1.0)
        self.in_env += 1
        self.clock.after(seconds, self._env_done, t)

    def _env_done(self, t: SimTrajectory) -> None:
        self.in_env -= 1
        self._member_done(t)

    def _reset(self, cohort: SimCohort, t: SimTrajectory) -> None:
        t.env_rngs = [lat.stream(t.seed) for lat in self.env_latency[t.env_task.name]]
        self._env_call(t, False)

    def _step(self, cohort: SimCohort, t: SimTrajectory) -> None:
        self._env_call(t, True)

    def release(self, t: SimTrajectory) -> None:
        """The KV ``t`` holds while it waits is freed (it ended, or starts over)."""
        if t.kv_key is not None and t.kv_at is not None:
            self.cluster.engines[t.kv_at].release(t.kv_key)
        t.kv_key = None

    def _move(self, to: str, tokens: int, sender: str) -> float:
        """KV of ``tokens`` tokens from ``sender``'s engine to ``to``'s, at the narrower end."""
        engines = self.cluster.engines
        return engines[to].device.kv_transfer_time(tokens, peer=engines[sender].device)

    def _prefill(self, cohort: SimCohort, t: SimTrajectory) -> None:
        # the conversation's KV comes from the engine that decoded the last turn; the prefill
        # takes over the KV held there when it runs there (resources.emulated's rule)
        plan = cohort.plan
        engine = self.cluster.engines[plan.prefill_worker]
        move = self._move(plan.prefill_worker, t.context, t.kv_at) if (
            t.kv_at is not None and t.kv_at != plan.prefill_worker) else 0.0
        self.clock.after(move, engine.submit, True, t.prompt, t.context,
                         lambda: self._member_done(t), None, t.kv_key)

    def _decode(self, cohort: SimCohort, t: SimTrajectory) -> None:
        plan = cohort.plan
        engine = self.cluster.engines[plan.decode_worker]
        move = 0.0
        if plan.prefill_worker != plan.decode_worker:  # the new tokens' KV crosses over ...
            moved = t.prompt
            if t.kv_at is not None and t.kv_at != plan.decode_worker:
                moved = t.context + t.prompt  # ... and the context's: this engine has none
            move = self._move(plan.decode_worker, moved, plan.prefill_worker)
        t.oldest = engine.version if t.oldest is None else min(t.oldest, engine.version)
        context = t.context + t.prompt
        key = (t.tid, t.attempt, t.turn)  # its KV stays held here while it waits

        def done() -> None:
            if t.kv_at is not None and t.kv_at != plan.decode_worker:
                self.release(t)  # the copy left behind is dropped
            t.context = context + t.response
            t.responses += t.response
            self.generated += t.response
            t.kv_at = t.decode_worker = plan.decode_worker
            t.kv_key = key
            self._member_done(t)

        self.clock.after(move, engine.submit, False, t.response, context, done, key, t.kv_key)
