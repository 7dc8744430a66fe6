"""The monitor in the scheduler process: :class:`RunMonitor`, a ``SchedulerPlugin`` that receives
the driver's records in its ``log_event`` hook, keeps them (:class:`RunRecords`) and serves them

- ``/individual-rollarc``: a Bokeh page in the scheduler's dashboard server (listed for
  JupyterLab's Dask extension through ``/individual-plots.json``), live;
- ``/rollarc/data.json``: the same records as JSON (notebooks, scripts);
- the ``rollarc_`` Prometheus series (:mod:`flows.monitoring.prometheus`).

Dask has no public API for adding a dashboard page: a scheduler we start gets the page through
``distributed.dashboard.scheduler.applications`` (:func:`register_page_before_start`, so it is
in the dashboard's "More" menu too), a running one through its Bokeh server's application table
(:func:`install_page`). ``tests/integration/test_monitor.py`` pins both.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from flows.monitoring.prometheus import register_collector, unregister_collector
from flows.monitoring.records import TOPIC, RunRecords

logger = logging.getLogger(__name__)

PLUGIN_NAME = "rollarc-monitor"
PAGE = "/individual-rollarc"
DATA_PATH = "/rollarc/data.json"
BUSY_SAMPLE_S = 1.0


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
        self._collector = register_collector(self.records)
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
            unregister_collector(self._collector)
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
