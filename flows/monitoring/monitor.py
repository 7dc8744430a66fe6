"""The run on the scheduler: a RollArc page on the Dask dashboard, ``rollarc_*`` series on the
scheduler's Prometheus ``/metrics``, spans that split task time by env task and stage, and
events on the dashboard's ``/events`` page.

The driver publishes with :class:`DashboardSink` (a metric sink) through ``Client.log_event``
on topic ``rollarc``; :class:`RunMonitor`, a ``SchedulerPlugin``, receives every event in its
``log_event`` hook and keeps the runs' records in the scheduler process. From there it serves

- ``/individual-rollarc``: a Bokeh page in the scheduler's dashboard server (listed for
  JupyterLab's Dask extension through ``/individual-plots.json``), live;
- ``/rollarc/data.json``: the same records as JSON (notebooks, scripts);
- Prometheus series under ``rollarc_`` beside Dask's own, from a collector registered in the
  scheduler process's global registry, which the scheduler's ``/metrics`` serves.

The plugin is registered by the run (``idempotent=True``), so an external scheduler gets the
page without a restart. Dask has no public API for adding a dashboard page: a scheduler we
start gets the page through ``distributed.dashboard.scheduler.applications`` (so it is in the
dashboard's "More" menu too), a running one through its Bokeh server's application table
(:func:`install_page`). ``tests/integration/test_monitor.py`` pins both.
"""

from __future__ import annotations

import json
import logging
import numbers
import re
import time
from collections import defaultdict, deque
from contextlib import contextmanager
from enum import StrEnum
from typing import Any

import dask
from distributed import Client, span
from distributed.diagnostics.plugin import SchedulerPlugin

logger = logging.getLogger(__name__)

PLUGIN_NAME = "rollarc-monitor"
TOPIC = "rollarc"
PAGE = "/individual-rollarc"
DATA_PATH = "/rollarc/data.json"
SPAN_ROOT = "rollarc"
BUSY_SAMPLE_S = 1.0
BUSY_HISTORY = 600  # samples kept per pool


class RecordKind(StrEnum):
    RUN_START = "run_start"  # run id, env tasks, worker -> pool
    TRAIN = "train"  # one train step's metrics row
    EVAL = "eval"  # one evaluation round's row
    LIVE = "live"  # states, pools, drops, staleness histogram, worker versions
    RUN_END = "run_end"


# -- driver side ------------------------------------------------------------------------------
def publish(client: Client, kind: RecordKind, record: dict) -> None:
    """One record to the monitor (and to the scheduler's event log under ``rollarc``)."""
    client.log_event(TOPIC, {"kind": kind.value, "time": time.time(), **record})


def announce(client: Client, action: str, **fields: Any) -> None:
    """A run milestone on the dashboard's ``/events`` page (topic ``all``, with an action)."""
    client.log_event("all", {"action": f"rollarc-{action}", **fields})


class DashboardSink:
    """A metric sink that publishes each train and evaluation row to the scheduler."""

    def __init__(self, client: Client):
        self.client = client

    def log(self, metrics: dict) -> None:
        kind = RecordKind.EVAL if "eval/step" in metrics else RecordKind.TRAIN
        publish(self.client, kind, {"row": _jsonable(metrics)})
        if kind is RecordKind.EVAL:
            announce(self.client, "evaluation", step=metrics["eval/step"])

    def close(self) -> None:
        pass


def _jsonable(row: dict) -> dict:
    """Numbers (numpy's too) as Python numbers, anything else as text: msgpack-safe."""
    def plain(v):
        if isinstance(v, bool | str) or v is None:
            return v
        if isinstance(v, numbers.Integral):
            return int(v)
        if isinstance(v, numbers.Real):
            return float(v)
        return str(v)

    return {k: plain(v) for k, v in row.items()}


def install_monitor(client: Client) -> None:
    """Register the monitor on the scheduler once; later runs reuse it."""
    client.register_plugin(RunMonitor(), name=PLUGIN_NAME)


def page_url(dashboard_link: str | None) -> str | None:
    """The RollArc page beside the dashboard's ``/status``."""
    if not dashboard_link:
        return None
    base = dashboard_link.rsplit("/status", 1)[0].rstrip("/")
    return base + PAGE


def span_root(run_id: str) -> str:
    return f"{SPAN_ROOT} {run_id}"


