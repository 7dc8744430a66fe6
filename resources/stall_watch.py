"""A worker whose event loop stops turning writes every thread's stack while it is stuck.

A worker process whose event loop is blocked (a thread holding the GIL in C code, a deadlock,
a handler that never yields) sends no heartbeat; the scheduler restarts it after
``cluster.worker_ttl_s`` and its tasks are sent again, but nothing says where it was stuck:
Dask's own "Event loop was unresponsive" warning is written only once the loop turns again,
and the restart kills the process first. :class:`StallWatch` arms :mod:`faulthandler`'s
watchdog in each worker process (``faulthandler.dump_traceback_later``: a C thread that needs
neither the event loop nor the GIL) and re-arms it from a periodic callback on the worker's
event loop. While the loop turns, the watchdog never fires; once it has not turned for
``seconds``, every thread's Python stack is written to the worker's stderr (its log: the
driver's terminal for the embedded cluster, the ``dask worker`` command's output on an external
one), and again every ``seconds`` while it stays stuck, so a deadlock (the same stack each
time) tells itself from slow progress. When the loop turns again, a warning names the worker
and how long it was stuck.

The watchdog is one per process: a worker in the process of the client (``cluster.processes:
false``, or a notebook's in-process cluster) is not watched, so that the client's own use of
:mod:`faulthandler` (e.g. pytest's) is left alone.
"""

from __future__ import annotations

import faulthandler
import logging
import sys
import time

from tornado.ioloop import PeriodicCallback

from resources.process_plugin import ProcessWorkerPlugin

logger = logging.getLogger(__name__)

PLUGIN_NAME = "rollarc-stall-watch"
CALLBACK = "rollarc-stall-watch"
TICKS_PER_PERIOD = 4  # re-arms per period: a loop late by less than a period never dumps


class StallWatch(ProcessWorkerPlugin):
    """Every thread's stack written to the worker's stderr when its event loop has not turned
    for ``seconds`` (see the module). ``client_pid``: the process of the client that registers
    it, whose in-process workers are not watched."""

    name = PLUGIN_NAME

    def __init__(self, seconds: float, client_pid: int | None = None):
        if seconds <= 0:
            raise ValueError(f"seconds must be positive, got {seconds}")
        super().__init__(client_pid)
        self.seconds = float(seconds)

    def setup(self, worker) -> None:
        self._callback = None
        if self.in_client_process():
            return
        self._worker = worker.name if worker.name is not None else worker.address
        self._out = sys.stderr if _has_fd(sys.stderr) else sys.__stderr__
        self._last = time.monotonic()
        self._arm()
        self._callback = PeriodicCallback(self._tick, self.seconds * 1000 / TICKS_PER_PERIOD)
        worker.periodic_callbacks[CALLBACK] = self._callback  # stopped when the worker closes
        self._callback.start()

    def _arm(self) -> None:
        # re-arming replaces the pending dump: it fires only after `seconds` without a tick
        faulthandler.dump_traceback_later(self.seconds, repeat=True, file=self._out)

    def _tick(self) -> None:
        now = time.monotonic()
        stuck = now - self._last
        self._last = now
        self._arm()
        if stuck >= self.seconds:
            logger.warning("worker %s: its event loop did not turn for %.1f s (no heartbeat "
                           "meanwhile); every thread's stack was written to its stderr each "
                           "%g s of it", self._worker, stuck, self.seconds)

    def teardown(self, worker) -> None:
        if self._callback is None:
            return
        self._callback.stop()
        worker.periodic_callbacks.pop(CALLBACK, None)
        faulthandler.cancel_dump_traceback_later()


def _has_fd(stream) -> bool:
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    return True


def watch_worker_stalls(client, seconds: float) -> None:
    """Every worker of ``client``'s cluster, and every one that joins later, watched by a
    :class:`StallWatch` of ``seconds`` (0: none)."""
    if seconds > 0:
        client.register_plugin(StallWatch(seconds), name=PLUGIN_NAME)
