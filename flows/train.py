"""Train one policy on a mix of multi-turn environments with RollArc on Dask.

Each trajectory is its own dynamic task graph (prefill on GPU_COMPUTE workers, decode on
GPU_BANDWIDTH workers, environment steps on CPU_ENV workers), a streaming collector forms groups
as trajectories finish, and the trainer trains while rollouts continue (``mode=async``), with
staleness bounded by ``rollout.max_staleness``. ``mode=sync`` and ``placement=monolithic`` are the
baselines of arXiv 2512.22560, run by this same flow.

Rewards are scored by AWS Lambda functions through boto3 (``reward.backend=lambda``); the embedded
default starts a local emulation of the Lambda Invoke API that runs the functions of
``resources/lambda/template.yaml``, so the same client path is exercised without an AWS account.

Departures from the paper: the embedded default emulates hardware profiles with local CPU worker
processes and a tiny Qwen2 policy; the KV cache moves through Dask's worker-to-worker transfers
(TCP) instead of GPU-to-GPU RDMA.

    # embedded default: local cluster, one worker per pool, dashboard on :8787
    python flows/train.py
    # baselines and short runs
    python flows/train.py mode=sync placement=monolithic trainer.max_steps=20
    # an existing cluster (workers: dask worker tcp://HOST:8786 --resources "GPU_COMPUTE=32")
    python flows/train.py --scheduler tcp://HOST:8786 --run-dir runs/cluster
    # rewards on AWS Lambda (after sam deploy; credentials from the usual AWS chain)
    python flows/train.py reward.emulator.enabled=false reward.region=eu-west-1
    # a model-based reward (sentence embeddings) on the text-answer task
    python flows/train.py --config config/text_answer.yaml
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from flows.config import ConfigError, TrainConfig, load_config, resolved_yaml
from flows.metrics import ProgressLine, make_sink
from flows.run import TrainingRun
from resources.affinity import pool_tags, route
from resources.cluster import ClusterHandle, connect, start_local_cluster
from resources.lambda_emulator import LambdaEmulator

logger = logging.getLogger("rollarc")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None, help="YAML config (default: config/default.yaml)")
    p.add_argument("--scheduler", default=None, help="tcp://HOST:PORT of a running scheduler")
    p.add_argument("--run-dir", default=None, help="Run directory (default: runs/<run-id>)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    return p.parse_args(argv)


def make_cluster(cfg: TrainConfig, scheduler: str | None) -> ClusterHandle:
    if scheduler:
        return connect(scheduler, timeout=cfg.cluster.startup_timeout_s)
    pools = cfg.effective_pools()
    routing = route(pools, cfg.affinity.workload, cfg.affinity.objective, cfg.affinity.profiles)
    logger.info("affinity routing: %s", {s.value: p for s, p in routing.items()})
    return start_local_cluster(pools, pool_tags(pools, routing), cfg.cluster.dashboard_port,
                               cfg.cluster.processes, cfg.cluster.startup_timeout_s)


def start_reward_service(cfg: TrainConfig) -> LambdaEmulator | None:
    """backend=lambda with the emulation: start it, and check every function the run calls
    answers a DryRun through the very client the workers use (fail fast, not mid-run)."""
    from resources.reward_client import build_reward_client

    emulator = None
    if cfg.reward.backend == "lambda" and cfg.reward.emulator.enabled:
        e = cfg.reward.emulator
        emulator = LambdaEmulator.from_template(
            e.template, host=e.host, port=e.port, concurrency=e.concurrency,
            latency_s=e.latency_s, init_delay_s=e.init_delay_s, region=cfg.reward.region).start()
    if cfg.reward.backend == "lambda":
        reward = cfg.reward.client_settings(emulator.url if emulator else None)
        try:
            for name in sorted(cfg.reward.functions(cfg.env_tasks)):
                client = build_reward_client(reward, name)
                try:
                    client.check()
                finally:
                    client.close()
        except RuntimeError:
            if emulator is not None:
                emulator.stop()
            raise
        logger.info("reward functions %s reachable at %s", sorted(cfg.reward.functions(
            cfg.env_tasks)), reward["endpoint_url"] or f"AWS Lambda ({cfg.reward.region})")
    return emulator


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("distributed", "tornado", "bokeh"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    run_dir = Path(args.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(resolved_yaml(cfg))
    logger.info("resolved config (saved to %s):\n%s", run_dir / "config.yaml", resolved_yaml(cfg))

    try:
        emulator = start_reward_service(cfg)
    except RuntimeError as exc:
        print(f"reward service error: {exc}", file=sys.stderr)
        return 3
    cluster = make_cluster(cfg, args.scheduler)
    sink = make_sink(cfg.metrics.sink, run_dir)
    try:
        print(f"Dask dashboard: {cluster.dashboard_link}", flush=True)
        run = TrainingRun(cfg, cluster, run_dir, sink, emulator.url if emulator else None)
        run.setup()
        with ProgressLine(cfg.trainer.max_steps, cfg.metrics.progress) as progress:
            run.run(progress)
        run.save()
        summary = run.summary()
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        t = summary["trajectories"]
        print(f"done: v{summary['policy_version']} in {summary['elapsed_s']:.0f}s, "
              f"{t['trained']}/{t['started']} trajectories trained, dropped {t['dropped']}; "
              f"run dir {run_dir}", flush=True)
        r = summary["reward"]
        print(f"reward: {r['invocations']} invocations, {r['mean_batch']:.1f} trajectories per "
              f"call, {r['throttles']} throttles, {sum(r['lost'].values())} trajectories lost "
              "to scoring", flush=True)
    finally:
        sink.close()
        cluster.close()
        if emulator is not None:
            emulator.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
