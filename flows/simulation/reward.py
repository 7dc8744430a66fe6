"""Simulated reward scoring: one score task per function and burst (as
:mod:`flows.training.reward_bursts` cuts them), invocations of up to ``reward.batch_max`` at
``reward.concurrency`` per task, on a Lambda of ``simulate.lambda_concurrency`` concurrent
instances (over it: a throttle and a retry), cold starts, and a reward model's prefill per
invocation (``reward.judge``)."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable

from flows.config import TrainConfig
from flows.config.choices import RewardBackend
from flows.config.derived import lambda_function_of
from flows.simulation.cluster import ControlPlane, SimCluster
from flows.simulation.settings import SimSettings
from flows.training import lifecycle
from flows.training.orchestration import score_bursts
from resources.pools import Tag
from resources.reward_client import chunk_size
from resources.sim_engine import Clock
from tasks.records import Trajectory

AWS_DEFAULT_CONCURRENCY = 1000  # concurrent instances per account unless raised


class RewardScoring:
    """Finished trajectories to their rewards: ``on_scored(batch)`` is called as each score
    task's completion reaches the driver."""

    def __init__(self, cfg: TrainConfig, sim: SimSettings, clock: Clock, cluster: SimCluster,
                 control: ControlPlane, ledger: lifecycle.TrajectoryLedger,
                 on_scored: Callable[[list[Trajectory]], None]):
        self.cfg, self.sim, self.clock = cfg, sim, clock
        self.cluster, self.control, self.ledger = cluster, control, ledger
        self.on_scored = on_scored
        self.lambda_function = {t.name: lambda_function_of(cfg.reward, t) for t in cfg.env_tasks}
        self.pending: list[Trajectory] = []
        self.lambda_busy: Counter[str] = Counter()  # instances running, per function
        self.lambda_warm: Counter[str] = Counter()  # instances started, per function
        self.calls: Counter[str] = Counter()  # invocations, throttles, cold starts
        self._flush_due = False

    def queue(self, traj: Trajectory) -> None:
        self.pending.append(traj)

    def schedule_flush(self) -> None:
        """The driver sends what waits for scoring at most every ``reward_flush_s``."""
        if self.pending and not self._flush_due:
            self._flush_due = True
            self.clock.after(self.sim.reward_flush_s, self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        r = self.cfg.reward
        for function, batch in score_bursts(pending, self.lambda_function,
                                            r.batch_max * r.concurrency):
            for traj in batch:
                self.ledger.transition(int(traj.traj_id), lifecycle.TrajState.SCORING)
            self.control.tasks["score"] += 1
            worker = self.cluster.pool_workers.choose(Tag.SERVERLESS)
            wait = self.control.schedulers[0].delay()
            self.clock.after(wait, self.cluster.worker_slots[(worker, Tag.SERVERLESS)].acquire,
                             self._score, worker, function, batch)

    def _score(self, worker: str, function: str, batch: list[Trajectory]) -> None:
        """One score task: the burst in chunks as the reward client cuts them
        (:func:`resources.reward_client.chunk_size`), reward.concurrency calls at a time."""
        r = self.cfg.reward
        # the Lambda client fans a burst out over reward.concurrency calls; the local client
        # scores its chunks one after the other
        lanes = r.concurrency if r.backend == RewardBackend.LAMBDA else 1
        size = chunk_size(len(batch), lanes, r.min_batch, r.batch_max)
        chunks = [batch[i:i + size] for i in range(0, len(batch), size)]
        state = {"left": len(chunks), "queue": deque(chunks)}

        def next_call() -> None:
            if state["queue"]:
                self._invoke(function, state["queue"].popleft(), call_done)

        def call_done() -> None:
            state["left"] -= 1
            if state["left"]:
                next_call()
                return
            self.cluster.worker_slots[(worker, Tag.SERVERLESS)].release()
            self.clock.after(self.control.drivers[0].delay(), self.on_scored, batch)

        for _ in range(min(lanes, len(chunks))):
            next_call()

    def _invoke(self, function: str, chunk: list[Trajectory], done) -> None:
        r = self.cfg.reward
        limit = self.sim.lambda_concurrency or (
            r.emulator.concurrency if r.backend == RewardBackend.LAMBDA and r.emulator.enabled
            else AWS_DEFAULT_CONCURRENCY)
        if self.lambda_busy[function] >= limit:  # 429: the client waits and retries
            self.calls["throttles"] += 1
            self.clock.after(self.sim.throttle_backoff_s, self._invoke, function, chunk, done)
            return
        self.lambda_busy[function] += 1
        self.calls["invocations"] += 1
        seconds = self.sim.lambda_latency_s if self.sim.lambda_latency_s is not None else (
            r.emulator.latency_s)
        if self.lambda_warm[function] < self.lambda_busy[function]:
            self.lambda_warm[function] += 1
            self.calls["cold_starts"] += 1
            seconds += self.sim.lambda_cold_start_s + r.emulator.init_delay_s
        tokens = sum(t.virtual_tokens for t in chunk)

        def finish() -> None:
            self.lambda_busy[function] -= 1
            done()

        judge = self.cluster.judge_device
        if judge is not None and r.backend != RewardBackend.LAMBDA:
            self.clock.after(seconds, self.cluster.judge_engine.submit, True, tokens, 0, finish)
            return
        if judge is not None:
            seconds += judge.prefill_time(tokens)
        self.clock.after(seconds, finish)
