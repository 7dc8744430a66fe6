"""Why a train step took as long as it did: each step's critical path, split by what it waited on
and by pool.

A step's *window* runs from the previous step's end (the driver holding its result; the run's
start for the first step) to its own end. The step ends with its train step, which starts when
its batch is cut; the batch is cut when its last group completes, that is when the trajectory of
the batch that finished last (the *gating trajectory*) has been scored, unless the trainer is
still busy. The critical path walks that chain back: the train step, the wait for the cut (the
gating trajectory's scoring), then the gating trajectory's turns back to back (env_reset,
prefill, decode with its KV hand-offs, env_step, and the driver's turnaround between turns), and
before its first turn what held its admission (in sync mode, the weight sync). What of the chain
lies before the window belongs to earlier steps and is cut off, so a step's categories add up to
its wall time. Every segment is attributed to a pool: time between a task becoming runnable and
its start is ``queue`` at that task's pool, time outside any task is ``orchestration`` (the
driver). The *bottleneck* is the pool with the most seconds on the path, service and queue.

Two sources. With ``metrics.task_stream`` the stages' intervals are their tasks' compute
intervals (a cohort's task is its members'; a member left running in the background spans its
stage task and the collect that picked it up). Without it they come from the driver's per-turn
timestamps and what each turn measured on its workers (the emulated prefill, KV transfer and
decode waits; the environment's step time); the rest of a turn is ``unsplit`` (queueing at the
pools, dispatch, a cohort's hold, env_reset, and a real engine's prefill and decode) at no pool
(``unattributed``, never the bottleneck), and the scoring wait counts as ``reward``. Either way a
weight load that pauses an engine during a turn counts in that turn's stage. Memory is bounded:
the last :data:`KEEP_STEPS` steps, the turns of at most :data:`KEEP_TRAJECTORIES` trajectories
(:mod:`flows.monitoring.step_timings`).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from flows.monitoring.step_timings import (
    KEEP_STEPS,
    KEEP_TRAJECTORIES,
    StepLog,
    StepTiming,
    TurnTiming,
    TurnTimings,
    trajectory_key,
)
from resources.pools import Stage

__all__ = ["KEEP_STEPS", "KEEP_TRAJECTORIES", "Category", "RunShape", "StepLog", "TurnTimings",
           "breakdowns", "markdown", "step_breakdown", "trajectory_key"]

DRIVER = "driver"  # the pool of orchestration and admission: the driver's loop
UNATTRIBUTED = "unattributed"  # the pool of unsplit time
CHECKPOINT_STAGE = "checkpoint"  # the key prefix of the trainer's periodic checkpoints
_EPS = 1e-3  # clock slack between the driver's and the workers' timestamps, seconds


class Category(StrEnum):
    """What a segment of the path was waiting on."""

    PREFILL = "prefill"
    DECODE = "decode"
    KV_TRANSFER = "kv_transfer"
    ENV = "env"
    REWARD = "reward"
    TRAIN = "train"
    WEIGHT_SYNC = "weight_sync"
    CHECKPOINT = "checkpoint"
    QUEUE = "queue"
    ORCHESTRATION = "orchestration"
    UNSPLIT = "unsplit"  # a turn's time its own measurements leave (no task stream)


TURN_STAGES = (Stage.ENV_RESET, Stage.PREFILL, Stage.DECODE, Stage.ENV_STEP)
STAGE_CATEGORY = {Stage.ENV_RESET: Category.ENV, Stage.PREFILL: Category.PREFILL,
                  Stage.DECODE: Category.DECODE, Stage.ENV_STEP: Category.ENV}


# -- the path ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Segment:
    category: Category
    pool: str
    start: float
    stop: float


@dataclass(frozen=True)
class RunShape:
    """What the analysis needs of the run: each worker's pool, and how the run runs."""

    pool_of: dict[str, str]  # worker address -> pool
    trainer_pool: str
    reward_pool: str
    sync: bool  # mode: sync (admission waits for the weights)

    def pool(self, worker: str) -> str:
        return self.pool_of.get(worker, worker)


