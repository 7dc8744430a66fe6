"""A RollArc run as a discrete-event simulation: the flow's own decisions on a virtual clock.

What is simulated, and with what:

- **decisions** are not re-implemented: admission (:func:`flows.training.orchestration.admission_room`),
  the mix draw (:class:`~flows.training.orchestration.GroupDraw`), the batch cut
  (:func:`~flows.training.orchestration.groups_to_cut`), the group collector and staleness
  (:class:`~flows.training.orchestration.GroupCollector`), the router
  (:class:`~flows.training.orchestration.Router`), per-turn dispatch (:func:`flows.training.turn_placement.plan_turn`),
  the affinity routing of pools (:func:`flows.training.launch.pool_router`), the shard a group goes to
  (:func:`~flows.training.orchestration.pick_shard`), the trajectory state
  machine (:class:`flows.training.lifecycle.TrajectoryLedger`) and the turn shapes
  (:func:`flows.training.workload.turn_shape`) are the very ones the Dask flow calls; they are looked up
  on their modules at call time, so replacing one (a test does) changes the simulation;
- **device times** come from :class:`resources.device_model.DeviceModel`, the model of the
  ``emulated`` backend and the affinity router: each engine runs continuous batching the way
  :class:`resources.emulated.EmulatedEngine` does (FIFO admission under KV memory and
  ``max_seqs``, prefill chunks of ``chunk_tokens`` beside the running decodes as mixed steps,
  decode-only runs up to the next finish, cut at a step boundary by an arrival, weight loads
  and colocated training as pauses between steps), KV hand-offs wait on the link;
- **environments**: each worker's slots; reset and step latencies drawn from the env task's
  :class:`tasks.envs.latency.RemoteLatency` layers (``faults.env`` adds one) with their
  failure rates, from the same per-episode streams; a failed call restarts the trajectory or
  drops it (``rollout.max_attempts``); the
  number of turns of a trajectory (what the policy and environment decide) is drawn from
  ``simulate.turns``;
- **reward**: one score task per function and burst (as :mod:`flows.training.reward_bursts` cuts
  them), invocations of up to ``reward.batch_max`` at ``reward.concurrency`` per task, on a
  Lambda of ``simulate.lambda_concurrency`` concurrent instances (over it: a throttle and a
  retry), cold starts, and a reward model's prefill per invocation (``reward.judge``);
- **the trainer**: a train step over the batch's virtual tokens, the weight export and one
  load per inference engine (a pause of that engine); monolithic placement time-shares every
  engine for the train step;
- **the control plane**: every task passes one scheduler (a queue of
  ``scheduler_us_per_task`` each) and every completion the driver handles one driver (a
  queue of ``driver_us_per_event``), so their saturation shows as time; ``shards`` splits both
  (the remedy), ``cohort_max`` makes tasks coarser.

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

import math
import random
from collections import Counter, deque
from dataclasses import dataclass, field
from statistics import median
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from flows.config import TrainConfig
from flows.config.choices import Placement, RewardBackend
from flows.config.derived import (
    device_model,
    effective_pools,
    lambda_function_of,
    pool_hardware,
    trainer_gpus,
    with_env_faults,
)
from flows.training import launch, lifecycle, orchestration, workload
from flows.training import turn_placement as dispatch_mod
from flows.training.core import Publish, RunCore
from resources import emulated
from resources.catalog import HardwareProfile, get_profile
from resources.device_model import DeviceModel
from resources.pools import Role, Tag
from resources.reward_client import chunk_size
from resources.sim_engine import Clock, Queue, SimEngine, Slots
from tasks.envs.latency import Latency
from tasks.records import Trajectory


class TurnCount(BaseModel):
    """Turns of one trajectory: ``mean`` on average (the two integers around it), at most
    ``max``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mean: float = Field(gt=0, description="Mean turns per trajectory")
    max: int = Field(default=1000, ge=1, description="Most turns")

    def sample(self, rng: random.Random) -> int:
        low = math.floor(self.mean)
        n = low + (rng.random() < self.mean - low)
        return int(min(self.max, max(1, n)))


