"""Starting and stopping what a run needs: the cluster, the reward service, the ordered
shutdown; the workers' engines as the device model sees them. :mod:`flows.api` runs training on them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

from flows.config import ConfigError, TrainConfig, reward_callables
from flows.config.choices import Placement, RewardBackend, TurnPlacement
from flows.config.derived import (
    device_model,
    effective_pools,
    emulation,
    is_emulated,
    lambda_functions,
    pool_hardware,
    reward_client_settings,
    tls_security,
    trainer_gpus,
    trainer_hparams,
)
from resources.affinity import pool_tags, route
from resources.catalog import HardwareProfile, get_profile
from resources.cluster import ClusterHandle, connect, start_local_cluster
from resources.device_model import DeviceModel
from resources.emulated import device_of, train_step_seconds
from resources.hardware import PoolRouter
from resources.lambda_emulator import LambdaEmulator
from resources.pools import PoolSpec, Tag
from resources.worker import RollArcWorkerPlugin, quiet_close
from tasks.records import TrainSample

logger = logging.getLogger(__name__)


class RewardServiceError(RuntimeError):
    """The reward functions cannot be reached: the run stops before the cluster starts."""


def pool_router(cfg: TrainConfig) -> PoolRouter:
    """The tags of each pool, prefill and decode routed by the affinity cost model of ``cfg``:
    one router for the embedded pools and for those of workers advertising their hardware."""

    def tags_for(pools: list[PoolSpec]) -> dict[str, list[Tag]]:
        a = cfg.affinity
        routing = route(pools, a.workload, a.objective, a.profiles)
        logger.info(
            "affinity routing (%s): %s", a.objective.value, {s.value: p for s, p in routing.items()}
        )
        return pool_tags(pools, routing)

    return tags_for


def make_cluster(cfg: TrainConfig, scheduler: str | None) -> ClusterHandle:
    """Connect to ``scheduler`` (routing the workers that advertise their hardware), or start
    the embedded local cluster of ``cfg``'s pools with the stages routed by the affinity cost
    model; TLS when ``cfg.cluster.tls`` is set."""
    route_pools = pool_router(cfg)
    security = tls_security(cfg.cluster.tls)  # None: plain TCP
    if scheduler:
        return connect(scheduler, timeout=cfg.cluster.startup_timeout_s, route_pools=route_pools,
                       security=security, stall_dump_s=cfg.cluster.stall_dump_s,
                       heap_keep_mb=cfg.cluster.heap_keep_mb)
    pools = effective_pools(cfg)
    return start_local_cluster(pools, route_pools(pools), cfg.cluster.dashboard_port,
                               cfg.cluster.processes, cfg.cluster.startup_timeout_s,
                               host=cfg.cluster.host, security=security,
                               lost_worker_timeout_s=cfg.cluster.pool_empty_timeout_s,
                               worker_ttl_s=cfg.cluster.worker_ttl_s,
                               stall_dump_s=cfg.cluster.stall_dump_s,
                               heap_keep_mb=cfg.cluster.heap_keep_mb)


def start_reward_service(cfg: TrainConfig) -> LambdaEmulator | None:
    """backend=lambda with the emulation: check the template has the functions the run calls
    and start it. backend=lambda: check every function answers a DryRun through the very
    client the workers use (fail fast, not mid-run). Raises ConfigError or RewardServiceError."""
    from resources.lambda_template import check_template_functions
    from resources.reward_backends import build_reward_client

    if cfg.reward.backend != RewardBackend.LAMBDA:
        return None
    emulator = None
    names = sorted(lambda_functions(cfg))
    if cfg.reward.emulator.enabled:
        e = cfg.reward.emulator
        try:
            check_template_functions(e.template, names, cfg.reward.read_timeout_s)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        emulator = LambdaEmulator.from_template(
            e.template, host=e.host, port=e.port, concurrency=e.concurrency,
            latency_s=e.latency_s, init_delay_s=e.init_delay_s, region=cfg.reward.region,
            faults=cfg.faults.reward.model_dump()).start()
    reward = reward_client_settings(cfg.reward, emulator.url if emulator else None)
    try:
        for name in names:
            client = build_reward_client(reward, name)
            try:
                client.check()
            finally:
                client.close()
    except RuntimeError as exc:
        if emulator is not None:
            emulator.stop()
        raise RewardServiceError(str(exc)) from None
    logger.info("reward functions %s reachable at %s", names,
                reward["endpoint_url"] or f"AWS Lambda ({cfg.reward.region})")
    return emulator


def close_quietly(cluster: ClusterHandle) -> None:
    """Close the cluster in order (:meth:`ClusterHandle.close`); the run is over, so the
    driver's Dask loggers no longer report connections going away while it closes."""
    quiet_close()
    cluster.close()


