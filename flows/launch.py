"""Starting and stopping what a run needs, and the Python API that runs one.

:func:`run_training` is what ``flows/train.py`` calls and what a notebook calls::

    from flows.config import load_config, validate
    from flows.launch import run_training
    from tasks.stages import Stages

    cfg = load_config(overrides=["trainer.max_steps=10", "reward.backend=local"])
    cfg.env_tasks[0].reward_fn = my_reward          # a function defined in the notebook
    summary = run_training(validate(cfg), "runs/nb", stages=Stages(env_step=my_env_step))
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from flows.config import ConfigError, TrainConfig, resolved_yaml, validate
from flows.lifecycle import TrajectoryLedger, Transition
from flows.metrics import ProgressLine, make_sink
from flows.run import TrainingRun
from resources.affinity import pool_tags, route
from resources.cluster import ClusterHandle, connect, start_local_cluster
from resources.lambda_emulator import LambdaEmulator
from tasks.stages import Stages

logger = logging.getLogger(__name__)


class RewardServiceError(RuntimeError):
    """The reward functions cannot be reached: the run stops before the cluster starts."""


def make_cluster(cfg: TrainConfig, scheduler: str | None) -> ClusterHandle:
    """Connect to ``scheduler``, or start the embedded local cluster of ``cfg``'s pools with
    the stages routed by the affinity cost model."""
    if scheduler:
        return connect(scheduler, timeout=cfg.cluster.startup_timeout_s)
    pools = cfg.effective_pools()
    routing = route(pools, cfg.affinity.workload, cfg.affinity.objective, cfg.affinity.profiles)
    logger.info("affinity routing: %s", {s.value: p for s, p in routing.items()})
    return start_local_cluster(pools, pool_tags(pools, routing), cfg.cluster.dashboard_port,
                               cfg.cluster.processes, cfg.cluster.startup_timeout_s)


def start_reward_service(cfg: TrainConfig) -> LambdaEmulator | None:
    """backend=lambda with the emulation: check the template has the functions the run calls
    and start it. backend=lambda: check every function answers a DryRun through the very
    client the workers use (fail fast, not mid-run). Raises ConfigError or RewardServiceError."""
    from resources.lambda_build import check_template_functions
    from resources.reward_backends import build_reward_client

    if cfg.reward.backend != "lambda":
        return None
    emulator = None
    names = sorted(cfg.reward.functions(cfg.env_tasks))
    if cfg.reward.emulator.enabled:
        e = cfg.reward.emulator
        try:
            check_template_functions(e.template, names, cfg.reward.read_timeout_s)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        emulator = LambdaEmulator.from_template(
            e.template, host=e.host, port=e.port, concurrency=e.concurrency,
            latency_s=e.latency_s, init_delay_s=e.init_delay_s, region=cfg.reward.region).start()
    reward = cfg.reward.client_settings(emulator.url if emulator else None)
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
    for name in ("distributed", "tornado"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    cluster.close()


def run_training(cfg: TrainConfig, run_dir: str | Path, *, scheduler: str | None = None,
                 stages: Stages | None = None, progress: bool | None = None,
                 on_transition: Callable[[Transition, TrajectoryLedger], None] | None = None,
                 dashboard: Callable[[str], object] = print) -> dict:
    """Run one training job end to end and return its summary (also written to
    ``<run_dir>/summary.json``). ``stages`` replaces stage functions; ``on_transition`` sees
    every change of a trajectory's state; ``dashboard`` is called with the dashboard line once
    the cluster is up. Raises ConfigError or RewardServiceError before any cluster starts."""
    cfg = validate(cfg)
    emulator = start_reward_service(cfg)
    sink = cluster = None
    try:
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        resolved = resolved_yaml(cfg)
        (run_dir / "config.yaml").write_text(resolved)
        logger.info("resolved config (saved to %s):\n%s", run_dir / "config.yaml", resolved)
        sink = make_sink(cfg.metrics.sink, run_dir)
        cluster = make_cluster(cfg, scheduler)
        dashboard(f"Dask dashboard: {cluster.dashboard_link}")
        run = TrainingRun(cfg, cluster, run_dir, sink, emulator.url if emulator else None,
                          stages=stages, on_transition=on_transition)
        run.setup()
        show = cfg.metrics.progress if progress is None else progress
        with ProgressLine(cfg.trainer.max_steps, show) as line:
            run.train(line)
        run.save()
        summary = run.summary()
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        return summary
    finally:
        if sink is not None:
            sink.close()
        if cluster is not None:
            close_quietly(cluster)
        if emulator is not None:
            emulator.stop()