class StageSpans:
    """The run's Dask spans: ``rollarc <run id>`` / env task / stage (``reward``/function and
    ``trainer``/stage for the rest). Each is made once and reused for every task, so Fine
    Performance Metrics splits the run's time by env task and by stage (a span per submission
    would grow the scheduler's span table with every turn)."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self._annotations: dict[tuple[str, ...], dict] = {}

    def annotation(self, *tags: str) -> dict:
        if not tags:
            if () not in self._annotations:
                with span(span_root(self.run_id)):
                    self._annotations[()] = dask.get_annotations()["span"]
            return self._annotations[()]
        if tags not in self._annotations:
            with dask.annotate(span=self.annotation()), span(*tags):
                self._annotations[tags] = dask.get_annotations()["span"]
        return self._annotations[tags]

    @contextmanager
    def __call__(self, *tags: str):
        with dask.annotate(span=self.annotation(*tags)):
            yield


# -- scheduler side ---------------------------------------------------------------------------
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


class RunMonitor(SchedulerPlugin):
    """Keeps the runs' records on the scheduler and serves them (page, JSON, Prometheus)."""

    name = PLUGIN_NAME
    idempotent = True  # a second registration keeps the first monitor and its records

    def __init__(self) -> None:
        self.records = RunRecords()
        self._collector = None
        self._sampler = None

    async def start(self, scheduler) -> None:
        from tornado.ioloop import PeriodicCallback

        self.scheduler = scheduler
        install_page(scheduler)
        scheduler.http_application.add_handlers(r".*", [(DATA_PATH, _DataHandler,
                                                         {"monitor": self})])
        self._collector = _register_collector(self.records)
        self._sampler = PeriodicCallback(lambda: self.records.sample_busy(scheduler),
                                         BUSY_SAMPLE_S * 1000)
        self._sampler.start()

    def transition(self, key, start, finish, *args, stimulus_id=None, **kwargs) -> None:
        if start == "processing" and finish in ("memory", "erred") and "worker" in kwargs:
            self.records.task_done(kwargs["worker"], kwargs.get("startstops"))

    def log_event(self, topic: str, msg: Any) -> None:
        if topic == TOPIC and isinstance(msg, dict) and "kind" in msg:
            try:
                self.records.on_record(msg)
            except (KeyError, ValueError, TypeError):  # a malformed record costs only itself
                logger.warning("rollarc monitor: ignored a malformed record")

    async def close(self) -> None:
        if self._sampler is not None:
            self._sampler.stop()
        if self._collector is not None:
            from prometheus_client import REGISTRY

            REGISTRY.unregister(self._collector)
            self._collector = None


def monitor_of(scheduler) -> RunMonitor | None:
    return scheduler.plugins.get(PLUGIN_NAME)


def _data_handler_cls():
    from tornado.web import RequestHandler

    class DataHandler(RequestHandler):
        def initialize(self, monitor: RunMonitor) -> None:
            self.monitor = monitor

        def get(self) -> None:
            self.set_header("Content-Type", "application/json")
            self.write(json.dumps(self.monitor.records.to_json()))

    return DataHandler


_DataHandler = _data_handler_cls()


# -- Prometheus -------------------------------------------------------------------------------
def metric_name(key: str) -> tuple[str, dict[str, str]]:
    """``env/frozenlake/success`` -> (``rollarc_env_success``, {env_task: frozenlake}); the
    same for ``eval/<task>/...``; other keys become ``rollarc_<a>_<b>``."""
    parts = key.split("/")
    labels = {}
    if parts[0] in ("env", "eval") and len(parts) == 3:
        labels["env_task"] = parts[1]
        parts = [parts[0], parts[2]]
    return "rollarc_" + re.sub(r"[^a-zA-Z0-9_]", "_", "_".join(parts)), labels