class TaskIndex:
    """A task stream (``(key, worker, start, stop)`` per task) by key, and the trainer's,
    scoring and weight tasks by stage."""

    KINDS = (Stage.SCORE, Stage.TRAIN_STEP, Stage.PUBLISH_WEIGHTS, Stage.LOAD_WEIGHTS,
             CHECKPOINT_STAGE)

    def __init__(self, tasks: Iterable[Iterable]):
        self.by_key: dict[str, tuple[str, float, float]] = {}
        self.by_stage: dict[str, list[tuple[float, float, str, str]]] = defaultdict(list)
        for key, worker, start, stop in tasks:
            self.by_key[key] = (worker, start, stop)
            stage = key.partition("-")[0]
            if stage in self.KINDS:
                self.by_stage[stage].append((start, stop, worker, key))


def _turn_from_stream(t: TurnTiming, tasks: TaskIndex, shape: RunShape) -> list[Segment] | None:
    spans: dict[Stage, list] = {}  # stage -> [start, stop, worker]
    first = Stage.ENV_RESET if t.turn == 0 else Stage.PREFILL
    for suffix, left in t.legs:
        last = Stage(left) if left else Stage.ENV_STEP
        for stage in TURN_STAGES[TURN_STAGES.index(first):TURN_STAGES.index(last) + 1]:
            found = tasks.by_key.get(f"{stage}-{suffix}")
            if found is None:
                continue
            worker, start, stop = found
            if stage in spans:  # picked up by a collect: the stage ran on until it ended
                spans[stage][1] = max(spans[stage][1], stop)
            else:
                spans[stage] = [start, stop, worker]
        first = last
    if Stage.ENV_STEP not in spans:
        return None
    out, cursor = [], t.submitted
    for stage in TURN_STAGES:
        if stage not in spans:
            continue
        start, stop, worker = spans[stage]
        pool = shape.pool(worker)
        if start > cursor:
            out.append(Segment(Category.QUEUE, pool, cursor, start))
        out.append(Segment(STAGE_CATEGORY[stage], pool, max(start, cursor), stop))
        cursor = max(cursor, stop)
    out.append(Segment(Category.ORCHESTRATION, DRIVER, cursor, t.answered))
    # the KV hand-offs happen inside decode (new tokens' KV) and prefill (the context's)
    left = t.kv_s
    for category in (Category.DECODE, Category.PREFILL):
        for i, seg in enumerate(out):
            if seg.category is category and left > 0:
                moved = min(left, seg.stop - seg.start)
                out[i:i + 1] = [Segment(Category.KV_TRANSFER, seg.pool, seg.start,
                                        seg.start + moved),
                                Segment(category, seg.pool, seg.start + moved, seg.stop)]
                left -= moved
                break
    return out


def _turn_from_driver(t: TurnTiming, shape: RunShape) -> list[Segment]:
    env, prefill, decode = (shape.pool(w) for w in t.workers)
    parts = [(Category.PREFILL, prefill, t.prefill_s), (Category.KV_TRANSFER, decode, t.kv_s),
             (Category.DECODE, decode, t.decode_s), (Category.ENV, env, t.env_s)]
    wall = max(t.answered - t.submitted, 0.0)
    measured = sum(s for *_, s in parts)
    scale = min(1.0, wall / measured) if measured > 0 else 1.0  # never more than the turn
    parts = [(c, p, s * scale) for c, p, s in parts]
    parts.append((Category.UNSPLIT, UNATTRIBUTED, wall - measured * scale))
    out, cursor = [], t.submitted
    for category, pool, seconds in parts:
        out.append(Segment(category, pool, cursor, cursor + seconds))
        cursor += seconds
    return out


