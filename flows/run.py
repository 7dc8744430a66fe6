"""The training loop: admission, trajectory graphs, streaming collector, trainer, weight sync.

One event loop on the driver reacts to finished futures (``as_completed``), each a small result:
an env_step (a turn done), a score batch, a train step, a weight load. Every decision it takes is
one of the pure functions of :mod:`flows.orchestration`.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from distributed import Future, as_completed, wait

from flows.config import TrainConfig
from flows.metrics import MetricSink, ProgressLine
from flows.orchestration import (
    AdmissionState,
    BatchDecision,
    GroupCollector,
    Router,
    admission_room,
    groups_to_cut,
    sample_env_task,
)
from flows.rollout import RolloutDriver, score_requests
from resources.cluster import ClusterHandle
from resources.placement import PlacementRecorder, placement_snapshot
from resources.pools import Stage, Tag, demand
from resources.worker import (
    RollArcWorkerPlugin,
    with_engine,
    with_reward_client,
    with_trainer,
    worker_report,
)
from tasks.envs.base import eval_seed
from tasks.policy import load_tokenizer, stop_token_ids
from tasks.records import InvocationRecord, ScoreBatch, TrainBatch, TrainStats, Trajectory
from tasks.scoring import score
from tasks.trainer import load_weights, publish_weights, save_checkpoint, train_step

logger = logging.getLogger(__name__)

EVAL_GROUP = "eval."  # group ids of evaluation episodes: eval.<policy version>


@dataclass
class RunState:
    version: int = 0
    trained: int = 0
    finished: int = 0
    trainer_busy: bool = False
    loads_pending: int = 0
    pending_score: list[Trajectory] = field(default_factory=list)
    scoring: dict[str, list[Trajectory]] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)  # future key -> kind
    batch_info: dict | None = None
    train_windows: list[tuple[float, float]] = field(default_factory=list)
    train_submitted_at: float = 0.0
    groups: int = 0
    score_tasks: int = 0


@dataclass
class RewardStats:
    """Every reward-function call of the run, from the clients' records."""

    calls: list[InvocationRecord] = field(default_factory=list)
    deduplicated: int = 0

    def add(self, batch: ScoreBatch) -> None:
        self.calls.extend(batch.invocations)
        self.deduplicated += batch.deduplicated

    def summary(self) -> dict:
        c = self.calls
        reached = [r for r in c if r.status in ("ok", "function_error", "bad_event")]
        lat = [r.latency_s * 1000 for r in c]
        init = [r.init_ms for r in c if r.init_ms is not None]
        return {
            "invocations": len(c),
            "trajectories_sent": sum(r.batch_size for r in reached),
            "mean_batch": float(np.mean([r.batch_size for r in reached])) if reached else 0.0,
            "latency_ms_p50": float(np.percentile(lat, 50)) if lat else 0.0,
            "latency_ms_p99": float(np.percentile(lat, 99)) if lat else 0.0,
            "sdk_retries": sum(r.sdk_retries for r in c),
            "throttles": sum(r.throttles for r in c),
            "client_retries": sum(r.attempt > 0 for r in c),
            "function_errors": sum(r.status == "function_error" for r in c),
            "cold_starts": len(init),
            "init_ms_mean": float(np.mean(init)) if init else 0.0,
            "statuses": dict(Counter(r.status for r in c)),
            "deduplicated": self.deduplicated,
        }


def _by_env(trajs: list[Trajectory]) -> dict[str, list[Trajectory]]:
    by_env: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        by_env[t.env_name].append(t)
    return by_env


def _episode_metrics(prefix: str, ts: list[Trajectory]) -> dict[str, float]:
    """What training batches and evaluations both report per environment."""
    return {f"{prefix}/success": float(np.mean([t.success for t in ts])),
            f"{prefix}/turns": float(np.mean([t.num_turns for t in ts])),
            f"{prefix}/format_errors": float(np.mean([t.format_errors for t in ts]))}


