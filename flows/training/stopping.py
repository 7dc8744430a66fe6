"""How a run stops short of its natural end: the end's time limit running out after the last
train step, and an interrupt. Both cancel what is in flight and drop its trajectories with a
reason, so that ``started = trained + dropped`` still holds after them."""

from __future__ import annotations

import logging
import signal
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from flows.training.events import cancel
from flows.training.lifecycle import DropReason

if TYPE_CHECKING:
    from flows.training.checkpoints import Checkpointer
    from flows.training.events import EventLoop
    from flows.training.lifecycle import TrajectoryLedger
    from flows.training.rollout import RolloutDriver
    from flows.training.train_steps import TrainSteps
    from resources.pools import Tag

logger = logging.getLogger(__name__)

TRAIN_STEP_GRACE_S = 120  # an interrupted run waits this long for its running train step
DEFERRED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def interrupts_between_batches(request: Callable[[], None]) -> Iterator[None]:
    """While the driver trains, SIGINT (Ctrl-C, a notebook's interrupt) and a SIGTERM that
    Python handles (``flows/train.py``'s) call ``request()``: the event loop raises
    KeyboardInterrupt at its next pass, between two batches of events, rather than wherever
    the signal found the driver (half-way through a trajectory's bookkeeping, which the stop
    would then trip over). A second signal goes to the handler that was there (Python's raises
    KeyboardInterrupt at once). Off the main thread, and for a signal ignored or left to the
    operating system, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: h for sig in DEFERRED_SIGNALS if callable(h := signal.getsignal(sig))}
    requested = False

    def defer(signum, frame) -> None:
        nonlocal requested
        if requested:
            previous[signum](signum, frame)
            return
        requested = True
        logger.warning("%s: stopping at the event loop's next pass (again to stop at once)",
                       signal.Signals(signum).name)
        request()

    for sig in previous:
        signal.signal(sig, defer)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def cut_the_end(loops: list[EventLoop], drivers: list[RolloutDriver], limit: float,
                missing_pools: list[Tag]) -> str:
    """The end's ``rollout.end_timeout_s`` (``limit``) is over: what is left on the event
    ``loops`` is cancelled (the ``drivers``' trajectories dropped as ``run_ended``, their
    environments closed) and named in the log with the pools no worker serves. The drop detail
    of what was cut."""
    kinds: Counter[str] = Counter()
    for loop in loops:
        kinds.update(loop.pending_kinds())
    logger.warning("the run's end waited %g s (rollout.end_timeout_s) for %s and %d "
                   "trajectories waiting for a worker (missing pools: %s): cancelled",
                   limit, dict(kinds) or "nothing", sum(d.waiting for d in drivers),
                   [str(t) for t in missing_pools] or "none")
    cancel([f for loop in loops for f in loop.pending()])
    for driver in drivers:
        driver.close_all()
    return f"still in flight rollout.end_timeout_s={limit:g} s after the last train step"


def abort(reason: DropReason, drivers: list[RolloutDriver], loops: list[EventLoop],
          steps: TrainSteps, checkpoints: Checkpointer, ledger: TrajectoryLedger) -> None:
    """Stop at once: cancel the work in flight on the event ``loops``, close the ``drivers``'
    live environment instances, drop every live trajectory of the ``ledger`` with ``reason``.
    A train step already running is let finish and recorded, so that the trainer and the
    metrics agree on the version; so are the checkpoints being written. The cluster stays
    usable."""
    for driver in drivers:
        driver.stop(reason)
    running = steps.future
    finishing = checkpoints.keys() | ({running.key} if running is not None else set())
    cancel([f for loop in loops for f in loop.pending() if f.key not in finishing])
    steps.finish(reason, TRAIN_STEP_GRACE_S)
    checkpoints.land(TRAIN_STEP_GRACE_S)
    for driver in drivers:
        driver.close_all()
    for driver in drivers:
        driver.tasks.wait_closing(timeout=30)
    for evaluation in (False, True):
        for tid in ledger.live(evaluation):
            ledger.drop(tid, reason)
