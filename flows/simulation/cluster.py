"""The simulated cluster: each worker's engine and resource slots, the pool workers over them, the
trainer's and a reward model's devices, what the GPUs cost, and the control plane.

Pools get their Dask resource tags from the affinity routing the embedded cluster uses
(:func:`flows.training.launch.pool_router`). Device times come from
:class:`resources.device_model.DeviceModel`, the model of the ``emulated`` backend and the
affinity router; each inference worker runs a :class:`resources.sim_engine.SimEngine`
(continuous batching under KV memory and ``max_seqs``). The control plane: every task passes one
scheduler (a queue of ``scheduler_us_per_task`` each) and every completion the driver handles
one driver (a queue of ``driver_us_per_event``), so their saturation shows as time; ``shards``
splits both.
"""

from __future__ import annotations

from collections import Counter

from flows.config import TrainConfig
from flows.config.choices import Placement, RewardBackend, TurnPlacement
from flows.config.derived import device_model, effective_pools, pool_hardware, trainer_gpus
from flows.simulation.settings import SimSettings
from flows.training import launch, orchestration
from resources import emulated
from resources.catalog import HardwareProfile, get_profile
from resources.device_model import DeviceModel
from resources.pools import Role, Tag
from resources.sim_engine import Clock, Queue, SimEngine, Slots


class SimCluster:
    """The workers of ``cfg``'s pools on ``clock``: engines, slots, pool_workers, devices."""

    def __init__(self, cfg: TrainConfig, clock: Clock):
        pools = effective_pools(cfg)
        tags = launch.pool_router(cfg)(pools)  # the affinity routing the embedded cluster uses
        hardware = pool_hardware(cfg)
        dev = cfg.engine.device
        model = device_model(cfg)
        stragglers = cfg.faults.stragglers
        self.engines: dict[str, SimEngine] = {}
        self.worker_slots: dict[tuple[str, Tag], Slots] = {}
        self.pool_of: dict[str, str] = {}
        self.devices: dict[str, DeviceModel] = {}
        self._capacity: Counter[Tag] = Counter()
        by_tag: dict[str, list[str]] = {str(t): [] for t in Tag}
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
                    self.worker_slots[(w, tag)] = Slots(p.slots)
                    self._capacity[tag] += p.slots
                if {Tag.GPU_COMPUTE, Tag.GPU_BANDWIDTH} & set(tags[p.name]):
                    profile, gpus = hardware[p.name]
                    device = DeviceModel(model, HardwareProfile(**profile), gpus, dev.mfu, dev.mbu,
                                         dev.memory_utilization)
                    self.devices[w] = device
                    self.engines[w] = SimEngine(clock, w, device, dev.chunk_tokens,
                                                dev.max_seqs, stragglers.get(p.name, 1.0))
        self.pool_workers = orchestration.PoolWorkers(by_tag)
        self.env_slowdown = {w: stragglers.get(self.pool_of[w], 1.0)
                             for w in by_tag[str(Tag.CPU_ENV)]}
        train_pool = next(p for p in pools if p.role in (Role.TRAIN, Role.ALL))
        profile, _ = hardware[train_pool.name]
        self.trainer_device = emulated.device_of(HardwareProfile(**profile), trainer_gpus(cfg),
                                                 dev)
        self.colocated = cfg.placement == Placement.MONOLITHIC
        judge = cfg.reward.judge
        self.judge_device: DeviceModel | None = None
        self.judge_engine: SimEngine | None = None
        if judge is not None:
            self.judge_device = emulated.device_of(
                get_profile(judge.profile, cfg.affinity.profiles), judge.gpus, dev)
            if cfg.reward.backend != RewardBackend.LAMBDA:  # one dedicated engine every call shares
                self.judge_engine = SimEngine(clock, "judge", self.judge_device,
                                              dev.chunk_tokens, dev.max_seqs)
        # the device models place turns only with length-aware turn placement (as the flow's
        # flows.training.launch.worker_devices gives them)
        self.turn_devices = None if cfg.rollout.turn_placement is TurnPlacement.SPLIT else self.devices

    def slots(self, tag: Tag) -> int:
        """Slots the workers advertising ``tag`` have in all (a cluster handle's count)."""
        return self._capacity[tag]

    def busy_by_pool(self, elapsed: float) -> dict[str, float]:
        """Each pool's engines' mean busy share of ``elapsed`` seconds."""
        busy: dict[str, list[float]] = {}
        for w, e in self.engines.items():
            busy.setdefault(self.pool_of[w], []).append(e.busy_s)
        return {p: sum(v) / len(v) / max(elapsed, 1e-9) for p, v in busy.items()}


class ControlPlane:
    """The Dask schedulers and drivers as queues of their cost per task and per completion,
    and the tasks and completions that passed them."""

    def __init__(self, clock: Clock, sim: SimSettings):
        self.clock = clock
        self.schedulers = [Queue(clock, sim.scheduler_us_per_task * 1e-6)
                           for _ in range(sim.shards)]
        self.drivers = [Queue(clock, sim.driver_us_per_event * 1e-6)
                        for _ in range(sim.shards if sim.shard_drivers else 1)]
        self.tasks: Counter[str] = Counter()  # submitted, by stage
        self.driver_events = 0

    def driver_of(self, shard: int) -> Queue:
        return self.drivers[shard % len(self.drivers)]

    def rates(self) -> tuple:
        """(now, tasks, driver events, each scheduler's and driver's busy seconds) so far."""
        return (self.clock.now, sum(self.tasks.values()), self.driver_events,
                [q.busy_s for q in self.schedulers], [q.busy_s for q in self.drivers])
