"""Metrics: pure functions from records to slash-namespaced rows, the sinks they go to, and the
live progress line."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from flows.config.derived import batch_trajectories, effective_pools
from tasks.components import describe
from tasks.records import Trajectory

if TYPE_CHECKING:
    from flows.config import TrainConfig


def by_env(trajs: list[Trajectory]) -> dict[str, list[Trajectory]]:
    out: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        out[t.env_name].append(t)
    return out


def episode_metrics(prefix: str, ts: list[Trajectory]) -> dict[str, float]:
    """What training batches and evaluations both report per environment."""
    return {f"{prefix}/success": float(np.mean([t.success for t in ts])),
            f"{prefix}/turns": float(np.mean([t.num_turns for t in ts])),
            f"{prefix}/format_errors": float(np.mean([t.format_errors for t in ts]))}


def token_metrics(trajs: list[Trajectory]) -> dict:
    """A train batch's size and work: its trajectories, their mean sampled tokens and mean
    sequence tokens (what the trainer's passes run over)."""
    return {"rollout/batch_trajectories": len(trajs),
            "rollout/response_tokens": float(np.mean([t.loss_mask.sum() for t in trajs])),
            "rollout/sequence_tokens": float(np.mean([len(t.token_ids) for t in trajs]))}


def batch_metrics(trajs: list[Trajectory], staleness: list[int], dropped_stale: int) -> dict:
    """``reward/``, ``rollout/`` and ``env/<name>/`` figures of one train batch."""
    m: dict = {
        "reward/mean": float(np.mean([t.reward for t in trajs])),
        "reward/std": float(np.std([t.reward for t in trajs])),
        "rollout/staleness_mean": float(np.mean(staleness)) if staleness else 0.0,
        "rollout/staleness_max": int(max(staleness)) if staleness else 0,
        "rollout/dropped_stale": dropped_stale,
        "rollout/truncated": float(np.mean([t.truncated for t in trajs])),
    } | token_metrics(trajs)
    for name, ts in by_env(trajs).items():
        m |= episode_metrics(f"env/{name}", ts)
        m[f"env/{name}/reward"] = float(np.mean([t.reward for t in ts]))
        m[f"env/{name}/format_penalty"] = float(np.mean(
            [t.format_errors * float(t.info.get("format_penalty", 0.0)) for t in ts]))
        m[f"env/{name}/env_step_s"] = float(np.mean(
            [t.env_step_s / max(t.num_turns, 1) for t in ts]))
        m[f"env/{name}/trajectories"] = len(ts)
    return m


def eval_metrics(version: int, episodes: list[Trajectory], failed: int, elapsed_s: float) -> dict:
    """One evaluation round: ``eval/step`` is the version it was started for,
    ``eval/policy_version_oldest`` the oldest weights its episodes actually ran on."""
    m: dict = {"eval/step": version, "eval/failed": failed, "eval/elapsed_s": elapsed_s,
               "eval/policy_version_oldest": min((t.oldest_version for t in episodes),
                                                 default=version)}
    for name, ts in sorted(by_env(episodes).items()):
        m |= episode_metrics(f"eval/{name}", ts)
        m[f"eval/{name}/episodes"] = len(ts)
    return m


def perf_metrics(elapsed_s: float, accounts: dict) -> dict:
    """Throughput and the trajectory accounts (``TrajectoryLedger.summary()``)."""
    return {"perf/elapsed_s": elapsed_s,
            "perf/trajectories_per_s": accounts["finished"] / max(elapsed_s, 1e-9),
            "rollout/started": accounts["started"], "rollout/trained": accounts["trained"],
            "rollout/dropped": sum(accounts["dropped"].values()),
            "rollout/in_flight": accounts["rolling_out"]}


class MetricSink(Protocol):
    def log(self, metrics: dict) -> None: ...

    def close(self) -> None: ...


def read_metrics(run_dir, kind: str = "train") -> list[dict]:
    """The rows of a run's ``metrics.jsonl``: ``train`` (one per train step, ``train/step``) or
    ``eval`` (one per evaluation, ``eval/step``)."""
    key = {"train": "train/step", "eval": "eval/step"}[kind]
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if key in r]


class JsonlSink:
    """One JSON object per train step in ``metrics.jsonl``."""

    def __init__(self, path: Path):
        self._f = open(path, "a", buffering=1)

    def log(self, metrics: dict) -> None:
        self._f.write(json.dumps(metrics) + "\n")

    def close(self) -> None:
        self._f.close()


class NullSink:
    def log(self, metrics: dict) -> None:
        pass

    def close(self) -> None:
        pass


def _step_of(metrics: dict) -> int:
    """The step of a row: ``eval/step`` for an evaluation, else ``train/step``."""
    return int(metrics.get("eval/step", metrics.get("train/step", 0)))


def _scalars(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool)}


