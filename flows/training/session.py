"""A session (:class:`Session`): a Dask cluster kept across runs, with the RollArc monitor on
its scheduler, started locally from a config's pools (and the further rollout shards'
clusters) or connected to a running scheduler; and :func:`run_training`, one training job end to
end on a session of its own (what ``flows/train.py`` runs). The runs themselves are
:class:`~flows.training.session_run.Run`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from distributed.security import Security

from flows.config import ConfigError, TrainConfig, load_config, validate, with_overrides
from flows.config.derived import tls_security
from flows.monitoring.metrics import check_sinks
from flows.monitoring.monitor import install_monitor, page_url
from flows.monitoring.scheduler_plugin import register_page_before_start
from flows.training.launch import close_quietly, make_cluster, pool_router, start_reward_service
from flows.training.lifecycle import TrajectoryLedger, Transition
from flows.training.session_run import Run
from flows.training.shards import close_shards, start_rollout_shards
from resources.cluster import ClusterHandle, connect
from tasks.stages import Stages

logger = logging.getLogger(__name__)

ConfigLike = TrainConfig | str | Path | None


def _config(config: ConfigLike, overrides: Sequence[str] = ()) -> TrainConfig:
    """A config file (default: the embedded default) or a TrainConfig, with overrides."""
    if isinstance(config, TrainConfig):
        return with_overrides(config, tuple(overrides))
    return load_config(config, list(overrides))


class Session:
    """A Dask cluster kept across runs, with the RollArc monitor on its scheduler."""

    def __init__(self, cluster: ClusterHandle, cfg: TrainConfig | None = None,
                 shards: Sequence[ClusterHandle] = ()):
        self.cluster = cluster
        # the further rollout shards' clusters (cluster.shards); the monitor is shard 0's
        self.shards = list(shards)
        self.cfg = cfg  # what runs start from (None: the embedded default)
        self.runs: list[Run] = []
        install_monitor(cluster.client)

    @classmethod
    def start(cls, config: ConfigLike = None, overrides: Sequence[str] = ()) -> Session:
        """Start the local cluster of a config's pools (default: ``config/default.yaml``), and
        the further rollout shards' clusters of ``cluster.shards``; the config, overrides
        included, is what the session's runs start from::

            session = Session.start(overrides=["reward.backend=local"])
        """
        cfg = _config(config, overrides)
        register_page_before_start()
        cluster = make_cluster(cfg, None)
        try:
            shards = start_rollout_shards(cfg, pool_router(cfg))
            return cls(cluster, cfg, shards)
        except BaseException:
            close_quietly(cluster)
            raise

    @classmethod
    def connect(
        cls,
        scheduler: str,
        timeout: float = 60,
        config: ConfigLike = None,
        overrides: Sequence[str] = (),
        security: Security | None = None,
    ) -> Session:
        """Use a running cluster. Workers advertising their hardware (the
        ``resources.hardware`` preload) are pooled and tagged by the affinity cost model of the
        config (default: the embedded default); others keep their ``--resources`` tags. A
        config given is what the session's runs start from; a ``tls://`` scheduler takes
        ``security`` (``tls_security(cfg.cluster.tls)``)::

            session = Session.connect("tcp://10.0.0.5:8786")
        """
        cfg = _config(config, overrides)
        check_single_scheduler(cfg, scheduler)
        handle = connect(scheduler, timeout, route_pools=pool_router(cfg), security=security,
                         stall_dump_s=cfg.cluster.stall_dump_s,
                         heap_keep_mb=cfg.cluster.heap_keep_mb)
        return cls(handle, cfg if config is not None or overrides else None)

    @property
    def client(self):
        return self.cluster.client

    @property
    def dashboard_link(self) -> str | None:
        return self.cluster.dashboard_link

    @property
    def page_link(self) -> str | None:
        """The RollArc page of the dashboard."""
        return page_url(self.cluster.dashboard_link)

    def config(self, overrides: Sequence[str] = (), config: str | Path | None = None
               ) -> TrainConfig:
        """The session's config (or the file ``config``) with ``overrides``, to edit and run::

            cfg = session.config(["trainer.max_steps=10"])
        """
        if config is None and self.cfg is not None:
            return with_overrides(self.cfg, tuple(overrides))
        return load_config(config, list(overrides))

    def run(self, config: ConfigLike = None, overrides: Sequence[str] = (), *,
            run_dir: str | Path | None = None, stages: Stages | None = None,
            progress: bool = False, **kwargs) -> Run:
        """A new run on this cluster, set up and ready to :meth:`Run.train`::

            run = session.run(overrides=["trainer.max_steps=10"], run_dir="runs/nb-1")
        """
        cfg = self.config(overrides) if config is None else _config(config, overrides)
        run_dir = Path(run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
        run = Run(self, cfg, run_dir, stages=stages, progress=progress, **kwargs)
        self.runs.append(run)
        return run

    def close(self) -> None:
        """Close the runs still open, then the cluster (a local one) and the client, and
        the rollout shards' clusters."""
        try:
            for run in self.runs:
                if run.summary is None:
                    try:
                        run.close()
                    except Exception as exc:  # the cluster goes anyway
                        logger.warning("run %s not closed cleanly: %s", run.run_dir, exc)
        finally:
            try:
                close_quietly(self.cluster)
            finally:
                close_shards(self.shards)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_single_scheduler(cfg: TrainConfig, scheduler: str | None) -> None:
    """``cluster.shards`` above 1 starts local clusters: not with a running scheduler."""
    if scheduler and cfg.cluster.shards > 1:
        raise ConfigError(f"cluster.shards={cfg.cluster.shards}: rollout shards are local "
                          f"clusters started by the run; with --scheduler ({scheduler}) set "
                          "cluster.shards=1")


