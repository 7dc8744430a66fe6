"""Soak: train for a while under faults, kill a worker of each pool in turn, watch memory.

A long run is where leaks and slow drifts show: futures the driver never releases, environment
instances never closed, a reward client's connections, the scheduler's task records. This flow
trains on the embedded cluster with the faults of ``faults.*`` (environment crashes and hangs,
reward-service errors), SIGKILLs one worker every ``--kill-every-s`` seconds while it trains
(GPU_COMPUTE, GPU_BANDWIDTH, CPU_ENV, SERVERLESS, TRAINER in turn; each Nanny starts its worker
again), and records after every chunk of steps the resident memory of every process (the
driver, the scheduler, each worker process by pool and pid), the trajectories in flight and the
accounting. A process's growth is measured from ``--warmup-minutes`` after its first sample to
its last. It ends with a table and ``<run_dir>/soak.json``, and exits 1 when a trajectory is
unaccounted for or a process grew more than ``--max-growth``.

    python flows/soak.py --minutes 10
    python flows/soak.py --minutes 30 --kill-every-s 180       # the release check
    python flows/soak.py --minutes 60 --kill-every-s 300 trainer.groups_per_step=4
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
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


def _pid_rss_mb(dask_worker=None) -> tuple[int, float]:
    return os.getpid(), _rss_mb()


def sample(session: Session, run, step: int, elapsed: float) -> dict:
    client, cluster = session.client, session.cluster
    workers = {a: r for a, r in client.run(_pid_rss_mb, on_error="return").items()
               if isinstance(r, tuple)}  # a worker just killed is skipped
    by_pool: dict[str, float] = {}
    processes = {"driver": round(_rss_mb(), 1)}
    for address, (pid, mb) in workers.items():
        pool = cluster.worker_pool.get(address, address)
        by_pool[pool] = by_pool.get(pool, 0.0) + mb
        processes[f"{pool}/{pid}"] = round(mb, 1)
    accounts = run.accounts()
    # the embedded cluster's scheduler runs in the driver's process: then one figure
    return {"step": step, "elapsed_s": round(elapsed, 1),
            "driver_mb": round(_rss_mb(), 1),
            "scheduler_mb": round(client.run_on_scheduler(_scheduler_rss_mb), 1),
            "scheduler_in_driver": client.run_on_scheduler(os.getpid) == os.getpid(),
            "workers_mb": {k: round(v, 1) for k, v in sorted(by_pool.items())},
            "processes_mb": processes,
            "in_flight": accounts["in_flight"], "started": accounts["started"],
            "trained": accounts["trained"], "dropped": sum(accounts["dropped"].values()),
            "scheduler_tasks": client.run_on_scheduler(
                lambda dask_scheduler=None: len(dask_scheduler.tasks))}


def kill_one(session: Session, tag: Tag) -> str:
    worker = session.cluster.workers_with(tag)[0]
    pid = session.client.run(os.getpid, workers=[worker])[worker]
    os.kill(pid, signal.SIGKILL)
    return worker


def growth(samples: list[dict], warmup_s: float) -> dict[str, dict]:
    """Per process: its memory from ``warmup_s`` after its first sample to its last (processes
    sampled at least twice after their warm-up), as MB and a fraction."""
    series: dict[str, list[tuple[float, float]]] = {}
    for s in samples:
        for name, mb in s["processes_mb"].items():
            series.setdefault(name, []).append((s["elapsed_s"], mb))
    out = {}
    for name, points in series.items():
        after = [mb for t, mb in points if t >= points[0][0] + warmup_s]
        if len(after) >= 2:
            out[name] = {"from_mb": after[0], "to_mb": after[-1],
                         "growth": round(after[-1] / after[0] - 1, 4),
                         "span_s": round(points[-1][0] - points[0][0], 1)}
    return out


class Killer:
    """SIGKILLs a worker of each pool in turn, every ``every_s`` seconds, from a thread of its
    own: the kills land while the run trains, at moments the run does not choose."""

    def __init__(self, session: Session, every_s: float):
        self.session, self.every_s, self.t0 = session, every_s, 0.0
        self.kills: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="soak-killer")

    def start(self, t0: float) -> Killer:
        """Kill from now on; kill times are reported from ``t0`` (perf_counter)."""
        self.t0 = t0
        if self.every_s:
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            tag = KILL_ORDER[len(self.kills) % len(KILL_ORDER)]
            try:
                worker = kill_one(self.session, tag)
            except Exception as exc:  # its pool is still recovering from an earlier kill
                logging.getLogger("rollarc.soak").warning("no kill of %s: %s", tag, exc)
                continue
            self.kills.append({"at_s": round(time.perf_counter() - self.t0, 1),
                               "pool": str(tag), "worker": worker})

    def stop(self) -> None:
        self._stop.set()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--chunk", type=int, default=5, help="Steps between samples")
    p.add_argument("--kill-every-s", type=float, default=120, help="Seconds between worker "
                   "kills, while it trains (0: none)")
    p.add_argument("--warmup-minutes", type=float, default=5, help="A process's memory is "
                   "measured from this long after its first sample")
    p.add_argument("--max-growth", type=float, default=0.10, help="Largest memory growth of "
                   "a process after its warm-up (a fraction)")
    p.add_argument("--run-dir", default="runs/soak")
    p.add_argument("overrides", nargs="*", help="Config overrides (key=value)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    overrides = [*FAULTS, *args.overrides, "cluster.dashboard_port=0"]
    session = Session.start(overrides=overrides)
    run_dir = Path(args.run_dir)
    samples = []
    killer = Killer(session, args.kill_every_s)
    try:
        run = session.run(overrides=[*overrides, "trainer.max_steps=100000"], run_dir=run_dir)
        t0 = time.perf_counter()
        samples.append(sample(session, run, 0, 0.0))
        killer.start(t0)
        while time.perf_counter() - t0 < args.minutes * 60:
            run.train(args.chunk)
            step = run.version
            samples.append(sample(session, run, step, time.perf_counter() - t0))
            s = samples[-1]
            print(f"step {step:5d}  {s['elapsed_s']:7.0f} s  driver {s['driver_mb']:7.0f} MB  "
                  f"scheduler {s['scheduler_mb']:6.0f} MB  tasks {s['scheduler_tasks']:5d}  "
                  f"in flight {s['in_flight']:3d}  workers {s['workers_mb']}", flush=True)
        killer.stop()
        summary = run.close()
    finally:
        killer.stop()
        session.close()
    kills = killer.kills
    t = summary["trajectories"]
    grown = growth(samples, args.warmup_minutes * 60)
    worst = max(grown.items(), key=lambda kv: kv[1]["growth"], default=(None, None))
    report = {"samples": samples, "kills": kills, "trajectories": t, "growth": grown,
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
    for name, g in sorted(grown.items()):
        print(f"  {name:28s} {g['from_mb']:7.0f} -> {g['to_mb']:7.0f} MB  "
              f"{100 * g['growth']:+5.1f} % over {g['span_s']:.0f} s")
    if worst[0] is not None:
        print(f"largest growth after warm-up: {worst[0]} {100 * worst[1]['growth']:+.1f} % "
              f"(limit {100 * args.max_growth:.0f} %)")
    print(f"report: {run_dir / 'soak.json'}")
    too_much = worst[0] is not None and worst[1]["growth"] > args.max_growth
    return 0 if report["unaccounted"] == 0 and not too_much else 1


if __name__ == "__main__":
    sys.exit(main())