class SimSettings(BaseModel):
    """The ``simulate:`` section of a config: what the simulator needs beyond the run's."""

    model_config = ConfigDict(extra="forbid")

    gpus: int | None = Field(default=None, ge=1, description="Scale the GPU pools (and the "
                             "batch, env slots and max_in_flight with them) to about this many "
                             "GPUs; null: the config's pools as they are")
    hours: float | None = Field(default=None, gt=0, description="Simulated hours to run "
                                "(null: until trainer.max_steps)")
    turns: dict[str, TurnCount] = Field(default_factory=dict, description="Turns per "
                                        "trajectory by env task (default: the env's max_turns)")
    local_env_step_s: float = Field(default=0.002, ge=0, description="Step time of an "
                                    "environment with no remote latency")
    turn_overhead_s: float = Field(default=0.0, ge=0, description="Fixed time a turn spends "
                                   "outside its tasks (messages, transfers) beyond the queues")
    train_overhead_s: float = Field(default=0.0, ge=0, description="Fixed time per train step "
                                    "beyond the device model's")
    scheduler_us_per_task: float = Field(default=0.0, ge=0, description="Scheduler time per "
                                         "task (0: not modelled); from flows/benchmarks/scheduler.py")
    driver_us_per_event: float = Field(default=0.0, ge=0, description="Driver time per "
                                       "completion handled (0: not modelled)")
    shards: int = Field(default=1, ge=1, description="Schedulers the rollout is sharded over "
                        "(the scale remedy, cluster.shards), one driver for all")
    shard_drivers: bool = Field(default=False, description="A design the flow does not have: "
                                "one driver process per shard as well")
    group_placement: bool = Field(default=False, description="A design the flow does not "
                                  "have: a group's trajectories ready together share their "
                                  "workers, so that cohorts (rollout.cohort_max) form at scale")
    lambda_concurrency: int | None = Field(default=None, ge=1, description="Concurrent Lambda "
                                           "instances per function (null: the emulator's, or "
                                           "1000, AWS's default account limit)")
    lambda_cold_start_s: float = Field(default=0.5, ge=0, description="A new instance's start")
    lambda_latency_s: float | None = Field(default=None, ge=0, description="Per call (null: "
                                           "reward.emulator.latency_s)")
    throttle_backoff_s: float = Field(default=0.1, ge=0, description="Wait before a throttled "
                                      "call is retried")
    reward_flush_s: float = Field(default=0.1, ge=0, description="The driver sends the "
                                  "finished trajectories waiting for scoring at most this "
                                  "often (its loop gathers completions for about as long)")
    seed: int | None = Field(default=None, description="Seed of the simulator's own draws "
                             "(null: the run's)")


# -- trajectories -------------------------------------------------------------------------------


@dataclass(eq=False)
class _Traj:
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
    env_rngs: list = field(default_factory=list)  # its environment's latency draws
    failed: bool = False  # its environment raised during this turn
    cohort: dict | None = None  # the cohort of its turn in flight


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
        return sum(self.step_times[1:]) / (len(self.step_times) - 1)

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "step_times"}
        return d | {"step_s": self.step_s, "step_times": [round(s, 3) for s in self.step_times]}


# -- the run ------------------------------------------------------------------------------------


def _max_turns(spec: dict) -> int | None:
    """``max_turns`` of an env spec, looking through wrappers (``env: {...}``)."""
    while isinstance(spec, dict):
        if "max_turns" in spec:
            return int(spec["max_turns"])
        spec = spec.get("env")
    return None


