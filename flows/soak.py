"""Soak: train for a while under faults, kill a worker of each pool in turn, watch memory.

A long run is where leaks and slow drifts show: futures the driver never releases, environment
instances never closed, a reward client's connections, the scheduler's task records. This flow
trains on the embedded cluster with the faults of ``faults.*`` (environment crashes and hangs,
reward-service errors), SIGKILLs one worker every ``--kill-every`` steps (GPU_COMPUTE,
GPU_BANDWIDTH, CPU_ENV, SERVERLESS, TRAINER in turn; each Nanny starts its worker again), and
records after every chunk the resident memory of the driver, the scheduler and every worker
(by pool), the trajectories in flight and the accounting. It ends with a table and
``<run_dir>/soak.json``.

    python flows/soak.py --minutes 10
    python flows/soak.py --minutes 60 --kill-every 20 trainer.groups_per_step=4
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import psutil

from flows.api import Session
from resources.pools import Tag

KILL_ORDER = [Tag.GPU_COMPUTE, Tag.GPU_BANDWIDTH, Tag.CPU_ENV, Tag.SERVERLESS, Tag.TRAINER]
FAULTS = ["faults.env.crash_rate=0.01", "faults.env.hang_rate=0.002", "faults.env.hang_s=30",
          "rollout.turn_timeout_s=10", "faults.reward.throttle_rate=0.05",
          "faults.reward.error_5xx_rate=0.03", "faults.reward.function_error_rate=0.03",
          "rollout.max_attempts=3", "trainer.checkpoint_every=5", "trainer.keep_checkpoints=2",
          "metrics.progress=false", "eval.every_steps=0"]


def _rss_mb(dask_worker=None) -> float:
    return psutil.Process().memory_info().rss / 2**20


def _scheduler_rss_mb(dask_scheduler=None) -> float:
    return psutil.Process().memory_info().rss / 2**20


def sample(session: Session, run, step: int, elapsed: float) -> dict:
    client, cluster = session.client, session.cluster
    workers = client.run(_rss_mb)
    by_pool: dict[str, float] = {}
    for address, mb in workers.items():
        pool = cluster.worker_pool.get(address, address)
        by_pool[pool] = by_pool.get(pool, 0.0) + mb
    accounts = run._run.ledger.summary()
    # the embedded cluster's scheduler runs in the driver's process: then one figure
    return {"step": step, "elapsed_s": round(elapsed, 1),
            "driver_mb": round(_rss_mb(), 1),
            "scheduler_mb": round(client.run_on_scheduler(_scheduler_rss_mb), 1),
            "scheduler_in_driver": client.run_on_scheduler(os.getpid) == os.getpid(),
            "workers_mb": {k: round(v, 1) for k, v in sorted(by_pool.items())},
            "in_flight": accounts["in_flight"], "started": accounts["started"],
            "trained": accounts["trained"], "dropped": sum(accounts["dropped"].values()),
            "scheduler_tasks": client.run_on_scheduler(
                lambda dask_scheduler=None: len(dask_scheduler.tasks))}


def kill_one(session: Session, tag: Tag) -> str:
    worker = session.cluster.workers_with(tag)[0]
    pid = session.client.run(os.getpid, workers=[worker])[worker]
    os.kill(pid, signal.SIGKILL)
    return worker


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--chunk", type=int, default=5, help="Steps between samples")
    p.add_argument("--kill-every", type=int, default=10, help="Steps between worker kills "
                   "(0: none)")
    p.add_argument("--run-dir", default="runs/soak")
    p.add_argument("overrides", nargs="*", help="Config overrides (key=value)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    overrides = [*FAULTS, *args.overrides, "cluster.dashboard_port=0"]
    session = Session.start(overrides=overrides)
    run_dir = Path(args.run_dir)
    samples, kills = [], []
    try:
        run = session.run(overrides=[*overrides, "trainer.max_steps=100000"], run_dir=run_dir)
        t0 = time.perf_counter()
        samples.append(sample(session, run, 0, 0.0))
        while time.perf_counter() - t0 < args.minutes * 60:
            run.train(args.chunk)
            step = run.version
            samples.append(sample(session, run, step, time.perf_counter() - t0))
            s = samples[-1]
            print(f"step {step:5d}  {s['elapsed_s']:7.0f} s  driver {s['driver_mb']:7.0f} MB  "
                  f"scheduler {s['scheduler_mb']:6.0f} MB  tasks {s['scheduler_tasks']:5d}  "
                  f"in flight {s['in_flight']:3d}  workers {s['workers_mb']}", flush=True)
            if args.kill_every and step and step % args.kill_every < args.chunk:
                tag = KILL_ORDER[len(kills) % len(KILL_ORDER)]
                kills.append({"step": step, "pool": str(tag), "worker": kill_one(session, tag)})
        summary = run.close()
    finally:
        session.close()
    t = summary["trajectories"]
    report = {"samples": samples, "kills": kills, "trajectories": t,
              "faults": summary["faults"], "reward": {k: summary["reward"].get(k) for k in (
                  "invocations", "throttles", "function_errors", "statuses")},
              "unaccounted": t["started"] - t["trained"] - sum(t["dropped"].values())}
    (run_dir / "soak.json").write_text(json.dumps(report, indent=2, default=str))
    first, last = samples[1] if len(samples) > 1 else samples[0], samples[-1]
    print(f"\n{len(kills)} workers killed, {len(summary['faults']['recovery_s'])} recoveries "
          f"(s): {summary['faults']['recovery_s']}")
    print(f"trajectories: started {t['started']}, trained {t['trained']}, dropped "
          f"{t['dropped']}, unaccounted {report['unaccounted']}")
    print(f"driver memory {first['driver_mb']:.0f} -> {last['driver_mb']:.0f} MB, scheduler "
          f"{first['scheduler_mb']:.0f} -> {last['scheduler_mb']:.0f} MB, scheduler tasks "
          f"{first['scheduler_tasks']} -> {last['scheduler_tasks']}")
    print(f"report: {run_dir / 'soak.json'}")
    return 0 if report["unaccounted"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
