"""A run of a session (:class:`Run`): one :class:`~flows.training.run.TrainingRun` on a
session's cluster, trained in as many calls as wanted, with its metric sinks, the monitor's
records, its status (:class:`RunStatus`) and the files it writes when it ends
(``config.yaml``, ``summary.json``, ``curves.png``, ``dask-report.html``).

A KeyboardInterrupt during :meth:`Run.train` cancels the run's work in flight, closes its
environments and drops its trajectories with the reason ``interrupted``; the session's cluster
stays usable for the next run.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from distributed import performance_report

from flows.config import TrainConfig, resolved_yaml
from flows.config.choices import RewardBackend
from flows.config.derived import with_env_faults
from flows.monitoring.dump import TrajectoryDump
from flows.monitoring.metrics import ProgressLine, RowsSink, make_sinks, run_header
from flows.monitoring.monitor import DashboardSink, announce, publish, span_times
from flows.monitoring.plot import draw_curves
from flows.monitoring.records import RecordKind
from flows.training.launch import start_reward_service
from flows.training.lifecycle import DropReason, TrajectoryLedger, Transition
from flows.training.run import PoolLost, TrainingRun
from resources.lambda_emulator import LambdaEmulator
from tasks.components import check_component
from tasks.records import Trajectory
from tasks.stages import Stages

if TYPE_CHECKING:
    from distributed import Client

    from resources.cluster import ClusterHandle

logger = logging.getLogger(__name__)


class OnCluster(Protocol):
    """What a run asks of its session (:class:`flows.training.session.Session`): the cluster
    it trains on, its client, and the clusters of the further rollout shards."""

    cluster: ClusterHandle
    shards: list[ClusterHandle]

    @property
    def client(self) -> Client: ...


class RunStatus(StrEnum):
    SET_UP = "set up"
    TRAINING = "training"
    PAUSED = "paused"  # train(n) returned; the work in flight carries on
    TRAINED = "trained"  # trainer.max_steps reached, nothing in flight
    FINISHED = "finished"  # trained, then closed: files written
    CLOSED = "closed"  # closed before trainer.max_steps
    INTERRUPTED = "interrupted"  # KeyboardInterrupt during train()
    FAILED = "failed"  # an error during train()


ENDED = (RunStatus.FINISHED, RunStatus.CLOSED, RunStatus.INTERRUPTED, RunStatus.FAILED)


class Run:
    """One training run on a session's cluster, trained in as many calls as wanted."""

    def __init__(self, session: OnCluster, cfg: TrainConfig, run_dir: Path, *,
                 stages: Stages | None = None, progress: bool = False,
                 on_transition: Callable[[Transition, TrajectoryLedger], None] | None = None,
                 reward_service: LambdaEmulator | None = None):
        self.session, self.cfg, self.run_dir = session, cfg, Path(run_dir)
        self.status = RunStatus.SET_UP
        self.summary: dict | None = None
        self._own_service = None
        self._report = None
        self._released = False
        self.rows = RowsSink()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        resolved = resolved_yaml(cfg)
        (self.run_dir / "config.yaml").write_text(resolved)
        logger.info("%s", run_header(cfg, self.run_dir))
        self.sink = make_sinks(cfg.metrics, self.run_dir,
                               cfg.model_dump(mode="json", fallback=str))
        self.sink.add(self.rows)
        try:
            if reward_service is None and cfg.reward.backend == RewardBackend.LAMBDA:
                reward_service = self._own_service = start_reward_service(cfg)
            client = session.client
            live = None
            if cfg.metrics.dashboard:
                self.sink.add(DashboardSink(client))
                live = lambda figures: publish(client, RecordKind.LIVE, {"live": figures})  # noqa: E731
            self._run = TrainingRun(cfg, session.cluster, self.run_dir, self.sink,
                                    reward_service.url if reward_service else None,
                                    stages=stages, on_transition=on_transition,
                                    publish_live=live, shards=session.shards)
            if cfg.metrics.dump_trajectories:
                self.on_batch(TrajectoryDump(
                    self.run_dir / "trajectories.txt", cfg.metrics.dump_trajectories, cfg.seed))
            if cfg.metrics.dashboard:
                publish(client, RecordKind.RUN_START, {
                    "run_id": self._run.run_id,
                    "env_tasks": [t.name for t in cfg.env_tasks],
                    "worker_pool": session.cluster.worker_pool,
                    "max_steps": cfg.trainer.max_steps})
                announce(client, "run-start", run=self._run.run_id)
            self._run.setup()
        except BaseException:
            self._release()
            raise
        self._progress = progress

    @property
    def version(self) -> int:
        """The policy version trained so far."""
        return self._run.version

    @property
    def ended(self) -> bool:
        return self.status in ENDED

    def on_batch(self, callback: Callable[[int, list[Trajectory]], None]) -> None:
        """Call ``callback(step, trajectories)`` with every train batch as it is cut (``step``:
        the policy version its train step will publish)."""
        self._run.on_batch(callback)

    def accounts(self) -> dict:
        """The trajectory accounts so far: started, finished, trained, dropped by reason, in
        flight (:meth:`flows.training.lifecycle.TrajectoryLedger.summary`)."""
        return self._run.ledger.summary()

    @property
    def worker_versions(self) -> dict[str, int]:
        """The policy version each inference worker holds, by address."""
        return dict(self._run.weights.worker_versions)

    @property
    def env_pool_changes(self) -> list[dict]:
        """``cluster.adaptive_env``: each change of the environment pool so far (time, action,
        workers, busy share)."""
        return [] if self._run.scaler is None else list(self._run.scaler.history)

    def train(self, steps: int | None = None):
        """Train ``steps`` more steps (all remaining to ``trainer.max_steps`` when None) and
        return the metrics DataFrame. Reaching ``trainer.max_steps`` ends the run's rollouts;
        :meth:`close` then writes its files."""
        if self.ended:
            raise RuntimeError(f"run {self.run_dir} is {self.status}; start a new one")
        target = None if steps is None else min(self.version + steps,
                                                self.cfg.trainer.max_steps)
        if self._report is None and self.cfg.metrics.performance_report:
            self._report = performance_report(filename=str(self.run_dir / "dask-report.html"))
            self._report.__enter__()
        self.status = RunStatus.TRAINING
        try:
            with ProgressLine(self.cfg.trainer.max_steps, self._progress) as line:
                done = self._run.train(line, until=target)
        except BaseException as exc:
            interrupted = isinstance(exc, KeyboardInterrupt)
            # a checkpoint to --resume from: after an interrupt (when checkpointing is on) and
            # when a pool stayed empty (the cluster will be fixed and the run go on)
            self._stop(RunStatus.INTERRUPTED if interrupted else RunStatus.FAILED,
                       checkpoint=isinstance(exc, PoolLost) or (
                           interrupted and bool(self.cfg.trainer.checkpoint_every)))
            raise
        self.status = RunStatus.TRAINED if done else RunStatus.PAUSED
        return self.metrics()

    def update_env(self, env_task: str, env: dict) -> None:
        """Replace an env task's environment (a ``_component_`` spec) for the trajectories
        started from now on, while the run goes on: the mix's cost changes mid-run (those
        already rolling out keep theirs)::

            run.update_env("frozenlake", {"_component_": "tasks.envs.latency.RemoteLatency",
                                          "env": cfg_env, "step_latency": 0.3})
        """
        check_component(env)
        self._run.driver.replace_env(env_task, with_env_faults(self.cfg.faults, env))

    def metrics(self, kind: str = "train"):
        """The run's rows as a pandas DataFrame: ``train`` (indexed by ``train/step``) or
        ``eval`` (one row per evaluation round)."""
        import pandas as pd

        rows = self.rows.train if kind == "train" else self.rows.eval
        df = pd.DataFrame(rows)
        key = "train/step" if kind == "train" else "eval/step"
        return df.set_index(key, drop=False) if key in df else df

    def time_by_stage(self):
        """Seconds of task time per env task and stage (the run's Dask spans), by activity,
        as a DataFrame: where the run's time went."""
        import pandas as pd

        times = self.session.client.run_on_scheduler(span_times, self._run.run_id)
        rows = [{"span": k, "env_task": k.split("/")[0], "stage": k.split("/")[1], **v}
                for k, v in times.items()]
        return pd.DataFrame(rows).set_index("span") if rows else pd.DataFrame()

    def plot(self, path: str | Path | None = None) -> Path:
        """Draw the curves (default ``<run_dir>/curves.png``) and return the file's path."""
        return draw_curves({self.run_dir.name: (self.rows.train, self.rows.eval)},
                           path or self.run_dir / "curves.png")

    def close(self) -> dict:
        """End the run (work still in flight is cancelled and dropped as ``run_ended``), save
        the policy and a checkpoint, and write ``summary.json``, ``curves.png`` and the
        performance report. Returns the summary."""
        if self.summary is not None:
            return self.summary
        trained = self.status is RunStatus.TRAINED
        if not trained:
            self._run.abort(DropReason.RUN_ENDED)
        self._run.save()
        return self._finish(RunStatus.FINISHED if trained else RunStatus.CLOSED)

    def _stop(self, status: RunStatus, checkpoint: bool = False) -> None:
        """Train failed or was interrupted: cancel the run's work, drop its trajectories with
        the reason, write what can be written. Errors here are logged, never raised over the
        one that stopped the run."""
        logger.warning("run %s %s at policy version %d: cancelling its work in flight",
                       self.run_dir, status, self.version)
        reason = DropReason.INTERRUPTED if status is RunStatus.INTERRUPTED else \
            DropReason.RUN_ENDED
        try:
            self._run.abort(reason)
            if checkpoint and self._run.trainer.worker is not None:
                where = self._run.checkpoint_now()
                logger.warning("checkpoint %s written: continue with --resume %s", where,
                               self.run_dir)
            self._finish(status)
        except Exception as exc:
            logger.warning("run %s: could not finish cleanly: %s", self.run_dir, exc)
            self.status = status
            self._release()

    def _finish(self, status: RunStatus) -> dict:
        self.status = status
        try:
            summary = self._run.summary() | {"status": str(status)}
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2,
                                                                  default=str))
            self.summary = summary
            if self.cfg.metrics.curves and self.rows.train:
                self.plot()
        finally:
            self._release()
        return self.summary

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        client = self.session.client
        if self._report is not None:
            try:
                self._report.__exit__(None, None, None)
            except Exception as exc:  # the report is a by-product: never fail the run on it
                logger.warning("performance report not written: %s", exc)
            self._report = None
        if self.cfg.metrics.dashboard and hasattr(self, "_run"):
            publish(client, RecordKind.RUN_END, {"run_id": self._run.run_id})
            announce(client, "run-end", run=self._run.run_id, status=str(self.status))
        self.sink.close()
        if hasattr(self, "_run"):
            self._run.release()
        if self._own_service is not None:
            self._own_service.stop()
            self._own_service = None

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self.summary is not None:
            return
        if exc_type is None:
            self.close()
        else:  # a stop that could not finish (logged) keeps its status: interrupted stays so
            self._stop(self.status if self.ended else RunStatus.FAILED)
