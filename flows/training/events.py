"""The driver's event loop: futures in flight, each tagged with what it is, gathered in batches.

Every future the run waits on carries a :class:`FutureKind`; the run keeps a handler per kind.
A batch of finished futures is gathered in one call (a round trip per worker, not per future);
a failed or lost future comes back with no result and its own status, for its handler to judge.
With rollout shards (``cluster.shards``) each shard's client has an event loop of its own; they
share one wake-up condition, so that :func:`next_batch_of` waits on all of them at once.

Only Dask's public API: a tracked future reports its end through ``Future.add_done_callback``
(run on Dask's callback thread), and a batch's results come from ``Client.gather`` in
asynchronous mode, awaited on the client's event loop under a time limit.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from distributed import Client, Future

logger = logging.getLogger(__name__)

POLL_S = 0.1  # how often a waiting driver looks at its wake-up conditions
# the longest a batch of finished futures' results is waited for (they are small: a lost one
# is the only reason to wait), then one by one for as long again
GATHER_TIMEOUT_S = 10


class FutureKind(Enum):
    TURN = "turn"  # a turn's env_step: the trajectory's next observation
    SCORE = "score"  # a burst of trajectories scored by a reward function
    TRAIN = "train"  # a train step
    LOAD_WEIGHTS = "load_weights"  # an inference worker switched to published weights
    TIME_SHARE = "time_share"  # an emulated engine yielded its GPUs to colocated training
    CHECKPOINT = "checkpoint"  # the trainer wrote a periodic checkpoint
    PUBLISH = "publish"  # weights published on the trainer, for the other rollout shards


@dataclass
class Event:
    kind: FutureKind
    future: Future
    result: Any  # None when the future failed or its result was lost
    shard: int = 0  # the rollout shard whose client the future belongs to

    @property
    def ok(self) -> bool:
        return self.future.status == "finished" and self.result is not None


class EventLoop:
    def __init__(self, client: Client, shard: int = 0,
                 condition: threading.Condition | None = None):
        self.client, self.shard = client, shard
        # notified whenever a tracked future finishes; given: shared with other shards' loops
        self.condition = condition or threading.Condition()
        self._tracked: dict[str, tuple[FutureKind, Future]] = {}  # by key, until handed out
        self._done: list[Future] = []  # finished since the last look (under the condition)

    def track(self, fut: Future, kind: FutureKind) -> Future:
        self._tracked[fut.key] = (kind, fut)
        fut.add_done_callback(self._on_done)
        return fut

    def _on_done(self, fut: Future) -> None:
        with self.condition:
            self._done.append(fut)
            self.condition.notify_all()

    def pending(self) -> list[Future]:
        """The futures tracked and not yet handed out by :meth:`next_batch`."""
        return [fut for _, fut in self._tracked.values()]

    def pending_kinds(self) -> dict[str, int]:
        """How many futures of each kind are still to come (what the run waits on)."""
        counts: dict[str, int] = {}
        for kind, _ in self._tracked.values():
            counts[kind.value] = counts.get(kind.value, 0) + 1
        return counts

    def empty(self) -> bool:
        """Nothing tracked is still to come (futures forgotten with :meth:`forget` do not
        count)."""
        return not self._tracked

    def next_batch(self, wake: Callable[[], bool] | None = None,
                   poll_s: float = POLL_S) -> list[Event]:
        """Every finished future, with its result: wait until at least one finished, or until
        ``wake()`` is true (checked every ``poll_s``; then the batch may be empty), so that the
        driver sees workers come and go and its watchdogs fire even while nothing finishes."""
        while True:
            batch = self._finished()
            if batch or (wake is not None and wake()):
                break
            if self.empty():  # nothing tracked: only ``wake`` can end the wait
                if wake is None:
                    break
                time.sleep(poll_s)
                continue
            with self.condition:
                self.condition.wait(timeout=poll_s)
        return self._events(batch)

    def forget(self, keys: Iterable[str]) -> list[Event]:
        """Stop waiting for the futures of ``keys`` (given up on: cancelled, yet not come back
        in time): each is handed out now as an event without a result, and ignored if it
        finishes later."""
        return [Event(kind, fut, None, self.shard)
                for kind, fut in (self._tracked.pop(k) for k in keys if k in self._tracked)]

    def _finished(self) -> list[Future]:
        """The tracked futures finished since the last call (a forgotten one is skipped)."""
        with self.condition:
            done, self._done = self._done, []
        return [f for f in done if self._tracked.get(f.key, (None, None))[1] is f]

    def _events(self, batch: list[Future]) -> list[Event]:
        results = self._gather(batch)
        return [Event(self._tracked.pop(f.key)[0], f, results.get(f.key), self.shard)
                for f in batch]

    def _gather(self, batch: list[Future]) -> dict:
        done = [f for f in batch if f.status == "finished"]
        try:
            # Client.gather with a time limit: a result lost with its worker is rescheduled,
            # and a task pinned to a dead worker would keep the gather waiting for ever. Direct
            # from the workers: the results need not pass through the scheduler, and a gather
            # through it logs an event on the "all" topic, whose last 50 events (the run's
            # bounded Dask logs) would then hold only gathers, not the run's milestones
            # The limit is kept here, on this thread: ``asyncio.wait_for`` on the loop waits for
            # the cancelled gather to finish, and on Python 3.11 a cancellation can be lost
            # inside it (a nested wait_for, python/cpython#86296): a run that lost a worker was
            # held for good that way.
            # errors="skip": a future that failed or was cancelled meanwhile comes back as None
            # (lost, below), in its place in the dict (from a list Dask leaves it out). With
            # "raise", a gather given up on here leaves Dask's per-future waits behind, and each
            # raises AllExit once its future is cancelled, which asyncio then logs as "Task
            # exception was never retrieved" (an ERROR and a traceback in a run that handled
            # the loss).
            gather = asyncio.run_coroutine_threadsafe(
                self.client.gather({f.key: f for f in done}, direct=True, asynchronous=True,
                                   errors="skip"),
                self.client.loop.asyncio_loop)
            # Dask's gather waits for a result lost meanwhile to be computed again (the
            # future's status turns "lost"), and a task pinned to a worker that left never is:
            # once one of the batch is no longer finished, the rest is fetched one by one
            deadline = time.monotonic() + GATHER_TIMEOUT_S
            try:
                while True:
                    try:
                        results = gather.result(timeout=POLL_S)
                        break
                    except TimeoutError:
                        if (time.monotonic() > deadline
                                or any(f.status != "finished" for f in done)):
                            raise
            except BaseException:
                gather.cancel()  # asks the loop to stop it; never waits for that
                raise
            out = {}
            for f in done:
                if (result := results[f.key]) is not None or f.status == "finished":
                    out[f.key] = result
                else:  # its handler sees no result: lost
                    logger.warning("result of %s lost (%s)", f.key, f.status)
            return out
        except Exception:  # a result was lost in between (worker died): fetch one by one
            out = {}
            deadline = time.monotonic() + GATHER_TIMEOUT_S
            for f in done:
                if f.status != "finished":  # lost meanwhile: not waited for
                    logger.warning("result of %s lost (%s)", f.key, f.status)
                    continue
                try:
                    out[f.key] = f.result(timeout=max(0.1, deadline - time.monotonic()))
                except Exception:  # its handler sees no result: lost
                    logger.warning("result of %s lost", f.key)
            return out


def next_batch_of(loops: list[EventLoop], wake: Callable[[], bool] | None = None,
                  poll_s: float = POLL_S) -> list[Event]:
    """:meth:`EventLoop.next_batch` over several loops sharing one condition (the rollout
    shards'): every finished future of any of them, without blocking on one while another has
    results; ``wake()`` is checked every ``poll_s`` as there."""
    condition = loops[0].condition
    while True:
        batches = [(loop, loop._finished()) for loop in loops]
        if any(batch for _, batch in batches) or (wake is not None and wake()):
            break
        if all(loop.empty() for loop in loops):
            if wake is None:
                break
            time.sleep(poll_s)
            continue
        with condition:
            condition.wait(timeout=poll_s)
    return [ev for loop, batch in batches if batch for ev in loop._events(batch)]


def cancel(futures: Iterable[Future]) -> None:
    """Cancel ``futures``, each through its own client (rollout shards have one each)."""
    by_client: dict[int, tuple[Client, list[Future]]] = {}
    for f in futures:
        by_client.setdefault(id(f.client), (f.client, []))[1].append(f)
    for client, fs in by_client.values():
        client.cancel(fs)


class Abandoned:
    """Futures given up on (cancelled: their worker left, a watchdog fired), by key, with when.
    Each comes back through its event loop as cancelled, and its handler sees it here; one that
    does not come back within ``grace_s`` is taken as lost without it (:meth:`overdue`), so that
    nothing waits on a cancellation that never arrives."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self._at: dict[str, float] = {}

    def __contains__(self, key: str) -> bool:
        return key in self._at

    def cancel(self, futures: Iterable[Future]) -> None:
        futures = list(futures)
        if futures:
            now = time.perf_counter()
            self._at.update((f.key, now) for f in futures)
            cancel(futures)

    def lost(self, ev: Event) -> bool:
        """Given up on, or its result lost with a worker (a task that raised is not lost: it
        failed)."""
        return ev.future.key in self._at or (ev.result is None and ev.future.status != "error")

    def settled(self, key: str) -> None:
        """Its event was handled."""
        self._at.pop(key, None)

    def overdue(self, loops: Iterable[EventLoop]) -> list[tuple[Event, float]]:
        """The abandoned futures not come back within ``grace_s``: the loops stop waiting for
        them; each as an event without a result, with how long ago it was cancelled."""
        now = time.perf_counter()
        late = {k for k, at in self._at.items() if now - at > self.grace_s}
        if not late:
            return []
        out = [(ev, now - self._at[ev.future.key]) for loop in loops for ev in loop.forget(late)]
        for key in late - {ev.future.key for ev, _ in out}:  # came back meanwhile, or untracked
            self._at.pop(key, None)
        return out  # each :meth:`settled` once handled


class RunClock:
    """A run's training wall time: from its first start, the pauses between
    :meth:`TrainingRun.train` calls not counted, a resumed run's time before added."""

    def __init__(self) -> None:
        self.t0: float | None = None  # perf_counter of the start, moved on by the pauses
        self.before_s = 0.0  # training time of the run this one resumes
        self._paused_at: float | None = None

    def start(self) -> None:
        now = time.perf_counter()
        if self.t0 is None:
            self.t0 = now
        elif self._paused_at is not None:
            self.t0 += now - self._paused_at
        self._paused_at = None

    def pause(self) -> None:
        self._paused_at = time.perf_counter()

    @property
    def elapsed_s(self) -> float:
        """Stands still while paused (a checkpoint written between train() calls records the
        training time, not the pause)."""
        if self.t0 is None:
            return self.before_s
        return self.before_s + (self._paused_at or time.perf_counter()) - self.t0
