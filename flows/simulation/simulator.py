"""A RollArc run as a discrete-event simulation: the flow's own decisions on a virtual clock.

The **decisions** are not re-implemented. Admission, the mix draw, the batch cut, the group
collector and staleness, and the end of the run are the run core's
(:class:`flows.training.core.RunCore`, which :class:`flows.training.run.TrainingRun` carries out
on Dask). The choice of worker in a pool (:class:`~flows.training.orchestration.PoolWorkers`), per-turn placement
(:func:`flows.training.turn_placement.place_turn`), the affinity routing of pools
(:func:`flows.training.launch.pool_router`), the shard a group goes to
(:func:`~flows.training.orchestration.pick_shard`), the smallest rollout pool
(:func:`flows.training.shards.rollout_slots`), the trajectory state machine
(:class:`flows.training.lifecycle.TrajectoryLedger`) and the turn shapes
(:func:`flows.training.workload.turn_shape`) are the very ones the Dask flow calls; they are
looked up on their modules at call time, so replacing one (a test does) changes the simulation.

What is simulated, and with what: the cluster, its device times and its control plane
(:mod:`flows.simulation.cluster`), the turns (:mod:`flows.simulation.turns`), the environments
(:mod:`flows.simulation.environments`), reward scoring on Lambda
(:mod:`flows.simulation.reward`); here, the trainer: a train step over the batch's virtual
tokens, the weight export and one load per inference engine (a pause of that engine);
monolithic placement time-shares every engine for the train step.

Why an event loop of its own rather than SimPy: the flow's decisions are event handlers (a turn
came back, a batch was scored, a step was trained), so the simulation is callbacks on a heap, as
the flow is handlers on futures; SimPy's processes (generators) would add a dependency and a
second style for nothing. Per event the two cost about the same (0.78 us for this heap against
0.85 us for a SimPy timeout, measured with SimPy 4.1.2 on this machine); what keeps an hour of
3,000+ GPUs under a minute is few events per turn (an engine's running batch is a count and a
context sum, not one event per decode step).
Deterministic for a seed: every draw comes from seeded ``random.Random`` streams and ties on
the clock break by insertion order.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from statistics import median
from typing import Any

import numpy as np

from flows.config import TrainConfig
from flows.simulation.cluster import ControlPlane, SimCluster
from flows.simulation.environments import turn_counts
from flows.simulation.reward import RewardScoring
from flows.simulation.settings import SimSettings
from flows.simulation.turns import SimTrajectory, TurnRunner
from flows.training import lifecycle, orchestration, shards
from flows.training.core import Publish, RunCore
from resources import emulated
from resources.sim_engine import Clock, SimEngine
from tasks.records import Trajectory


@dataclass
class SimResult:
    """What one simulated run measured (times in simulated seconds)."""

    system: str
    gpus: int
    cost_per_hour: float
    elapsed_s: float
    steps: int
    step_times: list[float]
    busy: dict[str, float]  # per pool: engines' busy share
    trainer_busy: float
    trajectories: dict[str, Any]
    staleness_mean: float
    turns: int
    tasks: dict[str, int]  # submitted, by stage
    driver_events: int
    scheduler_busy: list[float]  # per shard: share of the training its scheduler was serving
    driver_busy: list[float]  # likewise, its driver
    generated_tokens: int
    reward: dict[str, int]  # Lambda invocations, throttles, cold starts
    events: int  # simulator events processed
    tasks_per_s: float  # scheduler tasks per second while training (to the last step)
    driver_events_per_s: float  # completions the driver handled per second, likewise
    wall_s: float = 0.0  # real seconds the simulation took

    @property
    def step_s(self) -> float:
        return median(self.step_times) if self.step_times else float("nan")

    @property
    def steady_step_s(self) -> float:
        """Mean time per step after the first (which holds the start-up)."""
        if len(self.step_times) < 2:
            return float("nan")
        return sum(self.step_times[1:]) / (len(self.step_times) - 1)

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "step_times"}
        return d | {"step_s": self.step_s, "steady_step_s": self.steady_step_s,
                    "step_times": [round(s, 3) for s in self.step_times]}


class Simulation:
    """One run of ``cfg`` on the simulated cluster (see the module docstring)."""

    def __init__(self, cfg: TrainConfig, sim: SimSettings | None = None, system: str = "rollarc"):
        self.cfg, self.sim, self.system = cfg, sim or SimSettings(), system
        self.clock = Clock()
        seed = self.sim.seed if self.sim.seed is not None else cfg.seed
        self.rng = random.Random(f"sim/{seed}")
        # the run's decisions: the same core as the Dask flow's (a run of ``hours`` trains
        # until the clock runs out)
        self.core = RunCore(cfg, max_steps=10**9 if self.sim.hours else None)
        self.ledger = self.core.ledger
        self.cluster = SimCluster(cfg, self.clock)
        self.core.pool_slots = shards.rollout_slots(self.cluster)
        self.control = ControlPlane(self.clock, self.sim)
        self.turn_runner = TurnRunner(cfg, self.sim, self.clock, self.cluster, self.control,
                                      self._on_turn)
        self.reward = RewardScoring(cfg, self.sim, self.clock, self.cluster, self.control,
                                    self.ledger, self._on_scored)
        self.turn_counts = turn_counts(cfg, self.sim)
        self.ready: list[SimTrajectory] = []
        self.next_id = 0
        self.step_ends: list[float] = []
        self.staleness: list[int] = []
        self.trainer_busy_s = 0.0
        self.turns_done = 0
        self._shard_load = [0] * self.sim.shards  # trajectories rolling out, per shard
        self._in_tick = False
        # at the last step: (time, tasks, driver events, scheduler and driver busy seconds)
        self._rates_at: tuple | None = None

    @property
    def version(self) -> int:
        return self.core.version

    # -- the recipe ------------------------------------------------------------------------------
    def run(self) -> SimResult:
        t0 = time.perf_counter()
        for e in self.cluster.engines.values():  # the initial weights, everywhere
            self.core.loads_in_flight += 1
            e.pause(e.device.weight_broadcast_time(), self._loaded_initial)
        limit = self.sim.hours * 3600 if self.sim.hours else float("inf")
        # to the end of the clock (hours), or until the last step is trained and the turns in
        # flight have ended (as the flow's loop ends: nothing left in flight)
        self.clock.run(limit, lambda: False)
        self.core.end()  # as the flow ends: what is left was not trained
        return self._result(time.perf_counter() - t0)

    def _loaded_initial(self) -> None:
        self.core.loads_in_flight -= 1
        self._tick()

    def _tick(self) -> None:
        """The driver's loop body: rewards out, a batch cut, admission, ready turns out."""
        if self._in_tick:
            return
        self._in_tick = True
        try:
            self.reward.schedule_flush()
            self._maybe_train()
            self._admit()
            ready, self.ready = self.ready, []
            self.turn_runner.flush(ready)
        finally:
            self._in_tick = False

    def _admit(self) -> None:
        slots = self.core.pool_slots // self.sim.shards
        for group in self.core.admit():
            # the shard with the most free room, as the flow picks (its engines are shared
            # here: each shard gets an equal part of the slots)
            shard = orchestration.pick_shard(self._shard_load, [slots] * self.sim.shards)
            env_task = group.env_task
            for _ in range(env_task.group_size):
                tid, self.next_id = self.next_id, self.next_id + 1
                t = SimTrajectory(tid, group.group_id, env_task, group.seed,
                                  self.turn_counts[env_task.name].sample(self.rng), shard=shard)
                self._shard_load[shard] += 1
                self.ledger.admit(tid)
                self.ledger.transition(tid, lifecycle.TrajState.ROLLING_OUT)
                self.ready.append(t)

    # -- a turn came back ------------------------------------------------------------------------
    def _on_turn(self, members: list[SimTrajectory]) -> None:
        self.control.driver_events += 1
        for t in members:
            self.turns_done += 1
            t.turn += 1
            if t.failed:  # its environment raised: a fresh one, or dropped (rollout_error)
                t.failed = False
                self._restart_or_drop(t)
            elif t.turn >= t.turns or self.core.stopping:
                if t.turn >= t.turns:  # it ended (the driver's length estimates count it)
                    self.turn_runner.placer.lengths.finished(t.env_task.name, t.turn)
                self._finished(t)
            else:
                self.ready.append(t)
        self._tick()

    def _restart_or_drop(self, t: SimTrajectory) -> None:
        self.turn_runner.release(t)
        # as the flow: no restart once the run is ending
        if t.attempt + 1 >= self.cfg.rollout.max_attempts or self.core.stopping:
            self._shard_load[t.shard] -= 1
            self.ledger.drop(t.tid, lifecycle.DropReason.ROLLOUT_ERROR, "env crash")
            self.core.member_lost(t.group_id)
            return
        t.attempt += 1
        t.turn = t.context = t.responses = 0
        t.env_worker = t.kv_at = t.decode_worker = t.oldest = None
        self.ready.append(t)

    def _finished(self, t: SimTrajectory) -> None:
        self.turn_runner.release(t)
        self._shard_load[t.shard] -= 1
        self.ledger.transition(t.tid, lifecycle.TrajState.AWAITING_SCORE)
        oldest = self.version if t.oldest is None else t.oldest
        self.reward.queue(Trajectory(
            traj_id=str(t.tid), group_id=t.group_id, env_name=t.env_task.name, seed=t.seed,
            token_ids=np.zeros(1, np.int64), loss_mask=np.ones(1, bool),
            behaviour_logprobs=np.zeros(1, np.float32), versions=np.array([oldest]),
            env_rewards=[], responses=[], info={}, num_turns=t.turn, truncated=False,
            context_truncated=False, virtual_tokens=t.context,
            virtual_response_tokens=t.responses))

    def _on_scored(self, batch: list[Trajectory]) -> None:
        self.control.driver_events += 1
        for traj in batch:
            traj.reward = self.rng.random()  # rewards order nothing: groups complete by time
            self.ledger.transition(int(traj.traj_id), lifecycle.TrajState.IN_GROUP)
            self.core.scored(traj)
        self._tick()

    # -- training --------------------------------------------------------------------------------
    def _maybe_train(self) -> None:
        batch = self.core.cut()
        if batch is None:
            return
        self.staleness.extend(batch.staleness)
        trainer = self.cluster.trainer_device
        seconds = self._train_seconds(trainer, batch.samples)
        self.control.tasks["train_step"] += 1
        if self.cluster.colocated:  # every engine yields its GPUs for the train step
            for e in self.cluster.engines.values():
                e.pause(seconds, training=True)
        seconds += self.sim.train_overhead_s
        export = trainer.weight_broadcast_time()
        self.trainer_busy_s += seconds + export
        self.clock.after(self.control.schedulers[0].delay() + seconds + export, self._trained)

    def _train_seconds(self, trainer, samples) -> float:
        """The device model's train step with the trainer's epochs and minibatches (as the
        emulated trainer times it)."""
        hp = self.cfg.trainer.hparams
        return emulated.train_step_seconds(trainer, samples, hp.ppo_epochs, hp.minibatches)

    def _trained(self) -> None:
        self.control.driver_events += 1
        instructions = self.core.trained(self.version + 1, self.clock.now)
        self.step_ends.append(self.clock.now)
        # rates are over the training, not the drain after its last step
        self._rates_at = self.control.rates()
        # StopRollout: the core stops admitting, and a trajectory's turn in flight is its last;
        # checkpoints are not simulated
        engines = self.cluster.engines
        for ins in instructions:
            if isinstance(ins, Publish):
                self.control.tasks["publish_weights"] += 1
                # the publish and one load per engine
                self.control.schedulers[0].delay(1 + len(engines))
                for e in engines.values():
                    self.core.loads_in_flight += 1
                    self.control.tasks["load_weights"] += 1
                    e.pause(e.device.weight_broadcast_time(),
                            lambda e=e, v=ins.version: self._loaded(e, v))
        self._tick()

    def _loaded(self, engine: SimEngine, version: int) -> None:
        self.control.driver_events += 1
        engine.version = version
        self.core.loads_in_flight -= 1
        self._tick()

    # -- report ----------------------------------------------------------------------------------
    def _result(self, wall_s: float) -> SimResult:
        elapsed = self.clock.now
        ends = [0.0] + self.step_ends
        steps = [b - a for a, b in zip(ends, ends[1:], strict=False)]
        accounts = self.ledger.summary()
        until, tasks, events, sched_s, driver_s = self._rates_at or self.control.rates()
        return SimResult(
            system=self.system, gpus=self.cluster.gpus, cost_per_hour=self.cluster.cost,
            elapsed_s=elapsed, steps=self.version, step_times=steps,
            busy=self.cluster.busy_by_pool(elapsed),
            trainer_busy=self.trainer_busy_s / max(elapsed, 1e-9),
            trajectories={k: accounts[k] for k in ("started", "trained", "dropped")},
            staleness_mean=sum(self.staleness) / max(len(self.staleness), 1),
            turns=self.turns_done, tasks=dict(self.control.tasks),
            driver_events=self.control.driver_events,
            scheduler_busy=[b / max(until, 1e-9) for b in sched_s],
            driver_busy=[b / max(until, 1e-9) for b in driver_s],
            generated_tokens=self.turn_runner.generated, reward=dict(self.reward.calls),
            events=self.clock.events,
            tasks_per_s=tasks / max(until, 1e-9), driver_events_per_s=events / max(until, 1e-9),
            wall_s=wall_s)


def simulate(cfg: TrainConfig, sim: SimSettings | None = None, system: str = "rollarc"
             ) -> SimResult:
    """Simulate one run of ``cfg``."""
    return Simulation(cfg, sim, system).run()
