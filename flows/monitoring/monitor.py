"""The run on the scheduler, from the driver's side: records and milestones published to the
monitor, the monitor installed on the scheduler, and the spans that split task time by env task
and stage.

The driver publishes with :class:`DashboardSink` (a metric sink) and :func:`publish` through
``Client.log_event`` on topic ``rollarc`` (:mod:`flows.monitoring.records`); the monitor, a
``SchedulerPlugin`` that :func:`install_monitor` registers (``idempotent=True``, so an external
scheduler gets it without a restart), keeps them in the scheduler process and serves the
RollArc page, ``/rollarc/data.json`` and the ``rollarc_`` Prometheus series
(:mod:`flows.monitoring.scheduler_plugin`, :mod:`flows.monitoring.prometheus`,
:mod:`flows.monitoring.dashboard_page`). Milestones go to the dashboard's ``/events`` page
(:func:`announce`).
"""

from __future__ import annotations

import numbers
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any

import dask
from distributed import Client, span

from flows.monitoring.records import TOPIC, RecordKind
from flows.monitoring.scheduler_plugin import PAGE, PLUGIN_NAME, RunMonitor

SPAN_ROOT = "rollarc"


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


# -- spans ------------------------------------------------------------------------------------
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
