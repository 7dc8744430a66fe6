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
import logging
import sys
import time
from pathlib import Path

from flows.config import ConfigError, load_config
from flows.launch import RewardServiceError, run_training
from flows.lifecycle import RunFailing

logger = logging.getLogger("rollarc")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None, help="YAML config (default: config/default.yaml)")
    p.add_argument("--scheduler", default=None, help="tcp://HOST:PORT of a running scheduler")
    p.add_argument("--run-dir", default=None, help="Run directory (default: runs/<run-id>)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    return p.parse_args(argv)


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
    try:
        summary = run_training(cfg, run_dir, scheduler=args.scheduler,
                               dashboard=lambda line: print(line, flush=True))
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except RewardServiceError as exc:
        print(f"reward service error: {exc}", file=sys.stderr)
        return 3
    except RunFailing as exc:
        print(f"run stopped: {exc}", file=sys.stderr)
        return 1
    t = summary["trajectories"]
    print(f"done: v{summary['policy_version']} in {summary['elapsed_s']:.0f}s, "
          f"{t['trained']}/{t['started']} trajectories trained, dropped {t['dropped']}; "
          f"run dir {run_dir}", flush=True)
    r = summary["reward"]
    print(f"reward: {r['invocations']} invocations, {r['mean_batch']:.1f} trajectories per "
          f"call, {r['throttles']} throttles, {sum(r['lost'].values())} trajectories lost "
          "to scoring", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
