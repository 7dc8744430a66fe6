"""Metric sinks (slash-namespaced keys) and the live progress line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class MetricSink(Protocol):
    def log(self, metrics: dict) -> None: ...

    def close(self) -> None: ...


def read_metrics(run_dir, kind: str = "train") -> list[dict]:
    """The rows of a run's ``metrics.jsonl``: ``train`` (one per train step, ``train/step``) or
    ``eval`` (one per evaluation, ``eval/step``)."""
    import json
    from pathlib import Path

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


def make_sink(kind: str, run_dir: Path) -> MetricSink:
    return JsonlSink(run_dir / "metrics.jsonl") if kind == "jsonl" else NullSink()


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
