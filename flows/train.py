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

    # embedded default: local cluster, one worker per pool, dashboard on :8787, the RollArc
    # page on :8787/individual-rollarc, rollarc_* series on :8787/metrics
    python flows/train.py
    # a checkpoint every 20 steps; after a crash, Ctrl-C or SIGTERM, continue the same run
    python flows/train.py trainer.checkpoint_every=20 --run-dir runs/long
    python flows/train.py --resume runs/long
    # metrics to TensorBoard too, and 2 sampled trajectories per step as text
    python flows/train.py "metrics.sinks=[jsonl,tensorboard]" --dump-trajectories 2
    # baselines and short runs
    python flows/train.py mode=sync placement=monolithic trainer.max_steps=20
    # rollout over two schedulers (one scheduler caps the rollout's task rate): a second local
    # cluster holds a copy of the inference and environment pools; training stays on the first
    python flows/train.py cluster.shards=2
    # an existing cluster (workers: dask worker tcp://HOST:8786 --resources "GPU_COMPUTE=32")
    python flows/train.py --scheduler tcp://HOST:8786 --run-dir runs/cluster
    # the same over TLS (scheduler and workers started with the same --tls-* flags)
    python flows/train.py --scheduler tls://HOST:8786 --tls-ca-file ca.pem --tls-cert c.pem --tls-key k.pem
    # rewards on AWS Lambda (after sam deploy; credentials from the usual AWS chain)
    python flows/train.py reward.emulator.enabled=false reward.region=eu-west-1
    # a model-based reward (sentence embeddings) on the text-answer task
    python flows/train.py --config config/text_answer.yaml
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from pathlib import Path

from flows.config import ConfigError, load_config
from flows.training import checkpoints

logger = logging.getLogger("rollarc")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None, help="YAML config (default: config/default.yaml)")
    p.add_argument("--scheduler", default=None, help="tcp://HOST:PORT of a running scheduler")
    p.add_argument("--run-dir", default=None, help="Run directory (default: runs/<run-id>)")
    p.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="Continue RUN_DIR (its config.yaml) from its newest checkpoint to its "
                        "trainer.max_steps (checkpoints: trainer.checkpoint_every)")
    p.add_argument("--dump-trajectories", type=int, default=None, metavar="N",
                   help="Write N sampled trajectories per train step to trajectories.txt "
                        "(metrics.dump_trajectories)")
    p.add_argument("--tls-ca-file", default=None, metavar="PEM",
                   help="TLS for the Dask connections: the CA certificate (cluster.tls.ca_file)")
    p.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="TLS certificate of this run's client, scheduler and workers "
                        "(cluster.tls.cert_file)")
    p.add_argument("--tls-key", default=None, metavar="PEM",
                   help="Private key of --tls-cert (cluster.tls.key_file)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    return p.parse_args(argv)


TLS_FLAGS = {"tls_ca_file": "ca_file", "tls_cert": "cert_file", "tls_key": "key_file"}


def tls_overrides(args: argparse.Namespace) -> list[str]:
    """The cluster.tls overrides of --tls-ca-file, --tls-cert and --tls-key; each path is
    quoted, so that YAML reads it as text whatever it looks like."""
    return [f"cluster.tls.{key}={json.dumps(getattr(args, flag))}"
            for flag, key in TLS_FLAGS.items() if getattr(args, flag) is not None]


def resume_overrides(run_dir: Path) -> tuple[Path, list[str], int]:
    """--resume: the run's config file, the override that resumes from its newest checkpoint,
    and that checkpoint's version. Raises ConfigError naming what is missing."""
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"--resume: {run_dir} has no config.yaml (not a run directory)")
    newest = checkpoints.latest(run_dir)
    if newest is None:
        raise ConfigError(f"--resume: no complete checkpoint under {run_dir / 'checkpoints'} "
                          "(runs write them with trainer.checkpoint_every=N)")
    version = json.loads((newest / checkpoints.DRIVER_STATE).read_text())["version"]
    return (run_dir / "config.yaml",
            [f"trainer.resume_from={newest / checkpoints.TRAINER_STATE}"], version)


def _terminate(signum, frame) -> None:  # SIGTERM stops the run as Ctrl-C does
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        dump = ([] if args.dump_trajectories is None
                else [f"metrics.dump_trajectories={args.dump_trajectories}"])
        flags = [*dump, *tls_overrides(args)]
        config, resume, resumed_version = args.config, [], None
        if args.resume:
            if args.config or args.run_dir:
                raise ConfigError("--resume: the run directory gives the config and the run "
                                  "directory; drop --config and --run-dir")
            config, resume, resumed_version = resume_overrides(Path(args.resume))
        cfg = load_config(config, [*args.overrides, *flags, *resume])
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("distributed", "tornado", "bokeh"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    run_dir = Path(args.resume or args.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    if resumed_version is not None:  # metrics.jsonl continues from the checkpoint's step
        dropped = checkpoints.truncate_metrics(run_dir, resumed_version)
        print(f"resuming {run_dir} at policy version {resumed_version} ({dropped} metric rows "
              "after it dropped)", flush=True)
    signal.signal(signal.SIGTERM, _terminate)
    # the training stack (torch, transformers, Dask) is imported once the config is known good,
    # so that a bad key or value is reported at once
    from flows.api import run_training
    from flows.training.launch import RewardServiceError
    from flows.training.lifecycle import RunFailing

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
    except KeyboardInterrupt:
        print(f"interrupted: work in flight cancelled; summary in {run_dir}", file=sys.stderr)
        return 130
    t = summary["trajectories"]
    print(f"done: v{summary['policy_version']} in {summary['elapsed_s']:.0f}s, "
          f"{t['trained']}/{t['started']} trajectories trained, dropped {t['dropped']}; "
          f"run dir {run_dir}", flush=True)
    r = summary["reward"]
    if cfg.metrics.curves:
        print(f"curves: {run_dir / 'curves.png'} (python -m flows.monitoring.plot {run_dir})", flush=True)
    if cfg.metrics.performance_report:
        print(f"Dask performance report: {run_dir / 'dask-report.html'}", flush=True)
    print(f"reward: {r['invocations']} invocations, {r['mean_batch']:.1f} trajectories per "
          f"call, {r['throttles']} throttles, {sum(r['lost'].values())} trajectories lost "
          "to scoring", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
