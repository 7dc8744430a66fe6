"""Workers joining and leaving, as the scheduler sees them, delivered to the driver.

:class:`MembershipPlugin` is a ``SchedulerPlugin``: its ``add_worker``/``remove_worker`` hooks
send each change on the event topic ``rollarc-workers`` (``Scheduler.log_event``).
:class:`MembershipWatch`, on the driver, subscribes to the topic (``Client.subscribe_topic``) and
queues the changes for the driver's event loop to take between batches; the client calls the
handler from its own thread, so the queue is thread-safe and the loop never blocks on it.
A worker restarted by its Nanny comes back under its name with a new address: a removal, then
an addition.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from enum import Enum

from distributed import Client
from distributed.diagnostics.plugin import SchedulerPlugin

from resources.pools import tags_of

TOPIC = "rollarc-workers"
PLUGIN_NAME = "rollarc-membership"


class Change(Enum):
    JOINED = "joined"
    LEFT = "left"


@dataclass(frozen=True)
class WorkerChange:
    change: Change
    address: str
    name: str
    tags: dict[str, float]  # the worker's RollArc resource tags and their slots
    at: float  # the driver's clock when the change was taken off the topic


class MembershipPlugin(SchedulerPlugin):
    """Announces every worker that joins or leaves on :data:`TOPIC`."""

    name = PLUGIN_NAME
    idempotent = True

    def add_worker(self, scheduler, worker: str) -> None:
        ws = scheduler.workers.get(worker)
        if ws is not None:
            scheduler.log_event(TOPIC, {"change": Change.JOINED.value, "address": worker,
                                        "name": str(ws.name), "tags": tags_of(ws.resources)})

    def remove_worker(self, scheduler, worker: str, *, stimulus_id: str, **kwargs) -> None:
        # the WorkerState is gone by now: the driver knows the tags it had
        scheduler.log_event(TOPIC, {"change": Change.LEFT.value, "address": worker,
                                    "name": "", "tags": {}})


class MembershipWatch:
    """The driver's side: registers the plugin, subscribes, and hands out changes."""

    def __init__(self, client: Client):
        self.client = client
        self._queue: queue.SimpleQueue[WorkerChange] = queue.SimpleQueue()
        client.register_plugin(MembershipPlugin())
        client.subscribe_topic(TOPIC, self._on_event)

    def _on_event(self, event: tuple[float, dict]) -> None:
        _, msg = event
        self._queue.put(WorkerChange(Change(msg["change"]), msg["address"], msg["name"],
                                     dict(msg["tags"]), time.perf_counter()))

    def pending(self) -> bool:
        return not self._queue.empty()

    def take(self) -> list[WorkerChange]:
        out = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        try:
            self.client.unsubscribe_topic(TOPIC)
        except Exception:  # the client is already closing
            pass
