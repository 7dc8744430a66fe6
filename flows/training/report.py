"""What a run reports: the dashboard page's live figures, and the summary at its end
(``summary.json``)."""

from __future__ import annotations

import json
import time
from collections import Counter, defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypedDict

from flows.config.choices import Mode
from flows.config.derived import is_emulated
from flows.monitoring import critical_path
from flows.training.lifecycle import TrajState
from resources.placement import placement_snapshot, task_stream_snapshot
from resources.pools import Tag
from resources.worker import worker_report

if TYPE_CHECKING:
    from distributed import Client

    from flows.config import TrainConfig
    from flows.training.checkpoints import Checkpointer
    from flows.training.core import RunCore
    from flows.training.env_scaler import EnvPoolScaler
    from flows.training.evaluation import Evaluator
    from flows.training.events import RunClock
    from flows.training.reward_bursts import RewardBursts
    from flows.training.rollout import RolloutDriver
    from flows.training.shards import RolloutShards
    from flows.training.train_steps import TrainSteps
    from flows.training.trainer_handle import TrainerHandle
    from flows.training.weights import WeightLoads
    from flows.training.worker_changes import WorkerChanges
    from resources.cluster import ClusterHandle


class ReportedRun(Protocol):
    """What a report reads of a run (:class:`flows.training.run.TrainingRun` has it all)."""

    cfg: TrainConfig
    client: Client
    cluster: ClusterHandle
    run_dir: Path
    reward_cfg: dict
    core: RunCore
    clock: RunClock
    driver: RolloutDriver
    drivers: list[RolloutDriver]
    shards: RolloutShards
    rewards: RewardBursts
    trainer: TrainerHandle
    steps: TrainSteps
    weights: WeightLoads
    checkpoints: Checkpointer
    changes: WorkerChanges
    evaluator: Evaluator
    scaler: EnvPoolScaler | None

    @property
    def version(self) -> int: ...

    @property
    def elapsed_s(self) -> float: ...


IN_FLIGHT_STATES = (TrajState.ADMITTED, TrajState.ROLLING_OUT, TrajState.AWAITING_SCORE,
                    TrajState.SCORING, TrajState.IN_GROUP, TrajState.TRAINING)


def live_figures(run: ReportedRun) -> dict:
    """What the dashboard page shows besides the metric rows."""
    pools: Counter[str] = Counter()
    for w, n in run.driver.pool_workers.load.items():
        pools[run.cluster.worker_pool.get(w, w)] += max(n, 0)
    ledger = run.core.ledger
    accounts = ledger.summary()
    states = {str(s): ledger.count(s) for s in IN_FLIGHT_STATES}
    states["trained"] = accounts["trained"]
    return {"states": states, "dropped": accounts["dropped"],
            "in_flight_per_pool": dict(sorted(pools.items())),
            "staleness_hist": {str(k): v for k, v in sorted(run.core.staleness_hist.items())},
            "worker_versions": {f"{run.cluster.worker_pool.get(w, '?')} {w}": v
                                for w, v in sorted(run.weights.worker_versions.items())},
            "policy_version": run.version,
            # the latest trained step's critical path (from the driver's timings)
            "critical_path": next(iter(critical_path_steps(run, last=1)), None)}


def critical_path_steps(run: ReportedRun, tasks: list | None = None,
                        last: int | None = None) -> list[dict]:
    """The last trained steps' critical paths (:mod:`flows.monitoring.critical_path`);
    ``tasks``: the run's task stream, when recorded."""
    cfg, cluster = run.cfg, run.cluster
    pool_of = dict(cluster.worker_pool)
    for shard in run.shards.further:
        pool_of |= shard.cluster.worker_pool
    reward = sorted({pool_of.get(w, w) for w in cluster.workers_with(Tag.SERVERLESS)})
    shape = critical_path.RunShape(pool_of, pool_of.get(run.trainer.worker or "", "trainer"),
                                   ",".join(reward) or "reward", cfg.mode == Mode.SYNC)
    # the run's start on the wall clock (its clock is perf_counter's)
    start = time.time() - (time.perf_counter() - run.clock.t0) if run.clock.t0 else 0.0

    def turns_of(trajectory: str):
        return next((found for d in run.drivers if (found := d.timings.of(trajectory))), None)

    return critical_path.breakdowns(run.steps.timings, turns_of, shape, start, tasks, last)