def _register_collector(records: RunRecords):
    try:
        from prometheus_client import REGISTRY
        from prometheus_client.core import GaugeMetricFamily
    except ImportError:  # /metrics needs prometheus_client in the scheduler's environment
        logger.warning("prometheus_client is not installed: no rollarc_ series on /metrics")
        return None

    class RunCollector:
        """The current run's latest train and evaluation rows and live figures."""

        def collect(self):
            if records.run_id is None:
                return
            run = records.run_id
            families: dict[str, GaugeMetricFamily] = {}

            def gauge(name: str, doc: str, labels: dict[str, str], value: float) -> None:
                label_names = ["run", *labels]
                if name not in families:
                    families[name] = GaugeMetricFamily(name, doc, labels=label_names)
                families[name].add_metric([run, *labels.values()], float(value))

            rows = ([records.train[-1]] if records.train else []) + (
                [records.evals[-1]] if records.evals else [])
            for row in rows:
                for key, value in row.items():
                    if isinstance(value, bool) or not isinstance(value, int | float):
                        continue
                    name, labels = metric_name(key)
                    gauge(name, f"RollArc {key} (latest)", labels, value)
            live = records.live
            for state, n in live.get("states", {}).items():
                gauge("rollarc_trajectories", "Training trajectories by state",
                      {"state": state}, n)
            for reason, n in live.get("dropped", {}).items():
                gauge("rollarc_trajectories_dropped", "Dropped trajectories by reason",
                      {"reason": reason}, n)
            for pool, n in live.get("in_flight_per_pool", {}).items():
                gauge("rollarc_pool_trajectories_in_flight",
                      "Trajectories with a task on the pool", {"pool": pool}, n)
            for worker, v in live.get("worker_versions", {}).items():
                gauge("rollarc_worker_policy_version", "Policy version an inference worker "
                      "holds", {"worker": worker}, v)
            for pool, f in records.busy_mean().items():
                gauge("rollarc_pool_busy_fraction", "Mean share of time the pool ran a task",
                      {"pool": pool}, f)
            yield from families.values()

    collector = RunCollector()
    REGISTRY.register(collector)
    return collector


# -- the dashboard page -----------------------------------------------------------------------
def install_page(scheduler) -> bool:
    """Add the RollArc page to the running scheduler's Bokeh server; False when the scheduler
    has no dashboard. Relies on Bokeh's application table (no public API for this; pinned by
    ``tests/integration/test_monitor.py``)."""
    try:
        from bokeh.application import Application
        from bokeh.application.handlers.function import FunctionHandler
        from bokeh.server.contexts import ApplicationContext
        from bokeh.server.tornado import BokehTornado
        from bokeh.server.urls import per_app_patterns
        from bokeh.server.views.ws import WSHandler
    except ImportError:
        return False
    http = getattr(scheduler, "http_application", None)
    bokeh = next((a for a in getattr(http, "applications", []) if isinstance(a, BokehTornado)),
                 None)
    if bokeh is None:
        return False
    if PAGE in bokeh.app_paths:
        return True
    prefix = bokeh.prefix
    ctx = ApplicationContext(Application(FunctionHandler(
        lambda doc: page_doc(scheduler, {"prefix": prefix + "/"}, doc))), url=PAGE)
    ctx._loop = bokeh.io_loop
    routes = []
    for pattern, handler in per_app_patterns:
        extra: dict = {"application_context": ctx,
                       "bokeh_websocket_path": f"{prefix}{PAGE}/ws"}
        if issubclass(handler, WSHandler):
            extra |= {"compression_level": None, "mem_level": None}
        routes.append((f"{prefix}{PAGE}{pattern}", handler, extra))
    bokeh._applications[PAGE] = ctx  # what app_paths and /individual-plots.json list
    bokeh.add_handlers(r".*", routes)
    bokeh.io_loop.add_callback(ctx.run_load_hook)
    return True


def page_doc(scheduler, extra, doc) -> None:
    """The page as a dashboard application (``applications[PAGE]`` signature): built from
    the records of the scheduler's monitor."""
    from flows.monitoring.dashboard_page import rollarc_doc

    def records_of():
        monitor = monitor_of(scheduler)
        return monitor.records if monitor is not None else None

    rollarc_doc(doc, records_of)


def register_page_before_start() -> None:
    """For a scheduler this process starts: the page in the dashboard's application table, so
    it is also in the dashboard's menu."""
    from distributed.dashboard.scheduler import applications

    applications.setdefault(PAGE, page_doc)


def span_times(run_id: str, dask_scheduler=None) -> dict[str, dict[str, float]]:
    """For ``client.run_on_scheduler``: the seconds the run's tasks spent per span, by
    activity (``compute``, ``transfer``, ...), keyed ``env_task/stage`` (``reward/<function>``,
    ``trainer/<stage>``) — the split Fine Performance Metrics shows."""
    ext = dask_scheduler.extensions.get("spans")
    if ext is None:
        return {}
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for sp in ext.spans.values():
        if len(sp.name) == 3 and sp.name[0] == span_root(run_id):
            for activity, s in sp.all_durations.items():
                out["/".join(sp.name[1:])][activity] += s
    return {k: dict(v) for k, v in sorted(out.items())}
