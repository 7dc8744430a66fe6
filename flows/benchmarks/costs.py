"""What a system costs, and the shapes that size baselines to RollArc's hourly cost.

A system's cost has two parts: the accelerators its pools provision (devices x the catalog's
hourly price, whether busy or not) and the serverless reward model's GPU-seconds, billed per use
at its profile's price (``reward.judge`` on ``reward.backend: lambda``). Sizing equalises the
provisioned part before a run (the serverless part is only known after one); every run's
measured $/h (:func:`run_cost`) carries both, and the bench reports each system's deviation.

Devices come whole and a pool has one engine shape (``workers`` x ``gpus``), so equal cost is
met within :data:`COST_TOLERANCE`: one H800 ($2.20/h) is 12 % of an $18/h budget, and the
nearest count is up to 6 % off; :func:`equal_cost_shape` searches every engine size and worker
count for the closest shape within the tolerance, preferring engines the size of the system's
own largest inference engine, or for the monolithic baseline ``cluster.monolithic_gpus`` when the
workload sets it (the baseline's own best size: RollArc's largest engine is no reason for it).
:func:`monolithic_shape` is the one definition of the monolithic baseline, used by the bench and
the simulator alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flows.config import TrainConfig
from flows.config.choices import RewardBackend
from flows.config.derived import device_model, effective_pools, is_emulated
from resources.catalog import HardwareProfile, get_profile
from resources.device_model import DeviceModel
from resources.pools import Role

# the largest relative difference between a system's provisioned $/h and RollArc's that the
# bench accepts: with whole devices and one engine shape per pool, the closest every shipped
# workload's systems can get (tests/unit/flows/test_bench_costs.py checks them all)
COST_TOLERANCE = 0.03
# worker processes an equal-cost pool may have on the benchmark machine (None: no limit, as in
# the simulator)
BENCH_MAX_WORKERS = 8
MAX_ENGINE_GPUS = 8  # devices of one engine: one node's
GPU_ROLES = (Role.INFERENCE, Role.TRAIN)  # the pools of a disaggregated system's GPUs


@dataclass(frozen=True)
class Shape:
    """A pool's size: ``workers`` engines of ``gpus`` devices each."""

    workers: int
    gpus: int

    @property
    def devices(self) -> int:
        return self.workers * self.gpus


def gpu_cost(cfg: TrainConfig, roles: tuple[Role, ...]) -> tuple[int, float]:
    """GPUs and USD/hour of the configured pools with these roles."""
    gpus = cost = 0.0
    for p in cfg.cluster.pools:
        if p.role in roles:
            n = p.workers * p.gpus
            gpus += n
            cost += n * get_profile(p.profile, cfg.affinity.profiles).price_per_hour
    return int(gpus), cost


def provisioned(cfg: TrainConfig) -> tuple[dict[str, int], float]:
    """Accelerators a run holds, by profile, and their USD/h: its placement's pools, and a
    reward model's dedicated devices (``reward.judge`` on ``reward.backend: local``)."""
    devices = [(p.profile, p.workers * p.gpus) for p in effective_pools(cfg)]
    judge = cfg.reward.judge
    if judge is not None and cfg.reward.backend == RewardBackend.LOCAL:
        devices.append((judge.profile, judge.gpus))
    parts: dict[str, int] = {}
    cost = 0.0
    for profile, n in devices:
        hw = get_profile(profile, cfg.affinity.profiles)
        if hw.accelerator:
            parts[hw.name] = parts.get(hw.name, 0) + n
            cost += n * hw.price_per_hour
    return parts, cost


def hardware_of(cfg: TrainConfig) -> str:
    """'3 H800 + 12 H20 ($18.0/h)': the accelerators a config's runs provision."""
    parts, cost = provisioned(cfg)
    return " + ".join(f"{n} {k}" for k, n in parts.items()) + f" (${cost:.1f}/h)"


def serverless_usd(cfg: TrainConfig, billed_s: float, gpus: int | None = None) -> float:
    """USD of ``billed_s`` seconds of serverless reward-model instances (``reward.judge``'s
    profile and devices per instance; none without a judge)."""
    judge = cfg.reward.judge
    if judge is None or billed_s <= 0:
        return 0.0
    price = get_profile(judge.profile, cfg.affinity.profiles).price_per_hour
    return billed_s * (gpus or judge.gpus) * price / 3600.0


def run_cost(cfg: TrainConfig, wall_s: float, serverless_billed_s: float = 0.0) -> dict:
    """A run's cost over ``wall_s`` (emulated) seconds: provisioned and serverless USD, and the
    USD per hour they make together."""
    _, per_hour = provisioned(cfg)
    fixed = per_hour * wall_s / 3600.0
    billed = serverless_usd(cfg, serverless_billed_s)
    total = fixed + billed
    return {"provisioned_per_hour": per_hour, "provisioned_usd": fixed, "serverless_usd": billed,
            "usd": total, "per_hour": total * 3600.0 / wall_s if wall_s > 0 else per_hour}


