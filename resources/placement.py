"""A scheduler plugin that records where each task ran: counts per (stage, worker), and on demand
every task's compute interval (the benchmark's timelines and overhead accounting)."""

from __future__ import annotations

from collections import Counter, defaultdict

from dask.utils import key_split
from distributed.diagnostics.plugin import SchedulerPlugin

PLACEMENT_PLUGIN = "rollarc-placement"


class PlacementRecorder(SchedulerPlugin):
    name = PLACEMENT_PLUGIN

    def __init__(self, stream: bool = False) -> None:
        self.counts: defaultdict[str, Counter] = defaultdict(Counter)
        # with ``stream``: (key, worker, compute start, compute stop) of every task, wall clock
        self.stream: list[tuple[str, str, float, float]] | None = [] if stream else None

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler

    def transition(self, key, start, finish, *args, stimulus_id=None, **kwargs) -> None:
        if start == "processing" and finish in ("memory", "erred"):
            worker = kwargs.get("worker")
            if worker is not None:
                self.counts[key_split(key)][worker] += 1
                if self.stream is not None:
                    for ss in kwargs.get("startstops") or ():
                        if ss.get("action") == "compute":
                            self.stream.append((str(key), worker, ss["start"], ss["stop"]))

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {stage: dict(c) for stage, c in self.counts.items()}


def task_stream_snapshot(dask_scheduler=None) -> list[tuple[str, str, float, float]]:
    """For ``client.run_on_scheduler``: the recorded task stream (empty when not recorded)."""
    plugin = dask_scheduler.plugins.get(PLACEMENT_PLUGIN)
    return list(plugin.stream or []) if plugin is not None else []


def placement_snapshot(dask_scheduler=None) -> dict[str, dict[str, int]]:
    """For ``client.run_on_scheduler``."""
    plugin = dask_scheduler.plugins.get(PLACEMENT_PLUGIN)
    return plugin.snapshot() if plugin is not None else {}


def _drop_recorder(dask_scheduler=None) -> bool:
    """For ``client.run_on_scheduler``: remove an earlier run's recorder, if there is one."""
    return dask_scheduler.plugins.pop(PLACEMENT_PLUGIN, None) is not None


def install_recorder(client, stream: bool = False) -> None:
    """Give the cluster a fresh recorder for a run. A recorder an earlier run left on the same
    cluster (a notebook's second run, a long-lived ``dask scheduler``) is removed first: its
    counts are that run's, and registering over it makes Dask warn that it overwrites."""
    client.run_on_scheduler(_drop_recorder)
    client.register_plugin(PlacementRecorder(stream=stream))
