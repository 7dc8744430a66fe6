"""Periodic checkpoints of a run directory, and what resuming from one needs.

``<run_dir>/checkpoints/step-000040/`` holds the trainer's ``checkpoint.pt`` (written on the
trainer's worker: weights, optimiser, scheduler, version, random states) and the driver's
``driver.json`` (the env-task sampler's state, trajectory ids, training time so far). The
driver's file is written last, so a directory without it is incomplete and never resumed from.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

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