def deviation(cost: float, reference: float) -> float:
    """``cost`` relative to ``reference``, signed (0.02: 2 % more)."""
    return cost / reference - 1.0 if reference > 0 else 0.0


def model_fits(cfg: TrainConfig, hw: HardwareProfile, gpus: int) -> bool:
    """The production model's weights fit on ``gpus`` devices of ``hw`` with room for KV."""
    if is_emulated(cfg.engine):
        d = cfg.engine.device
        device = DeviceModel(device_model(cfg), hw, gpus, d.mfu, d.mbu, d.memory_utilization)
    else:
        device = DeviceModel(device_model(cfg), hw, gpus)
    return device.kv_capacity_tokens > 0


def equal_cost_shape(target: float, fixed: float, price: float, engine_gpus: int,
                     fits=lambda gpus: True, max_workers: int | None = BENCH_MAX_WORKERS,
                     tolerance: float = COST_TOLERANCE) -> Shape:
    """The pool of devices at ``price`` $/h each that brings ``fixed`` $/h (the system's other
    pools) closest to ``target``: among the shapes within ``tolerance`` of it, engines closest
    in size to ``engine_gpus`` (then fewer workers); the closest shape when none is. Engine
    sizes run from 1 to :data:`MAX_ENGINE_GPUS` devices that ``fits`` accepts; worker counts
    to ``max_workers`` (None: any)."""
    shapes = []
    for g in range(1, MAX_ENGINE_GPUS + 1):
        if not fits(g):
            continue
        exact = max(target - fixed, 0.0) / (g * price)
        for w in {max(1, math.floor(exact)), max(1, math.ceil(exact))}:
            if max_workers is None or w <= max_workers:
                shapes.append(Shape(w, g))
            elif max_workers is not None:
                shapes.append(Shape(max_workers, g))
    if not shapes:
        raise ValueError(f"the model fits on no engine of up to {MAX_ENGINE_GPUS} devices")

    def off(s: Shape) -> float:
        return abs(deviation(fixed + s.devices * price, target))

    within = [s for s in shapes if off(s) <= tolerance]
    if within:
        return min(within, key=lambda s: (abs(math.log2(s.gpus / engine_gpus)), s.workers,
                                          off(s)))
    return min(shapes, key=lambda s: (off(s), s.workers))


def largest_engine(cfg: TrainConfig) -> int:
    """Devices of the configured system's largest inference engine."""
    return max(p.gpus for p in cfg.cluster.pools if p.role in (Role.INFERENCE, Role.ALL))


def monolithic_shape(cfg: TrainConfig, max_workers: int | None = BENCH_MAX_WORKERS) -> Shape:
    """The monolithic baseline of ``cfg``: one pool of ``cluster.monolithic_profile`` devices
    doing everything (training time-shared), at the hourly cost of the configured inference
    and trainer pools, engines as close in size to ``cluster.monolithic_gpus`` (when set; else
    to the largest inference engine) as that allows."""
    _, cost = gpu_cost(cfg, GPU_ROLES)
    hw = get_profile(cfg.cluster.monolithic_profile, cfg.affinity.profiles)
    engine = cfg.cluster.monolithic_gpus or largest_engine(cfg)
    return equal_cost_shape(cost, 0.0, hw.price_per_hour, engine,
                            lambda g: model_fits(cfg, hw, g), max_workers)


def monolithic_overrides(cfg: TrainConfig, max_workers: int | None = BENCH_MAX_WORKERS
                         ) -> list[str]:
    """The overrides that make ``cfg`` monolithic at its equal-cost shape."""
    s = monolithic_shape(cfg, max_workers)
    return ["placement=monolithic", f"cluster.monolithic_workers={s.workers}",
            f"cluster.monolithic_gpus={s.gpus}"]


def inference_shape(cfg: TrainConfig, profile: str,
                    max_workers: int | None = BENCH_MAX_WORKERS) -> Shape:
    """One inference pool of ``profile`` in place of the configured inference pools, at the
    system's hourly cost (the trainer pool kept)."""
    _, total = gpu_cost(cfg, GPU_ROLES)
    _, inference = gpu_cost(cfg, (Role.INFERENCE,))
    hw = get_profile(profile, cfg.affinity.profiles)
    return equal_cost_shape(total, total - inference, hw.price_per_hour, largest_engine(cfg),
                            lambda g: model_fits(cfg, hw, g), max_workers)