class TrainingRun:
    """Wires the cluster, the rollout driver, the collector and the trainer for one run."""

    def __init__(self, cfg: TrainConfig, cluster: ClusterHandle, run_dir: Path, sink: MetricSink,
                 reward_endpoint: str | None = None):
        self.cfg, self.cluster, self.run_dir, self.sink = cfg, cluster, run_dir, sink
        if cfg.reward.backend == "lambda" and cfg.reward.emulator.enabled and not reward_endpoint:
            raise ValueError("reward.emulator.enabled: pass the running emulation's URL as "
                             "reward_endpoint (flows.train.start_reward_service starts it)")
        # the reward config the workers' clients are built from, endpoint resolved
        self.reward_cfg = cfg.reward.client_settings(reward_endpoint)
        self.client = cluster.client
        self.router = Router({str(t): cluster.workers_with(t) for t in Tag})
        for tag in Tag:
            if not cluster.workers_with(tag):
                raise RuntimeError(f"no worker advertises the resource {tag}; start workers with "
                                   f"--resources \"{tag}=<slots>\"")
        self.trainer_worker = cluster.workers_with(Tag.TRAINER)[0]
        self.inference_workers = sorted(set(cluster.workers_with(Tag.GPU_COMPUTE))
                                        | set(cluster.workers_with(Tag.GPU_BANDWIDTH)))
        tokenizer = load_tokenizer(cfg.policy)
        self.run_id = run_dir.name
        self.driver = RolloutDriver(self.client, cfg, self.router, stop_token_ids(tokenizer),
                                    self.run_id)
        self.collector = GroupCollector()
        self.state = RunState()
        self.rng = random.Random(cfg.seed)
        self.reward_fns = {t.name: t.reward for t in cfg.env_tasks}
        self.reward_function = {t.name: t.reward_function or cfg.reward.function_name
                                for t in cfg.env_tasks}
        self.reward_stats = RewardStats()
        self.eval_rounds: dict[str, dict] = {}
        self.last_eval: dict = {}
        # one score task carries what the client can send at once; it fans the burst out itself
        self.score_task_max = cfg.reward.batch_max * cfg.reward.concurrency
        self.env_names = [t.name for t in cfg.env_tasks]
        self.ac = as_completed(raise_errors=False)
        self.batch_trajectories = sum(
            t.group_size * t.weight for t in cfg.env_tasks) / sum(
            t.weight for t in cfg.env_tasks) * cfg.trainer.groups_per_step
        self.reward_failure_streak = 0
        self.max_reward_failure_streak = 4 * int(round(self.batch_trajectories))
        self.t0 = time.perf_counter()
        self._next_task = None
        # a rolling-out trajectory holds at most one task of each pool at a time
        self.pool_slots = min(cluster.slots(t) for t in (Tag.GPU_COMPUTE, Tag.GPU_BANDWIDTH,
                                                          Tag.CPU_ENV))

    # -- set-up -----------------------------------------------------------------------------
    def setup(self) -> None:
        self.client.register_plugin(PlacementRecorder())
        self.client.register_plugin(RollArcWorkerPlugin(
            policy=self.cfg.policy.model_dump(),
            trainer=self.cfg.trainer.hparams.model_dump()
            | {"total_steps": self.cfg.trainer.hparams.total_steps or self.cfg.trainer.max_steps},
            seed=self.cfg.seed, reward=self.reward_cfg))
        if self.cfg.trainer.resume_from:
            from tasks.trainer import PolicyTrainer

            fut = self.client.submit(with_trainer, PolicyTrainer.load_checkpoint,
                                     self.cfg.trainer.resume_from, key="resume-0",
                                     workers=[self.trainer_worker],
                                     resources=demand(Stage.TRAIN_STEP), pure=False)
            self.state.version = fut.result()
            # new group seeds after a resume, not a replay of the first run's
            self.rng = random.Random(f"{self.cfg.seed}/{self.state.version}")
            logger.info("resumed at policy version %d", self.state.version)
        # Every inference worker starts from the trainer's weights, version-stamped.
        for f in self._sync_weights(track=False):
            f.result()

    def _sync_weights(self, track: bool = True) -> list[Future]:
        """Publish the trainer's weights and load them on every inference worker, worker to
        worker; each engine switches at its next safe point."""
        v = self.state.version
        snap = self.client.submit(with_trainer, publish_weights, key=f"publish_weights-{v}",
                                  workers=[self.trainer_worker], pure=False,
                                  resources=demand(Stage.PUBLISH_WEIGHTS))
        futs = []
        for i, w in enumerate(self.inference_workers):
            tag = Tag.GPU_COMPUTE if w in self.cluster.workers_with(Tag.GPU_COMPUTE) else Tag.GPU_BANDWIDTH
            f = self.client.submit(with_engine, load_weights, snap, key=f"load_weights-{v}-{i}",
                                   workers=[w], pure=False, allow_other_workers=False,
                                   resources=demand(Stage.LOAD_WEIGHTS, tag))
            futs.append(f)
            if track:
                self._track(f, "load")
                self.state.loads_pending += 1
        return futs

    def _track(self, fut: Future, kind: str) -> None:
        self.state.kinds[fut.key] = kind
        self.ac.add(fut)

    # -- decisions --------------------------------------------------------------------------
    def _admission(self) -> AdmissionState:
        s = self.state
        unconsumed = (self.driver.training_live + len(s.pending_score)
                      + sum(len(v) for v in s.scoring.values())
                      + self.collector.ready_trajectories + self.collector.open_members)
        ro = self.cfg.rollout
        return AdmissionState(
            mode=self.cfg.mode, rolling_out=self.driver.training_live, unconsumed=unconsumed,
            batch_trajectories=int(round(self.batch_trajectories)),
            window_batches=ro.window_batches,
            spare_trajectories=ro.spare_groups * max(t.group_size for t in self.cfg.env_tasks),
            max_in_flight=ro.max_in_flight, pool_slots=self.pool_slots,
            trainer_busy=s.trainer_busy, weights_syncing=s.loads_pending > 0,
            stopping=self.driver.stopping)

    def _admit(self) -> None:
        """Start whole groups while they fit in the room admission control gives."""
        room = admission_room(self._admission())
        weights = [t.weight for t in self.cfg.env_tasks]
        while True:
            if self._next_task is None:
                self._next_task = self.cfg.env_tasks[sample_env_task(weights, self.rng)]
            task = self._next_task
            if task.group_size > room:
                return
            room -= task.group_size
            self._next_task = None
            gid = f"{task.name}.{self.state.groups}"
            self.state.groups += 1
            seed = self.rng.randrange(task.seed_range)
            self.collector.open_group(gid, task.name, task.group_size)
            for _ in range(task.group_size):
                self._track(self.driver.new_trajectory(gid, task, seed), "step")

    def _flush_scores(self) -> None:
        """Send finished trajectories to their reward function: one score task per function and
        burst, on the SERVERLESS pool; the client there packs and fans out the invocations."""
        s = self.state
        by_function: dict[str, list[Trajectory]] = defaultdict(list)
        for t in s.pending_score:
            by_function[self.reward_function[t.env_name]].append(t)
        s.pending_score = []
        for function, trajs in by_function.items():
            for i in range(0, len(trajs), self.score_task_max):
                batch = trajs[i: i + self.score_task_max]
                fut = self.client.submit(
                    with_reward_client, score, function,
                    score_requests(batch, self.reward_fns, self.run_id),
                    key=f"score-{s.score_tasks}", workers=[self.router.choose(Tag.SERVERLESS)],
                    pure=False, resources=demand(Stage.SCORE))
                s.score_tasks += 1
                s.scoring[fut.key] = batch
                self._track(fut, "score")

    def _maybe_train(self) -> None:
        s = self.state
        if s.trainer_busy or s.version >= self.cfg.trainer.max_steps:
            return
        n = groups_to_cut(self.cfg.mode, self.collector.ready_groups,
                          self.cfg.trainer.groups_per_step, self.driver.training_live,
                          len(s.pending_score) + len(s.scoring), self.collector.open_groups)
        if n is None:
            return
        decision = self.collector.take_batch(n, s.version, self.cfg.rollout.max_staleness)
        self._drop_trajectories(decision.stale, "stale")
        self._drop_trajectories(decision.orphaned, "group_incomplete")
        self._drop_orphans()
        if decision.samples:
            self._submit_train(decision)

    def _submit_train(self, d: BatchDecision) -> None:
        s = self.state
        fut = self.client.submit(with_trainer, train_step, TrainBatch(d.samples, s.version),
                                 key=f"train_step-{s.version}", workers=[self.trainer_worker],
                                 pure=False, resources=demand(Stage.TRAIN_STEP))
        s.trainer_busy = True
        s.train_submitted_at = time.perf_counter()
        s.batch_info = self._batch_metrics(d)
        s.trained += len(d.trajectories)
        self._track(fut, "train")

    def _drop_trajectories(self, trajs: list[Trajectory], reason: str) -> None:
        for t in trajs:
            self.driver.record_drop(t.traj_id, reason)

    def _drop_orphans(self) -> None:
        if self.collector.orphans:
            self._drop_trajectories(self.collector.orphans, "group_incomplete")
            self.collector.orphans.clear()

    # -- completions ------------------------------------------------------------------------
    def _on_step(self, fut: Future, result) -> None:
        if fut.status != "finished" or result is None:
            nxt, dropped_group = self.driver.on_error(fut)
            if nxt is not None:
                self._track(nxt, "step")
            if dropped_group is not None and dropped_group.startswith(EVAL_GROUP):
                self._on_eval_episode(dropped_group, None)
            elif dropped_group is not None:
                self.collector.drop_member(dropped_group)
                self._drop_orphans()
            return
        traj, nxt = self.driver.on_step(fut, result)
        if nxt is not None:
            self._track(nxt, "step")
        elif traj is not None and traj.evaluation:
            self._on_eval_episode(traj.group_id, traj)
        elif traj is not None:
            self.state.finished += 1
            self.state.pending_score.append(traj)

    def _on_score(self, fut: Future, result: ScoreBatch | None) -> None:
        batch = self.state.scoring.pop(fut.key)
        if fut.status == "error":
            results = [None] * len(batch)
            err = f"reward_task_error: {fut.exception()!r}"
        elif result is None:  # the result was lost with its worker
            results, err = [None] * len(batch), "reward_task_lost"
        else:
            self.reward_stats.add(result)
            results, err = result.results, None
        for traj, res in zip(batch, results, strict=True):
            if res is None or res.score is None:
                detail = (res.error if res is not None else err) or "reward_error"
                self.reward_failure_streak += 1
                # a reward service that fails every call would otherwise spin the run forever
                if self.reward_failure_streak >= self.max_reward_failure_streak:
                    raise RuntimeError(
                        f"reward scoring failed for the last {self.reward_failure_streak} "
                        f"trajectories, the last with: {detail}")
                # the reason is the error's kind ("reward_function_error", ...), details kept
                self.driver.record_drop(traj.traj_id, detail.split(":", 1)[0], detail)
                self.collector.drop_member(traj.group_id)
            else:
                self.reward_failure_streak = 0
                traj.reward, traj.reward_details = float(res.score), res.details
                self.collector.add(traj)
        self._drop_orphans()

    def _on_train(self, fut: Future, stats: TrainStats, progress: ProgressLine) -> None:
        s = self.state
        s.trainer_busy = False
        if fut.status != "finished":  # a trainer failure ends the run loudly
            raise RuntimeError(f"{fut.key} failed: {fut.exception()!r}")
        s.train_windows.append((s.train_submitted_at, time.perf_counter()))
        s.version = stats.policy_version
        metrics = {"train/step": s.version, **stats.log("train"), **(s.batch_info or {}),
                   **self._perf_metrics(), **self._reward_metrics()}
        self.sink.log(metrics)
        self.last_metrics = metrics
        progress.update(metrics, self.env_names)
        if s.version >= self.cfg.trainer.max_steps:
            self.driver.stopping = True
        self._sync_weights()
        every = self.cfg.eval.every_steps
        if every and (s.version % every == 0 or s.version >= self.cfg.trainer.max_steps):
            self._start_eval(s.version)

    def _batch_metrics(self, d: BatchDecision) -> dict:
        trajs = d.trajectories
        m: dict = {
            "reward/mean": float(np.mean([t.reward for t in trajs])),
            "reward/std": float(np.std([t.reward for t in trajs])),
            "rollout/batch_trajectories": len(trajs),
            "rollout/staleness_mean": float(np.mean(d.staleness)) if d.staleness else 0.0,
            "rollout/staleness_max": int(max(d.staleness)) if d.staleness else 0,
            "rollout/dropped_stale": len(d.stale),
            "rollout/truncated": float(np.mean([t.truncated for t in trajs])),
            "rollout/response_tokens": float(np.mean([t.loss_mask.sum() for t in trajs])),
            "rollout/sequence_tokens": float(np.mean([len(t.token_ids) for t in trajs])),
        }
        for name, ts in _by_env(trajs).items():
            m |= _episode_metrics(f"env/{name}", ts)
            m[f"env/{name}/reward"] = float(np.mean([t.reward for t in ts]))
            m[f"env/{name}/format_penalty"] = float(np.mean(
                [t.format_errors * float(t.info.get("format_penalty", 0.0)) for t in ts]))
            m[f"env/{name}/env_step_s"] = float(np.mean(
                [t.env_step_s / max(t.num_turns, 1) for t in ts]))
            m[f"env/{name}/trajectories"] = len(ts)
        return m

    # -- evaluation -------------------------------------------------------------------------
    def _start_eval(self, version: int) -> None:
        """Greedy episodes on held-out seeds for every environment task, beside training; they
        run on the weights the engines hold (version ``version`` or the next ones)."""
        gid = f"{EVAL_GROUP}{version}"
        n = self.cfg.eval.episodes
        self.eval_rounds[gid] = {"version": version, "pending": n * len(self.cfg.env_tasks),
                                 "episodes": [], "failed": 0, "t0": time.perf_counter()}
        for task in self.cfg.env_tasks:
            for i in range(n):
                self._track(self.driver.new_trajectory(gid, task, eval_seed(i), evaluation=True),
                            "step")

    def _on_eval_episode(self, gid: str, traj: Trajectory | None) -> None:
        r = self.eval_rounds[gid]
        r["pending"] -= 1
        if traj is None:
            r["failed"] += 1
        else:
            r["episodes"].append(traj)
        if r["pending"] == 0:
            self.sink.log(self._eval_metrics(self.eval_rounds.pop(gid)))

    def _eval_metrics(self, r: dict) -> dict:
        m: dict = {"eval/step": r["version"], "eval/failed": r["failed"],
                   "eval/elapsed_s": time.perf_counter() - r["t0"]}
        for name, ts in sorted(_by_env(r["episodes"]).items()):
            m |= _episode_metrics(f"eval/{name}", ts)
            m[f"eval/{name}/episodes"] = len(ts)
        self.last_eval = m
        logger.info("evaluation at v%d: %s", r["version"],
                    {k: round(v, 3) for k, v in m.items() if k.endswith("/success")})
        return m

    def _reward_metrics(self) -> dict:
        r = self.reward_stats.summary()
        keys = ("invocations", "mean_batch", "latency_ms_p50", "latency_ms_p99", "throttles",
                "sdk_retries", "function_errors", "cold_starts")
        return {f"reward/{k}": r[k] for k in keys} | {
            "reward/lost": sum(v for k, v in self.driver.dropped.items()
                               if k.startswith("reward_"))}

    def _perf_metrics(self) -> dict:
        elapsed = time.perf_counter() - self.t0
        return {"perf/elapsed_s": elapsed,
                "perf/trajectories_per_s": self.state.finished / max(elapsed, 1e-9),
                "rollout/started": self.driver.started, "rollout/trained": self.state.trained,
                "rollout/dropped": sum(self.driver.dropped.values()),
                "rollout/in_flight": len(self.driver.live)}

    # -- the loop ---------------------------------------------------------------------------
    def run(self, progress: ProgressLine) -> None:
        self.t0 = time.perf_counter()
        self.last_metrics: dict = {}
        handlers = {"step": self._on_step, "score": self._on_score,
                    "train": lambda f, r: self._on_train(f, r, progress), "load": self._on_load}
        while True:
            self._flush_scores()
            self._maybe_train()
            self._admit()  # after a batch was cut: its room is refilled at once
            if self.ac.is_empty():
                if self.state.version < self.cfg.trainer.max_steps:
                    raise RuntimeError(
                        f"stalled at policy version {self.state.version}: nothing in flight and "
                        f"nothing admissible (rollout.max_in_flight={self.cfg.rollout.max_in_flight},"
                        f" pool slots={self.pool_slots})")
                break
            batch = self.ac.next_batch(block=True)
            # one gather for the whole batch: a round trip per worker, not per future
            results = self._gather(batch)
            for fut in batch:
                handlers[self.state.kinds.pop(fut.key)](fut, results.get(fut.key))
            # closes are held, not awaited: one aimed at a lost worker must not stall the run
            self.driver.closing = [f for f in self.driver.closing if not f.done()]
        try:
            wait(self.driver.closing, timeout=60)
        except TimeoutError:
            logger.warning("%d environment closes did not finish", len(self.driver.closing))
        self._finish_unconsumed()

    def _gather(self, batch: list[Future]) -> dict:
        done = [f for f in batch if f.status == "finished"]
        try:
            return dict(zip((f.key for f in done), self.client.gather(done), strict=True))
        except Exception:  # a result was lost in between (worker died): fetch one by one
            out = {}
            for f in done:
                try:
                    out[f.key] = f.result(timeout=60)
                except Exception:
                    logger.warning("result of %s lost", f.key)
            return out

    def _on_load(self, fut: Future, result) -> None:
        self.state.loads_pending -= 1
        if fut.status != "finished":
            raise RuntimeError(f"weight load {fut.key} failed: {fut.exception()}")

    def _finish_unconsumed(self) -> None:
        """At the end, finished-but-untrained trajectories are counted as dropped (run_ended)."""
        leftover = self.collector.ready_trajectories + self.collector.open_members
        self.driver.dropped["run_ended"] += leftover
        self._drop_orphans()

    # -- wrap-up ----------------------------------------------------------------------------
    def save(self) -> str:
        fut = self.client.submit(with_trainer, save_checkpoint, str(self.run_dir.resolve()),
                                 key=f"save_checkpoint-{self.state.version}", pure=False,
                                 workers=[self.trainer_worker],
                                 resources=demand(Stage.SAVE_CHECKPOINT))
        return fut.result()

    def summary(self) -> dict:
        placement = self.client.run_on_scheduler(placement_snapshot)
        by_pool: dict[str, Counter] = defaultdict(Counter)
        for stage, per_worker in placement.items():
            for w, n in per_worker.items():
                by_pool[stage][self.cluster.worker_pool.get(w, w)] += n
        reports = self.client.run(worker_report)
        live_envs = sum(r.get("envs", {}).get("live", 0) for r in reports.values())
        d = self.driver
        return {
            "final_metrics": self.last_metrics,
            "policy_version": self.state.version,
            "trajectories": {"started": d.started, "finished": self.state.finished,
                             "trained": self.state.trained, "dropped": dict(d.dropped),
                             "truncated": dict(d.truncated)},
            "drop_details": d.drop_details[:20],
            "evaluation": {"episodes_started": d.eval_started,
                           "dropped": dict(d.eval_dropped), "last": self.last_eval},
            "tasks_per_stage_per_pool": {k: dict(v) for k, v in sorted(by_pool.items())},
            "rollout_tasks_submitted": dict(d.stage_submitted),
            "reward": self.reward_stats.summary() | {
                "backend": self.cfg.reward.backend,
                "endpoint": self.reward_cfg["endpoint_url"] or "aws",
                "score_tasks": self.state.score_tasks,
                "lost": {k: v for k, v in d.dropped.items() if k.startswith("reward_")}},
            "live_env_instances_at_end": live_envs,
            "workers": {a: dict(r, pool=self.cluster.worker_pool.get(a, a))
                        for a, r in reports.items()},
            "train_windows_s": [(a - self.t0, b - self.t0) for a, b in self.state.train_windows],
            "elapsed_s": time.perf_counter() - self.t0,
        }
