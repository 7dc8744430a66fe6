"""What the driver sends the monitor and what the monitor keeps of a run, in the scheduler
process: records of kind :class:`RecordKind` on the event topic ``rollarc``, and
:class:`RunRecords`, the current run's rows, live figures and the pools' busy fractions (which
the RollArc page, ``/rollarc/data.json`` and the ``rollarc_`` Prometheus series read)."""

from __future__ import annotations

import time
from collections import defaultdict, deque
from enum import StrEnum

TOPIC = "rollarc"
BUSY_HISTORY = 600  # samples kept per pool


class RecordKind(StrEnum):
    RUN_START = "run_start"  # run id, env tasks, worker -> pool
    TRAIN = "train"  # one train step's metrics row
    EVAL = "eval"  # one evaluation round's row
    LIVE = "live"  # states, pools, drops, staleness histogram, worker versions
    RUN_END = "run_end"


class RunRecords:
    """What the monitor knows of the current run (and the ids of earlier ones)."""

    def __init__(self) -> None:
        self.run_id: str | None = None
        self.started = 0.0
        self.env_tasks: list[str] = []
        self.worker_pool: dict[str, str] = {}
        self.train: list[dict] = []
        self.evals: list[dict] = []
        self.live: dict = {}
        self.ended = False
        self.earlier: list[str] = []
        self.busy: dict[str, deque] = defaultdict(lambda: deque(maxlen=BUSY_HISTORY))
        # per worker: compute intervals of tasks finished since the last sample, and how far
        # its busy time is already counted (no double counting of overlapping tasks)
        self._intervals: dict[str, list[tuple[float, float]]] = defaultdict(list)
        self._counted_until: dict[str, float] = defaultdict(float)
        self._sampled_at = time.time()

    def on_record(self, rec: dict) -> None:
        kind = RecordKind(rec["kind"])
        if kind is RecordKind.RUN_START:
            earlier = self.earlier + ([self.run_id] if self.run_id else [])
            RunRecords.__init__(self)  # a fresh record per run
            self.earlier = earlier
            self.run_id, self.started = rec["run_id"], rec["time"]
            self.env_tasks, self.worker_pool = rec["env_tasks"], rec["worker_pool"]
        elif kind is RecordKind.TRAIN:
            self.train.append(rec["row"])
        elif kind is RecordKind.EVAL:
            self.evals.append(rec["row"])
        elif kind is RecordKind.LIVE:
            self.live = rec["live"]
        elif kind is RecordKind.RUN_END:
            self.ended = True

    def pool_of(self, address: str, name: str) -> str:
        return self.worker_pool.get(address) or str(name).rsplit("-", 1)[0]

    def task_done(self, worker: str, startstops) -> None:
        """A finished task's compute interval, for its worker's busy time."""
        for ss in startstops or ():
            if ss.get("action") == "compute":
                self._intervals[worker].append((ss["start"], ss["stop"]))

    def _busy_s(self, worker: str) -> float:
        """Seconds the worker ran at least one task, of the tasks finished since the last
        sample (a task counts in the sample it finishes in)."""
        total, until = 0.0, self._counted_until[worker]
        for start, stop in sorted(self._intervals.pop(worker, ())):
            start = max(start, until)
            if stop > start:
                total += stop - start
                until = stop
        self._counted_until[worker] = until
        return total

    def sample_busy(self, scheduler) -> None:
        """Each pool's busy fraction since the last sample: the share of time its workers ran
        at least one task (a device is busy while any batch runs, whatever its slot count)."""
        now = time.time()
        interval, self._sampled_at = max(now - self._sampled_at, 1e-3), now
        workers: dict[str, list[str]] = defaultdict(list)
        for ws in scheduler.workers.values():
            workers[self.pool_of(ws.address, ws.name)].append(ws.address)
        if self.run_id is None or self.ended:
            self._intervals.clear()
            return
        for pool, addrs in workers.items():
            busy = sum(self._busy_s(a) for a in addrs) / (len(addrs) * interval)
            self.busy[pool].append((now - self.started, min(busy, 1.0)))

    def busy_mean(self) -> dict[str, float]:
        return {p: sum(f for _, f in s) / len(s) for p, s in self.busy.items() if s}

    def to_json(self) -> dict:
        return {"run_id": self.run_id, "ended": self.ended, "env_tasks": self.env_tasks,
                "train": self.train, "eval": self.evals, "live": self.live,
                "pool_busy_mean": self.busy_mean(),
                "pool_busy": {p: list(s) for p, s in self.busy.items()},
                "earlier_runs": self.earlier}
