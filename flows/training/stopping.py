"""How a run stops short of its natural end: the end's time limit running out after the last
train step, and an interrupt. Both cancel what is in flight and drop its trajectories with a
reason, so that ``started = trained + dropped`` still holds after them."""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING

from flows.training.events import cancel
from flows.training.lifecycle import DropReason

if TYPE_CHECKING:
    from flows.training.run import TrainingRun

logger = logging.getLogger(__name__)

TRAIN_STEP_GRACE_S = 120  # an interrupted run waits this long for its running train step


def cut_the_end(run: TrainingRun) -> str:
    """The end's ``rollout.end_timeout_s`` is over: what is left is cancelled (its
    trajectories dropped as ``run_ended``, their environments closed) and named in the log.
    The drop detail of what was cut."""
    loops = run.event_loops()
    kinds: Counter[str] = Counter()
    for loop in loops:
        kinds.update(loop.pending_kinds())
    limit = run.cfg.rollout.end_timeout_s
    logger.warning("the run's end waited %g s (rollout.end_timeout_s) for %s and %d "
                   "trajectories waiting for a worker (missing pools: %s): cancelled",
                   limit, dict(kinds) or "nothing", sum(d.waiting for d in run.drivers),
                   [str(t) for t in run.changes.missing_pools()] or "none")
    cancel([f for loop in loops for f in loop.pending()])
    for driver in run.drivers:
        driver.close_all()
    return f"still in flight rollout.end_timeout_s={limit:g} s after the last train step"


def abort(run: TrainingRun, reason: DropReason) -> None:
    """Stop at once: cancel the work in flight, close the live environment instances, drop
    every live trajectory with ``reason``. A train step already running is let finish and
    recorded, so that the trainer and the metrics agree on the version; so are the checkpoints
    being written. The cluster stays usable."""
    for driver in run.drivers:
        driver.stop(reason)
    running = run.steps.future
    finishing = run.checkpoints.keys() | ({running.key} if running is not None else set())
    cancel([f for loop in run.event_loops() for f in loop.pending() if f.key not in finishing])
    run.steps.finish(reason, TRAIN_STEP_GRACE_S)
    run.checkpoints.land(TRAIN_STEP_GRACE_S)
    for driver in run.drivers:
        driver.close_all()
    for driver in run.drivers:
        driver.tasks.wait_closing(timeout=30)
    for evaluation in (False, True):
        for tid in run.ledger.live(evaluation):
            run.ledger.drop(tid, reason)
