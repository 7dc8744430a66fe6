"""Periodic checkpoints of a run directory, and what resuming from one needs.

``<run_dir>/checkpoints/step-000040/`` holds the trainer's ``checkpoint.pt`` (written on the
trainer's worker: weights, optimiser, scheduler, version, random states) and the driver's
``driver.json`` (the env-task sampler's state, trajectory ids, training time so far). The
driver's file is written last, so a directory without it is incomplete and never resumed from.
:class:`Checkpointer` writes them during a run.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from flows.training.orchestration import GroupDraw

if TYPE_CHECKING:
    from distributed import Future

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
DRIVER_STATE = "driver.json"
TRAINER_STATE = "checkpoint.pt"


def step_dir(run_dir: str | Path, version: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step-{version:06d}"


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def complete(run_dir: str | Path) -> list[Path]:
    """The run's complete periodic checkpoints, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(d for d in root.glob("step-*")
                  if (d / DRIVER_STATE).is_file() and (d / TRAINER_STATE).is_file())


def latest(run_dir: str | Path) -> Path | None:
    found = complete(run_dir)
    return found[-1] if found else None


def prune(run_dir: str | Path, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints (and incomplete older ones)."""
    found = complete(run_dir)
    if not found:
        return
    keep_from = found[-keep:][0]
    for d in sorted((Path(run_dir) / CHECKPOINTS).glob("step-*")):
        if d < keep_from:
            shutil.rmtree(d, ignore_errors=True)


def truncate_metrics(run_dir: str | Path, version: int) -> int:
    """Keep the rows of ``metrics.jsonl`` up to ``version`` (train steps and evaluations), so
    that a resumed run continues it without duplicated steps; the number of rows dropped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        row = json.loads(line)
        step = row.get("train/step", row.get("eval/step", 0))
        if step <= version:
            kept.append(line)
        else:
            dropped += 1
    tmp = path.with_name(".metrics.jsonl.tmp")
    tmp.write_text("".join(x + "\n" for x in kept))
    os.replace(tmp, path)
    return dropped


class Checkpointer:
    """A run's periodic checkpoints: the trainer writes its state (a Dask task on its worker,
    tracked by the run's event loop), then the driver its own, last. While one is written no
    train step starts (``RunCore.checkpoints_in_flight``), so it is of one version."""

    def __init__(self, run_dir: Path, keep: int, trainer, core,
                 track: Callable[[Future], Future]):
        """``track``: hands the trainer's future to the run's event loop (a CHECKPOINT)."""
        self.run_dir, self.keep = run_dir, keep
        self.trainer, self.core, self.track = trainer, core, track
        # key -> (future, directory, driver state, started)
        self._in_flight: dict[str, tuple[Future, Path, dict, float]] = {}
        self.seconds: list[float] = []  # each one, submitted to written (the trainer's time)

    def start(self, version: int, driver_state: dict) -> None:
        directory = step_dir(self.run_dir, version)
        fut = self.trainer.checkpoint(str(directory), version)
        self._in_flight[fut.key] = (fut, directory, driver_state, time.perf_counter())
        self.core.checkpoints_in_flight += 1
        self.track(fut)

    def on_checkpoint(self, ev, lost: bool) -> None:
        entry = self._in_flight.pop(ev.future.key, None)
        if entry is None:  # abandoned with the trainer's worker
            return
        self.core.checkpoints_in_flight -= 1
        if lost:
            return
        _, directory, state, started = entry
        self.seconds.append(time.perf_counter() - started)
        if ev.future.status != "finished":
            raise RuntimeError(f"checkpoint {directory} failed: {ev.future.exception()!r}")
        self.finish(directory, state)

    def finish(self, directory: Path, state: dict) -> None:
        write_json_atomic(directory / DRIVER_STATE, state)
        prune(self.run_dir, self.keep)
        logger.info("checkpoint at policy version %d: %s", state["version"], directory)

    def now(self, version: int, driver_state: dict, timeout: float) -> Path:
        """A checkpoint of ``version``, written before returning (a graceful stop)."""
        directory = step_dir(self.run_dir, version)
        self.trainer.checkpoint(str(directory), version).result(timeout=timeout)
        self.finish(directory, driver_state)
        return directory

    def abandon(self) -> list[Future]:
        """The trainer's worker left: the checkpoints in flight are given up (returned, for
        the caller to cancel)."""
        futures = [fut for fut, *_ in self._in_flight.values()]
        self._in_flight.clear()
        self.core.checkpoints_in_flight = 0
        return futures

    def keys(self) -> set[str]:
        return set(self._in_flight)

    def land(self, timeout: float) -> None:
        """An interrupted run lets the checkpoints in flight land."""
        for fut, directory, state, _ in self._in_flight.values():
            try:
                fut.result(timeout=timeout)
                self.finish(directory, state)
            except Exception as exc:
                logger.warning("checkpoint %s not finished: %s", directory, exc)
        self._in_flight.clear()
        self.core.checkpoints_in_flight = 0


def resume(cfg, trainer) -> dict:
    """The trainer resumed from ``trainer.resume_from`` (a :class:`flows.config.TrainConfig`'s);
    the driver's state to continue from: a periodic checkpoint's, to continue exactly, or after
    a final checkpoint its version with new group seeds (not a replay of the first run's)."""
    version = trainer.resume(cfg.trainer.resume_from)
    state = Path(cfg.trainer.resume_from).parent / DRIVER_STATE
    if state.is_file():
        return json.loads(state.read_text())
    return {"version": version, "draw": GroupDraw(
        cfg.env_tasks, random.Random(f"{cfg.seed}/{version}")).state()}
