"""A scheduler plugin that records where each task ran: counts per (stage, worker)."""

from __future__ import annotations

from collections import Counter, defaultdict

from dask.utils import key_split
from distributed.diagnostics.plugin import SchedulerPlugin

PLACEMENT_PLUGIN = "rollarc-placement"


class PlacementRecorder(SchedulerPlugin):
    name = PLACEMENT_PLUGIN

    def __init__(self) -> None:
        self.counts: defaultdict[str, Counter] = defaultdict(Counter)

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler

    def transition(self, key, start, finish, *args, stimulus_id=None, **kwargs) -> None:
        if start == "processing" and finish in ("memory", "erred"):
            worker = kwargs.get("worker")
            if worker is not None:
                self.counts[key_split(key)][worker] += 1

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {stage: dict(c) for stage, c in self.counts.items()}


def placement_snapshot(dask_scheduler=None) -> dict[str, dict[str, int]]:
    """For ``client.run_on_scheduler``."""
    plugin = dask_scheduler.plugins.get(PLACEMENT_PLUGIN)
    return plugin.snapshot() if plugin is not None else {}