@dataclass(frozen=True)
class _EnvLatency:
    """A RemoteLatency-wrapped environment's latencies, drawn as it draws them: from a stream
    seeded by its seed and the episode's, so the members of a group (one seed) wait alike."""

    reset: Latency
    step: Latency
    seed: int
    failure_rate: float
    hang_rate: float

    def stream(self, episode_seed: int) -> random.Random:
        return random.Random(f"{self.seed}/{episode_seed}")

    def draw(self, step: bool, rng: random.Random) -> tuple[float, bool]:
        """(seconds, whether the call failed) of a step or a reset."""
        if step and self.hang_rate:
            rng.random()  # the hang draw (hangs are not simulated)
        seconds = (self.step if step else self.reset).sample(rng)
        return seconds, bool(self.failure_rate) and rng.random() < self.failure_rate


def _env_latency(spec: dict) -> list[_EnvLatency]:
    """The RemoteLatency layers around an environment, outermost first (``faults.env`` wraps
    one more around the env task's own); none for a local environment."""
    layers = []
    while isinstance(spec, dict) and str(spec.get("_component_", "")).endswith("RemoteLatency"):
        layers.append(_EnvLatency(Latency.of(spec.get("reset_latency")),
                                  Latency.of(spec.get("step_latency")), int(spec.get("seed", 0)),
                                  float(spec.get("failure_rate", 0.0)),
                                  float(spec.get("hang_rate", 0.0))))
        spec = spec.get("env")
    return layers


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
        self.lengths = dispatch_mod.ResponseLengths()
        self._build_cluster()
        self.ready: list[_Traj] = []
        self.reward_pending: list[tuple[_Traj, Trajectory]] = []
        self.next_id = 0
        self.step_ends: list[float] = []
        self.staleness: list[int] = []
        self.trainer_busy_s = 0.0
        self.tasks: Counter[str] = Counter()
        self.driver_events = 0
        self.turns_done = 0
        self.generated = 0
        shards = self.sim.shards
        self.schedulers = [Queue(self.clock, self.sim.scheduler_us_per_task * 1e-6)
                           for _ in range(shards)]
        self.drivers = [Queue(self.clock, self.sim.driver_us_per_event * 1e-6)
                        for _ in range(shards if self.sim.shard_drivers else 1)]
        self._shard_load = [0] * shards
        self.lambda_busy: Counter[str] = Counter()  # instances running, per function
        self.lambda_warm: Counter[str] = Counter()  # instances started, per function
        self.reward_calls = Counter()
        fns = {t.name: lambda_function_of(cfg.reward, t) for t in cfg.env_tasks}
        self.lambda_function = fns
        self.turn_counts = {t.name: self.sim.turns.get(t.name) or TurnCount(
            mean=_max_turns(t.env) or 1, max=_max_turns(t.env) or 1000) for t in cfg.env_tasks}
        self.env_latency = {t.name: _env_latency(with_env_faults(cfg.faults, t.env))
                            for t in cfg.env_tasks}
        self._in_tick = False
        self._flush_due = False
        # at the last step: (time, tasks, driver events, scheduler and driver busy seconds)
        self._rates_at: tuple | None = None

    # -- cluster ---------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self.core.version

    def _build_cluster(self) -> None:
        cfg = self.cfg
        pools = effective_pools(cfg)
        tags = launch.pool_router(cfg)(pools)  # the affinity routing the embedded cluster uses
        hardware = pool_hardware(cfg)
        dev = cfg.engine.device
        model = device_model(cfg)
        stragglers = cfg.faults.stragglers
        self.engines: dict[str, SimEngine] = {}
        self.slots: dict[tuple[str, Tag], Slots] = {}
        self.pool_of: dict[str, str] = {}
        by_tag: dict[str, list[str]] = {str(t): [] for t in Tag}
        self.devices: dict[str, DeviceModel] = {}
        self.gpus = 0
        self.cost = 0.0
        for p in pools:
            hw = get_profile(p.profile, cfg.affinity.profiles)
            if hw.accelerator and p.role is not Role.SERVERLESS:
                self.gpus += p.workers * p.gpus
                self.cost += p.workers * p.gpus * hw.price_per_hour
            for i in range(p.workers):
                w = f"{p.name}-{i}"
                self.pool_of[w] = p.name
                for tag in tags[p.name]:
                    by_tag[str(tag)].append(w)
                    self.slots[(w, tag)] = Slots(p.slots)
                if {Tag.GPU_COMPUTE, Tag.GPU_BANDWIDTH} & set(tags[p.name]):
                    profile, gpus = hardware[p.name]
                    device = DeviceModel(model, HardwareProfile(**profile), gpus, dev.mfu, dev.mbu,
                                         dev.memory_utilization)
                    self.devices[w] = device
                    self.engines[w] = SimEngine(self.clock, w, device, dev.chunk_tokens,
                                                dev.max_seqs, stragglers.get(p.name, 1.0))
        self.router = orchestration.Router(by_tag)
        self.env_slowdown = {w: stragglers.get(self.pool_of[w], 1.0)
                             for w in by_tag[str(Tag.CPU_ENV)]}
        train_pool = next(p for p in pools if p.role in (Role.TRAIN, Role.ALL))
        profile, _ = hardware[train_pool.name]
        self.trainer_device = emulated.device_of(HardwareProfile(**profile), trainer_gpus(cfg),
                                                 dev)
        self.colocated = cfg.placement == Placement.MONOLITHIC
        self.core.pool_slots = max(1, min(sum(self.slots[(w, t)].free for w in by_tag[str(t)])
                                     for t in (Tag.GPU_COMPUTE, Tag.GPU_BANDWIDTH, Tag.CPU_ENV)))
        judge = cfg.reward.judge
        self.judge_device = None
        if judge is not None:
            self.judge_device = emulated.device_of(
                get_profile(judge.profile, cfg.affinity.profiles), judge.gpus, dev)
            if cfg.reward.backend != RewardBackend.LAMBDA:  # one dedicated engine every call shares
                self.judge_engine = SimEngine(self.clock, "judge", self.judge_device,
                                              dev.chunk_tokens, dev.max_seqs)
        self.uses_devices = cfg.rollout.dispatch is not dispatch_mod.Dispatch.SPLIT

    # -- the recipe ------------------------------------------------------------------------------
    def run(self) -> SimResult:
        import time

        t0 = time.perf_counter()
        for e in self.engines.values():  # the initial weights, everywhere
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
            if self.reward_pending and not self._flush_due:
                self._flush_due = True
                self.clock.after(self.sim.reward_flush_s, self._reward_flush)
            self._maybe_train()
            self._admit()
            self._flush_turns()
        finally:
            self._in_tick = False

    def _reward_flush(self) -> None:
        self._flush_due = False
        self._flush_rewards()

    def _admit(self) -> None:
        slots = self.core.pool_slots // self.sim.shards
        for group in self.core.admit():
            # the shard with the most free room, as the flow picks (its engines are shared
            # here: each shard gets an equal part of the slots)
            shard = orchestration.pick_shard(self._shard_load, [slots] * self.sim.shards)
            env_task = group.env_task
            for _ in range(env_task.group_size):
                tid, self.next_id = self.next_id, self.next_id + 1
                t = _Traj(tid, group.group_id, env_task, group.seed,
                          self.turn_counts[env_task.name].sample(self.rng), shard=shard)
                self._shard_load[shard] += 1
                self.ledger.admit(tid)
                self.ledger.transition(tid, lifecycle.TrajState.ROLLING_OUT)
                self.ready.append(t)

    # -- a turn ----------------------------------------------------------------------------------
    def _flush_turns(self) -> None:
        """Every ready turn out, in cohorts of trajectories that share their workers (as
        RolloutDriver.flush forms them): one set of tasks per cohort through the scheduler, one
        completion per cohort to the driver, when its last member has stepped."""
        ready, self.ready = self.ready, []
        open_cohorts: dict[tuple, dict] = {}
        size = self.cfg.rollout.cohort_max
        placed: dict[str, tuple] = {}  # simulate.group_placement: a group's plan this flush
        for t in ready:
            fresh = t.env_worker is None
            shape = workload.turn_shape(t.env_task.shape, self.cfg.seed, t.tid, t.turn,
                                        t.attempt)
            prompt = shape.prompt_tokens if shape is not None else 64
            response = shape.response_tokens if shape is not None else 16
            if self.sim.group_placement and t.group_id in placed:
                env_worker, plan = placed[t.group_id]
                t.env_worker = t.env_worker or env_worker
            else:
                if fresh:
                    t.env_worker = self.router.choose(Tag.CPU_ENV)
                plan = self._plan(t, prompt)
                placed[t.group_id] = (t.env_worker, plan)
            for w in {plan.decode_worker, plan.prefill_worker, t.env_worker}:
                self.router.started(w)
            key = (fresh, t.env_task.name if self.cfg.rollout.cohort_per_env_task else None,
                   t.env_worker, plan.prefill_worker, plan.decode_worker, t.shard)
            cohort = open_cohorts.get(key)
            if cohort is None or len(cohort["members"]) >= size:
                # a new cohort: its tasks reach the workers once its shard's scheduler has
                # placed them
                n_tasks = 3 + fresh
                for stage in ("prefill", "decode", "env_step") + (("env_reset",) if fresh else ()):
                    self.tasks[stage] += 1
                cohort = {"members": [], "left": 0,
                          "wait": self.schedulers[t.shard].delay(n_tasks)}
                open_cohorts[key] = cohort
            cohort["members"].append(t)
            cohort["left"] += 1
            t.cohort = cohort
            self.clock.after(cohort["wait"] + self.sim.turn_overhead_s, self._start_turn, t,
                             plan, prompt, response, fresh)

    def _plan(self, t: _Traj, prompt: int) -> dispatch_mod.TurnPlan:
        """Where the turn's prefill and decode run (as RolloutDriver._plan decides)."""
        router = self.router
        if not self.uses_devices:
            dec = router.choose(Tag.GPU_BANDWIDTH, prefer=t.decode_worker)
            pre = router.choose(Tag.GPU_COMPUTE, prefer=dec)
            return dispatch_mod.TurnPlan(pre, dec, Tag.GPU_COMPUTE, Tag.GPU_BANDWIDTH)
        return dispatch_mod.plan_turn(
            self.devices, router.load, router.workers_by_tag[str(Tag.GPU_COMPUTE)],
            router.workers_by_tag[str(Tag.GPU_BANDWIDTH)], t.kv_at, t.decode_worker, prompt,
            t.context, self.lengths.expected(t.env_task.name))

    def _start_turn(self, t: _Traj, plan, prompt: int, response: int, fresh: bool) -> None:
        if fresh:
            t.env_rngs = [lat.stream(t.seed) for lat in self.env_latency[t.env_task.name]]
            self.slots[(t.env_worker, Tag.CPU_ENV)].acquire(
                self._env_call, t, False, self._prefill, (t, plan, prompt, response))
        else:
            self._prefill(t, plan, prompt, response)

    def _env_call(self, t: _Traj, step: bool, then, args) -> None:
        layers = self.env_latency[t.env_task.name]
        seconds = 0.0 if layers else self.sim.local_env_step_s
        for lat, rng in zip(layers, t.env_rngs, strict=True):
            s, failed = lat.draw(step, rng)
            seconds += s
            if failed:  # the call raises after its latency; the inner layers never run
                t.failed = True
                break
        seconds *= self.env_slowdown.get(t.env_worker, 1.0)
        self.clock.after(seconds, self._env_done, t, then, args)

    def _env_done(self, t: _Traj, then, args) -> None:
        self.slots[(t.env_worker, Tag.CPU_ENV)].release()
        if t.failed and then is self._prefill:  # a failed reset ends the turn there
            self._turn_done(t, args[1])
            return
        then(*args)

    def _prefill(self, t: _Traj, plan, prompt: int, response: int) -> None:
        self.slots[(plan.prefill_worker, plan.prefill_tag)].acquire(
            self._prefill_run, t, plan, prompt, response)

    def _prefill_run(self, t: _Traj, plan, prompt: int, response: int) -> None:
        engine = self.engines[plan.prefill_worker]
        move = engine.device.kv_transfer_time(t.context) if (
            t.kv_at is not None and t.kv_at != plan.prefill_worker) else 0.0

        def done() -> None:
            self.slots[(plan.prefill_worker, plan.prefill_tag)].release()
            self._decode(t, plan, prompt, response)

        self.clock.after(move, engine.submit, True, prompt, t.context, done)

    def _decode(self, t: _Traj, plan, prompt: int, response: int) -> None:
        self.slots[(plan.decode_worker, plan.decode_tag)].acquire(
            self._decode_run, t, plan, prompt, response)

    def _decode_run(self, t: _Traj, plan, prompt: int, response: int) -> None:
        engine = self.engines[plan.decode_worker]
        move = 0.0
        if plan.prefill_worker != plan.decode_worker:
            moved = prompt
            if t.kv_at is not None and t.kv_at != plan.decode_worker:
                moved = t.context + prompt
            move = engine.device.kv_transfer_time(moved)
        t.oldest = engine.version if t.oldest is None else min(t.oldest, engine.version)
        context = t.context + prompt

        def done() -> None:
            self.slots[(plan.decode_worker, plan.decode_tag)].release()
            t.context = context + response
            self.generated += response
            t.kv_at = t.decode_worker = plan.decode_worker
            self.lengths.record(t.env_task.name, response)
            self.slots[(t.env_worker, Tag.CPU_ENV)].acquire(
                self._env_call, t, True, self._turn_done, (t, plan))

        self.clock.after(move, engine.submit, False, response, context, done)

    def _turn_done(self, t: _Traj, plan) -> None:
        cohort = t.cohort
        cohort["left"] -= 1
        if cohort["left"]:
            return  # the cohort's env_step returns when its last member has stepped
        for m in cohort["members"]:
            for w in {plan.decode_worker, plan.prefill_worker, m.env_worker}:
                self.router.finished(w)
        # the completion reaches the driver through its queue
        driver = self.drivers[t.shard % len(self.drivers)]
        self.clock.after(driver.delay(), self._on_turn, cohort["members"])

    def _on_turn(self, members: list[_Traj]) -> None:
        self.driver_events += 1
        for t in members:
            self.turns_done += 1
            t.turn += 1
            t.cohort = None
            if t.failed:  # its environment raised: a fresh one, or dropped (rollout_error)
                t.failed = False
                self._restart_or_drop(t)
            elif t.turn >= t.turns or self.core.stopping:
                self._finished(t)
            else:
                self.ready.append(t)
        self._tick()

    def _restart_or_drop(self, t: _Traj) -> None:
        if t.attempt + 1 >= self.cfg.rollout.max_attempts:
            self._release(t)
            self.ledger.drop(t.tid, lifecycle.DropReason.ROLLOUT_ERROR, "env crash")
            self._drop_member(t.group_id)
            return
        t.attempt += 1
        t.turn = t.context = 0
        t.env_worker = t.kv_at = t.decode_worker = t.oldest = None
        self.ready.append(t)

    def _release(self, t: _Traj) -> None:
        self._shard_load[t.shard] -= 1

    def _finished(self, t: _Traj) -> None:
        self._release(t)
        self.ledger.transition(t.tid, lifecycle.TrajState.AWAITING_SCORE)
        oldest = self.version if t.oldest is None else t.oldest
        traj = Trajectory(
            traj_id=str(t.tid), group_id=t.group_id, env_name=t.env_task.name, seed=t.seed,
            token_ids=np.zeros(1, np.int64), loss_mask=np.ones(1, bool),
            behaviour_logprobs=np.zeros(1, np.float32), versions=np.array([oldest]),
            env_rewards=[], responses=[], info={}, num_turns=t.turn, truncated=False,
            context_truncated=False, virtual_tokens=t.context)
        self.reward_pending.append((t, traj))

    def _drop_member(self, group_id: str) -> None:
        self.core.member_lost(group_id)

    # -- reward ----------------------------------------------------------------------------------
    def _flush_rewards(self) -> None:
        if not self.reward_pending:
            return
        by_function: dict[str, list] = {}
        for t, traj in self.reward_pending:
            by_function.setdefault(self.lambda_function[t.env_task.name], []).append(traj)
        self.reward_pending = []
        r = self.cfg.reward
        per_task = r.batch_max * r.concurrency
        for function, trajs in by_function.items():
            for i in range(0, len(trajs), per_task):
                batch = trajs[i:i + per_task]
                for traj in batch:
                    self.ledger.transition(int(traj.traj_id), lifecycle.TrajState.SCORING)
                self.tasks["score"] += 1
                worker = self.router.choose(Tag.SERVERLESS)
                wait = self.schedulers[0].delay()
                self.clock.after(wait, self.slots[(worker, Tag.SERVERLESS)].acquire,
                                 self._score, worker, function, batch)

    def _score(self, worker: str, function: str, batch: list[Trajectory]) -> None:
        """One score task: the burst in chunks as the reward client cuts them
    (:func:`resources.reward_client.chunk_size`), reward.concurrency calls at a time."""
        r = self.cfg.reward
        # the Lambda client fans a burst out over reward.concurrency calls; the local client
        # scores its chunks one after the other
        lanes = r.concurrency if r.backend == RewardBackend.LAMBDA else 1
        size = chunk_size(len(batch), lanes, r.min_batch, r.batch_max)
        chunks = [batch[i:i + size] for i in range(0, len(batch), size)]
        state = {"left": len(chunks), "queue": deque(chunks)}

        def next_call() -> None:
            if state["queue"]:
                self._invoke(function, state["queue"].popleft(), call_done)

        def call_done() -> None:
            state["left"] -= 1
            if state["left"]:
                next_call()
                return
            self.slots[(worker, Tag.SERVERLESS)].release()
            self.clock.after(self.drivers[0].delay(), self._on_scored, batch)

        for _ in range(min(lanes, len(chunks))):
            next_call()

    def _invoke(self, function: str, chunk: list[Trajectory], done) -> None:
        r = self.cfg.reward
        limit = self.sim.lambda_concurrency or (
            r.emulator.concurrency if r.backend == RewardBackend.LAMBDA and r.emulator.enabled else 1000)
        if self.lambda_busy[function] >= limit:  # 429: the client waits and retries
            self.reward_calls["throttles"] += 1
            self.clock.after(self.sim.throttle_backoff_s, self._invoke, function, chunk, done)
            return
        self.lambda_busy[function] += 1
        self.reward_calls["invocations"] += 1
        seconds = self.sim.lambda_latency_s if self.sim.lambda_latency_s is not None else (
            r.emulator.latency_s)
        if self.lambda_warm[function] < self.lambda_busy[function]:
            self.lambda_warm[function] += 1
            self.reward_calls["cold_starts"] += 1
            seconds += self.sim.lambda_cold_start_s + r.emulator.init_delay_s
        tokens = sum(t.virtual_tokens for t in chunk)

        def finish() -> None:
            self.lambda_busy[function] -= 1
            done()

        if self.judge_device is not None and r.backend != RewardBackend.LAMBDA:
            self.clock.after(seconds, self.judge_engine.submit, True, tokens, 0, finish)
            return
        if self.judge_device is not None:
            seconds += self.judge_device.prefill_time(tokens)
        self.clock.after(seconds, finish)

    def _on_scored(self, batch: list[Trajectory]) -> None:
        self.driver_events += 1
        for traj in batch:
            traj.reward = self.rng.random()
            self.ledger.transition(int(traj.traj_id), lifecycle.TrajState.IN_GROUP)
            self.core.scored(traj)
        self._tick()

    # -- training --------------------------------------------------------------------------------
    def _maybe_train(self) -> None:
        batch = self.core.cut()
        if batch is None:
            return
        self.staleness.extend(batch.staleness)
        seconds = self.trainer_device.train_step_time(emulated.sequence_lengths(batch.samples))
        self.tasks["train_step"] += 1
        if self.colocated:  # every engine yields its GPUs for the train step
            for e in self.engines.values():
                e.pause(seconds, training=True)
        seconds += self.sim.train_overhead_s
        export = self.trainer_device.weight_broadcast_time()
        self.trainer_busy_s += seconds + export
        self.clock.after(self.schedulers[0].delay() + seconds + export, self._trained)

    def _trained(self) -> None:
        self.driver_events += 1
        instructions = self.core.trained(self.version + 1, self.clock.now)
        self.step_ends.append(self.clock.now)
        # rates are over the training, not the drain after its last step
        self._rates_at = self._rates()
        # StopRollout: the core stops admitting, and a trajectory's turn in flight is its last;
        # checkpoints are not simulated
        for ins in instructions:
            if isinstance(ins, Publish):
                self.tasks["publish_weights"] += 1
                # the publish and one load per engine
                self.schedulers[0].delay(1 + len(self.engines))
                for e in self.engines.values():
                    self.core.loads_in_flight += 1
                    self.tasks["load_weights"] += 1
                    e.pause(e.device.weight_broadcast_time(),
                            lambda e=e, v=ins.version: self._loaded(e, v))
        self._tick()

    def _loaded(self, engine: SimEngine, version: int) -> None:
        self.driver_events += 1
        engine.version = version
        self.core.loads_in_flight -= 1
        self._tick()

    # -- report ----------------------------------------------------------------------------------
    def _rates(self) -> tuple:
        """(now, tasks, driver events, each scheduler's and driver's busy seconds) so far."""
        return (self.clock.now, sum(self.tasks.values()), self.driver_events,
                [q.busy_s for q in self.schedulers], [q.busy_s for q in self.drivers])

    def _result(self, wall_s: float) -> SimResult:
        elapsed = self.clock.now
        ends = [0.0] + self.step_ends
        steps = [b - a for a, b in zip(ends, ends[1:], strict=False)]
        busy: dict[str, list[float]] = {}
        for w, e in self.engines.items():
            busy.setdefault(self.pool_of[w], []).append(e.busy_s)
        accounts = self.ledger.summary()
        until, tasks, events, sched_s, driver_s = self._rates_at or self._rates()
        return SimResult(
            system=self.system, gpus=self.gpus, cost_per_hour=self.cost, elapsed_s=elapsed,
            steps=self.version, step_times=steps,
            busy={p: sum(v) / len(v) / max(elapsed, 1e-9) for p, v in busy.items()},
            trainer_busy=self.trainer_busy_s / max(elapsed, 1e-9),
            trajectories={k: accounts[k] for k in ("started", "trained", "dropped")},
            staleness_mean=sum(self.staleness) / max(len(self.staleness), 1),
            turns=self.turns_done, tasks=dict(self.tasks), driver_events=self.driver_events,
            scheduler_busy=[b / max(until, 1e-9) for b in sched_s],
            driver_busy=[b / max(until, 1e-9) for b in driver_s],
            generated_tokens=self.generated, reward=dict(self.reward_calls),
            events=self.clock.events,
            tasks_per_s=tasks / max(until, 1e-9), driver_events_per_s=events / max(until, 1e-9),
            wall_s=wall_s)


def simulate(cfg: TrainConfig, sim: SimSettings | None = None, system: str = "rollarc"
             ) -> SimResult:
    """Simulate one run of ``cfg``."""
    return Simulation(cfg, sim, system).run()
