"""Starting and stopping what a run needs: the cluster, the reward service, the ordered
shutdown; the workers' engines as the device model sees them. :mod:`flows.api` runs training on them."""

from __future__ import annotations

import logging

from flows.config import ConfigError, TrainConfig
from flows.config.choices import RewardBackend
from flows.config.derived import (
    device_model,
    effective_pools,
    lambda_functions,
    pool_hardware,
    reward_client_settings,
    tls_security,
)
from flows.training.turn_placement import Dispatch
from resources.affinity import pool_tags, route
from resources.catalog import HardwareProfile
from resources.cluster import ClusterHandle, connect, start_local_cluster
from resources.device_model import DeviceModel
from resources.hardware import PoolRouter
from resources.lambda_emulator import LambdaEmulator
from resources.pools import PoolSpec, Tag
from resources.worker import quiet_close

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
    router = pool_router(cfg)
    security = tls_security(cfg.cluster.tls)  # None: plain TCP
    if scheduler:
        return connect(scheduler, timeout=cfg.cluster.startup_timeout_s, route_pools=router,
                       security=security)
    pools = effective_pools(cfg)
    return start_local_cluster(pools, router(pools), cfg.cluster.dashboard_port,
                               cfg.cluster.processes, cfg.cluster.startup_timeout_s,
                               host=cfg.cluster.host, security=security,
                               lost_worker_timeout_s=cfg.cluster.pool_empty_timeout_s,
                               worker_ttl_s=cfg.cluster.worker_ttl_s)


def start_reward_service(cfg: TrainConfig) -> LambdaEmulator | None:
    """backend=lambda with the emulation: check the template has the functions the run calls
    and start it. backend=lambda: check every function answers a DryRun through the very
    client the workers use (fail fast, not mid-run). Raises ConfigError or RewardServiceError."""
    from resources.lambda_build import check_template_functions
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
    """``rollout.dispatch=length_aware``: each inference worker's engine of ``cluster`` as the
    device model sees it (None: the split, also when a worker's pool is unknown)."""
    if cfg.rollout.dispatch is Dispatch.SPLIT:
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