def _fill(start: float, stop: float, category: Category, pool: str, tasks: TaskIndex | None,
          shape: RunShape) -> list[Segment]:
    """``[start, stop)`` as ``category`` at ``pool``, but where a weight sync or a checkpoint ran
    (with a task stream): the path waited on those."""
    blockers = []
    if tasks is not None:
        for stage, cat in ((Stage.PUBLISH_WEIGHTS, Category.WEIGHT_SYNC),
                           (Stage.LOAD_WEIGHTS, Category.WEIGHT_SYNC),
                           (CHECKPOINT_STAGE, Category.CHECKPOINT)):
            blockers += [(max(a, start), min(b, stop), cat, shape.pool(w))
                         for a, b, w, _k in tasks.by_stage.get(stage, ()) if a < stop and b > start]
    out, cursor = [], start
    for a, b, cat, pool_ in sorted(blockers):
        if b <= cursor:
            continue
        if a > cursor:
            out.append(Segment(category, pool, cursor, a))
        out.append(Segment(cat, pool_, max(a, cursor), b))
        cursor = b
    if stop > cursor:
        out.append(Segment(category, pool, cursor, stop))
    return out


def _reward(done: float, step: StepTiming, start: float, shape: RunShape,
            tasks: TaskIndex | None) -> list[Segment]:
    """From the gating trajectory's last turn to the cut."""
    if tasks is None:
        if done >= start:
            return [Segment(Category.REWARD, shape.reward_pool, done, step.cut)]
        # it had finished before the previous step ended: the trainer was what the cut waited on
        return [Segment(Category.REWARD, shape.reward_pool, done, start),
                Segment(Category.ORCHESTRATION, DRIVER, start, step.cut)]
    scored = [s for s in tasks.by_stage.get(Stage.SCORE, ())
              if s[0] >= done - _EPS and s[1] <= step.cut + _EPS]
    if not scored:
        return _fill(done, step.cut, Category.REWARD, shape.reward_pool, tasks, shape)
    a, b, worker, _key = max(scored, key=lambda s: s[1])
    pool = shape.pool(worker)
    return [Segment(Category.QUEUE, pool, done, a), Segment(Category.REWARD, pool, a, b),
            *_fill(b, step.cut, Category.ORCHESTRATION, DRIVER, tasks, shape)]


def _train(step: StepTiming, shape: RunShape, tasks: TaskIndex | None) -> list[Segment]:
    runs = [] if tasks is None else [
        s for s in tasks.by_stage.get(Stage.TRAIN_STEP, ())
        if s[3].split("@")[0] == f"{Stage.TRAIN_STEP}-{step.step - 1}"
        and s[0] >= step.cut - _EPS]
    if not runs:
        return [Segment(Category.TRAIN, shape.trainer_pool, step.cut, step.end)]
    a, b, worker, _key = min(runs)
    pool = shape.pool(worker)
    return [Segment(Category.QUEUE, pool, step.cut, a), Segment(Category.TRAIN, pool, a, b),
            Segment(Category.ORCHESTRATION, DRIVER, b, step.end)]


def step_segments(step: StepTiming, start: float, turns: list[TurnTiming] | None,
                  shape: RunShape, tasks: TaskIndex | None = None) -> list[Segment]:
    """The critical path of ``step`` within its window ``[start, step.end]``, in time order
    and covering the window; ``turns``: the gating trajectory's."""
    chain: list[Segment] = []
    head = step.cut
    if turns:
        head = turns[0].submitted
        for i, t in enumerate(turns):
            if i:  # the driver's turnaround
                chain.append(Segment(Category.ORCHESTRATION, DRIVER, turns[i - 1].answered,
                                     t.submitted))
            found = _turn_from_stream(t, tasks, shape) if tasks is not None else None
            chain += found or _turn_from_driver(t, shape)
        chain += _reward(turns[-1].answered, step, start, shape, tasks)
    chain += _train(step, shape, tasks)
    if head > start:  # what held the gating trajectory's admission
        sync = shape.sync and tasks is None
        chain[:0] = _fill(start, head, Category.WEIGHT_SYNC if sync else Category.QUEUE,
                          shape.trainer_pool if sync else DRIVER, tasks, shape)
    out, cursor = [], start
    for seg in chain:
        a, b = max(seg.start, cursor), min(seg.stop, step.end)
        if b <= a:
            continue
        if a > cursor:
            out.append(Segment(Category.ORCHESTRATION, DRIVER, cursor, a))
        out.append(Segment(seg.category, seg.pool, a, b))
        cursor = b
    if step.end > cursor:
        out.append(Segment(Category.ORCHESTRATION, DRIVER, cursor, step.end))
    return out