def worker_devices(cfg: TrainConfig, cluster: ClusterHandle) -> dict[str, DeviceModel] | None:
    """``rollout.turn_placement=length_aware``: each inference worker's engine of ``cluster`` as the
    device model sees it (None: the split, also when a worker's pool is unknown)."""
    if cfg.rollout.turn_placement is TurnPlacement.SPLIT:
        return None
    hardware, model = pool_hardware(cfg), device_model(cfg)
    devices = {}
    for tag in (Tag.GPU_COMPUTE, Tag.GPU_BANDWIDTH):
        for w in cluster.workers_with(tag):
            pool = cluster.worker_pool.get(w)
            if pool not in hardware:
                logger.warning("worker %s is in no configured pool: turns are split", w)
                return None
            profile, gpus = hardware[pool]
            devices[w] = DeviceModel(model, HardwareProfile(**profile), gpus,
                                     cfg.engine.device.mfu, cfg.engine.device.mbu)
    return devices


def check_run_inputs(cfg: TrainConfig, n_shards: int, reward_endpoint: str | None) -> None:
    """What a run needs of what it was given: one cluster per rollout shard, the reward
    emulation's URL when it is on."""
    if cfg.cluster.shards != n_shards:
        raise ConfigError(f"cluster.shards: {cfg.cluster.shards} shards configured, the run "
                          f"was given {n_shards} clusters (Session.start starts them)")
    if cfg.reward.backend == RewardBackend.LAMBDA and cfg.reward.emulator.enabled \
            and not reward_endpoint:
        raise ValueError("reward.emulator.enabled: pass the running emulation's URL as "
                         "reward_endpoint (flows.training.launch.start_reward_service starts it)")


def require_pools(cluster: ClusterHandle) -> None:
    """A worker advertises each pool's resource (as the cluster last saw its workers)."""
    for tag in Tag:
        if not cluster.workers_with(tag):
            raise RuntimeError(f"no worker advertises the resource {tag}; start workers with "
                               f"--resources \"{tag}=<slots>\"")


def reward_settings(cfg: TrainConfig, reward_endpoint: str | None) -> dict:
    """The reward clients' settings on the workers; a judge's profile resolved here, config
    overrides included."""
    settings = reward_client_settings(cfg.reward, reward_endpoint)
    if cfg.reward.judge is not None:
        settings["judge_hardware"] = get_profile(
            cfg.reward.judge.profile, cfg.affinity.profiles).model_dump()
    return settings


def worker_plugin(cfg: TrainConfig, reward: dict) -> RollArcWorkerPlugin:
    """The state every worker of the run holds: engine, trainer, environments, reward clients."""
    return RollArcWorkerPlugin(
        policy=cfg.policy.model_dump(), backend=cfg.engine.backend,
        trainer=cfg.trainer.backend, loss=cfg.trainer.loss, seed=cfg.seed,
        hparams=trainer_hparams(cfg).model_dump(),
        reward=reward, reward_functions=reward_callables(cfg),
        pool_hardware=pool_hardware(cfg), default_pool=effective_pools(cfg)[0].name,
        trainer_gpus=trainer_gpus(cfg), emulation=emulation(cfg.engine),
        stragglers=cfg.faults.stragglers)


def colocated_train_s(cfg: TrainConfig) -> Callable[[list[TrainSample]], float] | None:
    """Monolithic on emulated devices, the device time of a train step over these samples (its
    epochs and minibatches included) on the engines' GPUs, which it time-shares (None: the
    trainer has GPUs of its own)."""
    if cfg.placement != Placement.MONOLITHIC or not is_emulated(cfg.engine):
        return None
    profile, _ = pool_hardware(cfg)[effective_pools(cfg)[0].name]
    device = device_of(HardwareProfile(**profile), trainer_gpus(cfg), cfg.engine.device)
    hp = cfg.trainer.hparams
    return partial(train_step_seconds, device, ppo_epochs=hp.ppo_epochs,
                   minibatches=hp.minibatches)