def check_run_dir(run_dir: str | Path) -> None:
    """The run directory can be created and written, or a ConfigError naming it (raised
    before any cluster or service starts)."""
    path = Path(run_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".rollarc-write-check"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"--run-dir: {str(path)!r} is not a writable directory: "
                          f"{exc.strerror or exc}") from None


def run_training(cfg: TrainConfig, run_dir: str | Path, *, scheduler: str | None = None,
                 stages: Stages | None = None, progress: bool | None = None,
                 on_transition: Callable[[Transition, TrajectoryLedger], None] | None = None,
                 dashboard: Callable[[str], object] = print) -> dict:
    """Run one training job end to end on a cluster of its own (or on ``scheduler``) and
    return its summary (also ``<run_dir>/summary.json``). ``stages`` replaces stage functions;
    ``on_transition`` sees every change of a trajectory's state; ``dashboard`` is called with
    the dashboard's and the RollArc page's lines once the cluster is up. Raises ConfigError or
    RewardServiceError before any cluster starts::

        summary = run_training(load_config(overrides=["trainer.max_steps=10"]), "runs/short")
    """
    cfg = validate(cfg)
    check_sinks(cfg.metrics)
    check_single_scheduler(cfg, scheduler)
    check_run_dir(run_dir)
    emulator = start_reward_service(cfg)
    session = None
    try:
        if scheduler:
            session = Session.connect(scheduler, cfg.cluster.startup_timeout_s, cfg,
                                      security=tls_security(cfg.cluster.tls))
        else:
            session = Session.start(cfg)
        dashboard(f"Dask dashboard: {session.dashboard_link}")
        if cfg.metrics.dashboard and session.page_link:
            dashboard(f"RollArc page:   {session.page_link}")
        show = cfg.metrics.progress if progress is None else progress
        with Run(session, cfg, Path(run_dir), stages=stages, progress=show,
                 on_transition=on_transition, reward_service=emulator) as run:
            run.train()
        return run.close()
    finally:
        if session is not None:
            session.close()
        if emulator is not None:
            emulator.stop()