def _gating(step: StepTiming, turns_of: Callable[[str], list[TurnTiming] | None]
            ) -> tuple[str | None, list[TurnTiming] | None]:
    """The step's trajectory whose last turn came back last, and its turns."""
    best: tuple[str | None, list[TurnTiming] | None] = (None, None)
    for key in step.trajectories:
        turns = turns_of(key)
        if turns and (best[1] is None or turns[-1].answered > best[1][-1].answered):
            best = (key, turns)
    return best


def summarize(step: StepTiming, start: float, segments: list[Segment], gating: str | None,
              turns: int, source: str) -> dict:
    """One step's breakdown: seconds per category and per pool, the bottleneck pool."""
    categories: dict[str, float] = defaultdict(float)
    pools: dict[str, float] = defaultdict(float)
    for seg in segments:
        categories[seg.category] += seg.stop - seg.start
        pools[seg.pool] += seg.stop - seg.start
    named = [p for p in pools if p != UNATTRIBUTED]
    return {"step": step.step, "seconds": round(step.end - start, 4),
            "categories": {str(c): round(categories[c], 4) for c in Category if c in categories},
            "pools": {p: round(s, 4) for p, s in sorted(pools.items(), key=lambda kv: -kv[1])},
            "bottleneck": max(named, key=pools.__getitem__) if named else None,
            "gating_trajectory": gating, "gating_turns": turns, "source": source}


def breakdowns(log: StepLog, turns_of: Callable[[str], list[TurnTiming] | None],
               shape: RunShape, run_start: float, tasks: Iterable[Iterable] | None = None,
               last: int | None = None) -> list[dict]:
    """The trained steps of ``log`` (the last ``last`` of them), each :func:`summarize`'d;
    ``tasks``: the run's task stream, if recorded."""
    index = TaskIndex(tasks) if tasks is not None else None
    steps = [s for s in log.steps if s.end is not None]
    out = []
    for step in steps[-last:] if last else steps:
        start = min(step.after if step.after is not None else run_start, step.cut)
        gating, turns = _gating(step, turns_of)
        segments = step_segments(step, start, turns, shape, index)
        out.append(summarize(step, start, segments, gating, len(turns or ()),
                             "task_stream" if index is not None else "driver"))
    return out


# -- reading and showing ---------------------------------------------------------------------------
def step_breakdown(run_dir: Path | str, emulated: bool = True) -> list[dict]:
    """A finished run's per-step breakdowns (``summary.json``'s ``critical_path``), in emulated
    seconds (real seconds / ``engine.time_scale``) unless ``emulated`` is False."""
    block = json.loads((Path(run_dir) / "summary.json").read_text()).get("critical_path") or {}
    scale = 1.0 / block.get("time_scale", 1.0) if emulated else 1.0
    return [s | {"seconds": s["seconds"] * scale,
                 "categories": {k: v * scale for k, v in s["categories"].items()},
                 "pools": {k: v * scale for k, v in s["pools"].items()}}
            for s in block.get("steps", [])]


def markdown(steps: list[dict], digits: int = 2) -> str:
    """A table: one row per step, its seconds per category (those that occur), bottleneck and
    gating trajectory."""
    used = [str(c) for c in Category if any(s["categories"].get(c) for s in steps)]
    header = ["step", "seconds", *used, "bottleneck", "gating trajectory"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for s in steps:
        neck = s["bottleneck"]
        share = s["pools"].get(neck, 0.0) / max(s["seconds"], 1e-12)
        cells = [str(s["step"]), f"{s['seconds']:.{digits}f}",
                 *(f"{s['categories'].get(c, 0.0):.{digits}f}" for c in used),
                 f"{neck} ({share:.0%})" if neck else "-",
                 f"{s['gating_trajectory'] or '-'} ({s['gating_turns']} turns)"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
