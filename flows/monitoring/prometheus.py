"""The run's ``rollarc_`` series on the scheduler's Prometheus ``/metrics``: a collector in the
scheduler process's global registry (which the scheduler's ``/metrics`` serves, beside Dask's
own series) that reads the monitor's :class:`~flows.monitoring.records.RunRecords`."""

from __future__ import annotations

import logging
import re

from flows.monitoring.records import RunRecords

logger = logging.getLogger(__name__)


def metric_name(key: str) -> tuple[str, dict[str, str]]:
    """``env/frozenlake/success`` -> (``rollarc_env_success``, {env_task: frozenlake}); the
    same for ``eval/<task>/...``; other keys become ``rollarc_<a>_<b>``."""
    parts = key.split("/")
    labels = {}
    if parts[0] in ("env", "eval") and len(parts) == 3:
        labels["env_task"] = parts[1]
        parts = [parts[0], parts[2]]
    return "rollarc_" + re.sub(r"[^a-zA-Z0-9_]", "_", "_".join(parts)), labels


def register_collector(records: RunRecords):
    """Register the collector of ``records``; None (and a warning) without
    ``prometheus_client``. :func:`unregister_collector` takes it out again."""
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


def unregister_collector(collector) -> None:
    from prometheus_client import REGISTRY

    REGISTRY.unregister(collector)