class TensorBoardSink:
    """Scalars under ``<run_dir>/tensorboard``, one point per train step (evaluation rows at
    the step they evaluated)."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self._w = SummaryWriter(log_dir=str(log_dir))

    def log(self, metrics: dict) -> None:
        step = _step_of(metrics)
        for key, value in _scalars(metrics).items():
            self._w.add_scalar(key, value, global_step=step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class WandbSink:
    """Weights & Biases: train rows against ``train/step``, evaluation rows against
    ``eval/step``. ``mode=offline`` writes under ``<run_dir>/wandb`` without a network."""

    def __init__(self, run_dir: Path, project: str, entity: str | None, mode: str,
                 config: dict | None = None):
        import wandb

        self._run = wandb.init(project=project, entity=entity, mode=mode, dir=str(run_dir),
                               name=run_dir.name, config=config or {}, reinit="finish_previous")
        self._run.define_metric("train/step")
        self._run.define_metric("eval/step")
        self._run.define_metric("eval/*", step_metric="eval/step")
        self._run.define_metric("*", step_metric="train/step")

    def log(self, metrics: dict) -> None:
        self._run.log(_scalars(metrics))

    def close(self) -> None:
        self._run.finish()


class MultiSink:
    """Every row to every sink."""

    def __init__(self, sinks: list[MetricSink]):
        self.sinks = list(sinks)

    def add(self, sink: MetricSink) -> None:
        self.sinks.append(sink)

    def log(self, metrics: dict) -> None:
        for s in self.sinks:
            s.log(metrics)

    def close(self) -> None:
        for s in self.sinks:
            s.close()


class RowsSink:
    """Keeps the rows in memory (the Python API's DataFrames, the run's curves)."""

    def __init__(self) -> None:
        self.train: list[dict] = []
        self.eval: list[dict] = []

    def log(self, metrics: dict) -> None:
        (self.eval if "eval/step" in metrics else self.train).append(dict(metrics))

    def close(self) -> None:
        pass


# the package each optional sink needs, which is also the name of the extra that installs it
SINK_PACKAGE = {"tensorboard": "tensorboard", "wandb": "wandb"}


def check_sinks(metrics_cfg) -> None:
    """A sink whose package is missing is a config error naming the extra that installs it
    (raised before any cluster starts)."""
    from flows.config import ConfigError

    for kind in metrics_cfg.sinks:
        package = SINK_PACKAGE.get(kind.value)
        if package is None:
            continue
        try:
            __import__(package)
        except ImportError:
            raise ConfigError(f"metrics.sinks: {kind.value} needs the {package} package: "
                              f"pip install 'rollarc[{package}]'") from None


def make_sinks(metrics_cfg, run_dir: Path, config: dict | None = None) -> MultiSink:
    """The sinks of ``metrics.sinks``, each at most once; ``config`` goes to W&B."""
    from flows.config import SinkKind

    check_sinks(metrics_cfg)
    w = metrics_cfg.wandb
    build = {SinkKind.JSONL: lambda: JsonlSink(run_dir / "metrics.jsonl"),
             SinkKind.TENSORBOARD: lambda: TensorBoardSink(run_dir / "tensorboard"),
             SinkKind.WANDB: lambda: WandbSink(run_dir, w.project, w.entity, w.mode, config),
             SinkKind.NULL: NullSink}
    return MultiSink([build[kind]() for kind in dict.fromkeys(metrics_cfg.sinks)])


def run_header(cfg: TrainConfig, run_dir: Path) -> str:
    """The few settings that say what a run is, for its first lines; the whole resolved config
    is in ``<run_dir>/config.yaml``."""
    mix = ", ".join(f"{t.name} x{t.weight:g}" for t in cfg.env_tasks)
    pools = ", ".join(f"{p.name} {p.workers}x{p.profile}" for p in effective_pools(cfg))
    policy = cfg.policy.path or (f"tiny {cfg.policy.model_type} (random init, seed "
                                 f"{cfg.policy.init_seed})")
    backend = cfg.engine.backend["_component_"]
    return "\n".join([
        f"run {run_dir} (full config: {run_dir / 'config.yaml'})",
        f"  {cfg.mode} {cfg.placement}, {cfg.trainer.max_steps} steps of "
        f"{cfg.trainer.groups_per_step} groups (~{batch_trajectories(cfg)} trajectories), "
        f"max staleness {cfg.rollout.max_staleness}, seed {cfg.seed}",
        f"  policy: {policy}; engine: {backend if isinstance(backend, str) else describe(backend)}",
        f"  env tasks: {mix}",
        f"  reward: {cfg.reward.backend}; pools: {pools}"])


class ProgressLine:
    """step, mean reward, success per environment, trajectories/s and staleness, live."""

    def __init__(self, total: int, enabled: bool = True):
        self.enabled = enabled
        self._p = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                           TextColumn("{task.description}"), TimeElapsedColumn(),
                           disable=not enabled, transient=False)
        self._task = self._p.add_task("starting", total=total)

    def __enter__(self) -> ProgressLine:
        self._p.start()
        return self

    def __exit__(self, *exc) -> None:
        self._p.stop()

    def update(self, m: dict, env_names: list[str]) -> None:
        succ = " ".join(f"{n}={m.get(f'env/{n}/success', float('nan')):.2f}" for n in env_names)
        desc = (f"reward {m.get('reward/mean', 0):+.3f} | success {succ} | "
                f"{m.get('perf/trajectories_per_s', 0):.1f} traj/s | "
                f"staleness {m.get('rollout/staleness_mean', 0):.2f}")
        self._p.update(self._task, completed=int(m.get("train/step", 0)), description=desc)
