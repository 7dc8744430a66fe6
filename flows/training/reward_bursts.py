"""Reward bursts: finished trajectories go to their reward function in bursts, on the
SERVERLESS pool, and come back scored or dropped with the reason.

One ``score`` task per Lambda function and burst; the reward client on that worker packs the
burst into invocations and fans them out itself. Every call the clients made is kept in
:class:`RewardStats`. A reward service that fails every call would otherwise spin the run
forever: a streak of failures longer than a few batches ends the run loudly.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from distributed import Client, Future

from flows.config import TrainConfig
from flows.config.derived import lambda_function_of, reward_name
from flows.monitoring.monitor import StageSpans
from flows.training.episode import score_requests
from flows.training.lifecycle import DropReason, RunFailing, TrajectoryLedger, TrajState
from flows.training.orchestration import PoolWorkers, score_bursts
from resources.pools import Stage, Tag, submit_on
from resources.worker import with_reward_client
from tasks.records import InvocationRecord, ScoreBatch, Trajectory
from tasks.stages import Stages

MAX_RESENDS = 2  # a trajectory whose score task was lost this many times more is dropped


class RewardServiceFailing(RunFailing):
    pass


@dataclass
class RewardStats:
    """Every reward-function call of the run, from the clients' records."""

    calls: list[InvocationRecord] = field(default_factory=list)
    deduplicated: int = 0

    def add(self, batch: ScoreBatch) -> None:
        self.calls.extend(batch.invocations)
        self.deduplicated += batch.deduplicated

    def summary(self) -> dict:
        """Totals over every call, and the same per Lambda function (``per_function``)."""
        by_function: dict[str, list[InvocationRecord]] = {}
        for r in self.calls:
            by_function.setdefault(r.function, []).append(r)
        return self._totals(self.calls) | {
            "deduplicated": self.deduplicated,
            "per_function": {f: self._totals(rs) for f, rs in sorted(by_function.items())}}

    @staticmethod
    def _totals(c: list[InvocationRecord]) -> dict:
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
        }


@dataclass
class ScoreOutcome:
    scored: list[Trajectory]  # reward set, now in_group
    dropped: list[Trajectory]  # dropped with their reason (their groups lost a member)


class RewardBursts:
    def __init__(self, client: Client, cfg: TrainConfig, pool_workers: PoolWorkers,
                 ledger: TrajectoryLedger, stages: Stages, run_id: str, batch_trajectories: int,
                 spans: StageSpans | None = None, key_tag: str = ""):
        self.client, self.pool_workers, self.ledger, self.stages = client, pool_workers, ledger, stages
        self.key_tag = key_tag  # ends every key (see RolloutDriver)
        self.run_id = run_id
        self.spans = spans or StageSpans(run_id)
        self.reward_fns = {t.name: reward_name(t) for t in cfg.env_tasks}
        self.lambda_function = {t.name: lambda_function_of(cfg.reward, t) for t in cfg.env_tasks}
        # one score task carries what the client can send at once; it fans the burst out itself
        self.score_task_max = cfg.reward.batch_max * cfg.reward.concurrency
        self.stats = RewardStats()
        self.failure_streak = 0
        self.max_failure_streak = 4 * batch_trajectories
        self.score_tasks = 0
        self._pending: list[Trajectory] = []
        self._scoring: dict[str, tuple[list[Trajectory], str, Future]] = {}  # batch, worker
        self._lost_keys: set[str] = set()  # score tasks whose worker left: re-sent
        self.resent: Counter[str] = Counter()  # score requests sent again, by trajectory id

    def queue(self, traj: Trajectory) -> None:
        """A finished training trajectory (awaiting_score) waits for the next flush."""
        self._pending.append(traj)

    def flush(self) -> list[Future]:
        """Submit the waiting trajectories: one score task per function and burst."""
        pending, self._pending = self._pending, []
        futures = []
        for function, batch in score_bursts(pending, self.lambda_function, self.score_task_max):
            if not self.pool_workers.has(str(Tag.SERVERLESS)):  # waits for a worker to join
                self._pending.extend(batch)
                continue
            worker = self.pool_workers.choose(Tag.SERVERLESS)
            with self.spans("reward", function):
                fut = submit_on(
                    self.client, worker, Stage.SCORE, with_reward_client, self.stages.score,
                    function, score_requests(batch, self.reward_fns, self.run_id),
                    key=f"{Stage.SCORE}-{self.score_tasks}{self.key_tag}")
            self.score_tasks += 1
            self._scoring[fut.key] = (batch, worker, fut)
            for t in batch:
                self.ledger.transition(int(t.traj_id), TrajState.SCORING)
            futures.append(fut)
        return futures

    def on_scored(self, fut: Future, result: ScoreBatch | None) -> ScoreOutcome:
        """A score task ended: set each trajectory's reward, or drop it with the reason."""
        batch, _, _ = self._scoring.pop(fut.key)
        out = ScoreOutcome([], [])
        if fut.key in self._lost_keys:  # its worker left: scored by a new task, or dropped
            self._lost_keys.discard(fut.key)
            for traj in batch:
                tid = int(traj.traj_id)
                self.resent[traj.traj_id] += 1
                if self.resent[traj.traj_id] > MAX_RESENDS:
                    self.ledger.drop(tid, DropReason.REWARD_TASK_LOST, "its worker left, "
                                     f"{MAX_RESENDS} times")
                    out.dropped.append(traj)
                else:
                    self.ledger.transition(tid, TrajState.AWAITING_SCORE)
                    self._pending.append(traj)
            return out
        if fut.status == "error":
            results = [None] * len(batch)
            err = f"{DropReason.REWARD_TASK_ERROR}: {fut.exception()!r}"
        elif result is None:  # the result was lost with its worker
            results, err = [None] * len(batch), f"{DropReason.REWARD_TASK_LOST}: result lost"
        else:
            self.stats.add(result)
            results, err = result.results, None
        for traj, res in zip(batch, results, strict=True):
            tid = int(traj.traj_id)
            if res is None or res.score is None:
                detail = (res.error if res is not None else err) or "reward_error"
                self.failure_streak += 1
                self.ledger.drop(tid, DropReason.of_reward_error(detail), detail)
                out.dropped.append(traj)
                if self.failure_streak >= self.max_failure_streak:
                    raise RewardServiceFailing(
                        f"reward scoring failed for the last {self.failure_streak} "
                        f"trajectories, the last with: {detail}")
            else:
                self.failure_streak = 0
                traj.reward, traj.reward_details = float(res.score), res.details
                self.ledger.transition(tid, TrajState.IN_GROUP)
                out.scored.append(traj)
        return out

    def worker_lost(self, worker: str) -> list[Future]:
        """``worker`` left: its score tasks (returned, for the caller to cancel) are sent
        again when they come back. Scoring is stateless and the reward functions idempotent,
        so a burst the lost worker may have sent already is scored again, and set once."""
        lost = [fut for key, (_, w, fut) in self._scoring.items()
                if w == worker and key not in self._lost_keys]
        self._lost_keys.update(f.key for f in lost)
        return lost

    def metrics(self) -> dict:
        r = self.stats.summary()
        keys = ("invocations", "mean_batch", "latency_ms_p50", "latency_ms_p99", "throttles",
                "sdk_retries", "function_errors", "cold_starts")
        return {f"reward/{k}": r[k] for k in keys} | {"reward/lost": self.lost_total()}

    def lost(self) -> dict[str, int]:
        return {str(k): v for k, v in self.ledger.training.dropped.items()
                if k.value.startswith("reward_")}

    def lost_total(self) -> int:
        return sum(self.lost().values())