class RunSummary(TypedDict, total=False):
    """A run's account at its end, as ``summary.json`` holds it (the ``status`` of how it ended
    is added by :class:`flows.training.session_run.Run` as it ends)."""
    final_metrics: dict  # the last train step's metrics row
    policy_version: int
    trajectories: dict  # started, finished, trained, dropped (by reason), truncated
    drop_details: list  # the first 20 drops: trajectory, reason, detail
    evaluation: dict  # episodes started and dropped, the last round's metrics
    tasks_per_stage_per_pool: dict[str, dict[str, int]]
    rollout_tasks_submitted: dict[str, int]
    shards: list[dict]  # per rollout shard: scheduler, groups, tasks
    reward: dict  # calls, chunks, throttles, lost; backend and endpoint
    live_env_instances_at_end: int  # environments left open: 0 unless something leaked
    faults: dict  # worker changes, recovery seconds, restarts, resent scores, checkpoints
    env_pool: list[dict]  # the environment pool's size over time (cluster.adaptive_env)
    turns: dict  # count, mean wall and emulated-wait seconds
    workers: dict[str, dict]  # each worker's report, with its pool
    train_windows_s: list[tuple[float, float]]  # each train step, from the run's start
    env_task_affinity: dict | None  # turn_placement=env_task: each env task's home, prices
    # the last steps' critical paths: time_scale, steps (flows.monitoring.critical_path)
    critical_path: dict
    elapsed_s: float
    status: str


def summary(run: ReportedRun) -> RunSummary:
    """The run's account at its end: trajectories, placement, rewards, faults, workers."""
    cfg, client, pool_of = run.cfg, run.client, run.cluster.worker_pool
    placement = client.run_on_scheduler(placement_snapshot)
    by_pool: dict[str, Counter] = defaultdict(Counter)
    for stage, per_worker in placement.items():
        for w, n in per_worker.items():
            by_pool[stage][pool_of.get(w, w)] += n
    # a worker lost at the very end is skipped, not waited on
    reports = {w: r for w, r in client.run(worker_report, on_error="return").items()
               if isinstance(r, dict)}
    live_envs = sum(r.get("envs", {}).get("live", 0) for r in reports.values())
    live_envs += run.shards.live_envs()
    accounts = run.core.ledger.summary()
    drivers = run.drivers
    n_turns = sum(d.turns.totals[0] for d in drivers)
    submitted: Counter[str] = Counter()
    truncated: Counter[str] = Counter()
    restarts: Counter[str] = Counter()
    for d in drivers:
        submitted.update(d.tasks.submitted)
        truncated.update(d.truncated)
        restarts.update(d.faults.restarts)
    t0 = run.clock.t0 or 0.0
    stream = client.run_on_scheduler(task_stream_snapshot) if cfg.metrics.task_stream else None
    if cfg.metrics.task_stream:
        (run.run_dir / "task_stream.json").write_text(json.dumps(
            {"tasks": stream,
             "turns": [t for d in drivers for t in d.turns.each],
             # each turn's virtual lengths and environment latency, in the order of "turns"
             "turn_work": [asdict(w) for d in drivers for w in d.turns.work],
             "workers": {a: pool_of.get(a, a) for a in reports}}))
    written = run.checkpoints.seconds
    account: RunSummary = {
        "final_metrics": run.steps.last_metrics,
        "policy_version": run.version,
        "trajectories": {k: accounts[k] for k in ("started", "finished", "trained", "dropped")}
        | {"truncated": dict(truncated)},
        "drop_details": run.core.ledger.drop_details[:20],
        "evaluation": {"episodes_started": accounts["evaluation"]["started"],
                       "dropped": accounts["evaluation"]["dropped"],
                       "last": run.evaluator.last},
        "tasks_per_stage_per_pool": {k: dict(v) for k, v in sorted(by_pool.items())},
        "rollout_tasks_submitted": dict(submitted),
        "shards": run.shards.summary(),
        "reward": run.rewards.stats.summary() | {
            "backend": cfg.reward.backend,
            "endpoint": run.reward_cfg["endpoint_url"] or "aws",
            "score_tasks": run.rewards.score_tasks,
            "lost": run.rewards.lost()},
        "live_env_instances_at_end": live_envs,
        "faults": {"worker_changes": run.changes.log,
                   "recovery_s": [round(s, 3) for s in run.core.recoveries_s],
                   "restarted": dict(restarts),
                   "score_tasks_resent": sum(run.rewards.resent.values()),
                   "checkpoints": {"every": cfg.trainer.checkpoint_every,
                                   "written": len(written),
                                   "mean_s": round(sum(written) / max(len(written), 1), 3)}},
        "env_pool": [] if run.scaler is None else [
            dict(h, at=round(h["at"] - t0, 2)) for h in run.scaler.history],
        "turns": {"count": n_turns,
                  "wall_s_mean": sum(d.turns.totals[1] for d in drivers) / max(n_turns, 1),
                  "emulated_wait_s_mean": sum(d.turns.totals[2] for d in drivers)
                  / max(n_turns, 1)},
        "workers": {a: dict(r, pool=pool_of.get(a, a)) for a, r in reports.items()},
        "train_windows_s": [(a - t0, b - t0) for a, b in run.steps.windows],
        # rollout.turn_placement=env_task: each env task's home pool and its prices
        "env_task_affinity": (run.driver.placer.affinity.mapping()
                              if run.driver.placer.affinity is not None else None),
        "critical_path": {"time_scale": cfg.engine.time_scale if is_emulated(cfg.engine)
                          else 1.0, "steps": critical_path_steps(run, stream)},
        "elapsed_s": run.elapsed_s,
    }
    return account
