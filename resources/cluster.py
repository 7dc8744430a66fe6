"""Cluster creation and connection.

The embedded default starts a ``SpecCluster`` with one worker process per pool worker, each
advertising its pool's tags with its slot count as the total. ``--scheduler`` connects to any
running Dask scheduler instead. Its workers that advertise their hardware (the
:mod:`resources.hardware` preload) are grouped into pools that the same cost model routes and
tags at connect time; workers started with plain ``--resources`` tags keep them, their pool
being the set of tags.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, field

import dask
from dask.utils import parse_timedelta
from distributed import Client, Nanny, Scheduler, SpecCluster, Worker
from distributed.comm.addressing import unparse_host_port
from distributed.security import Security
from distributed.utils import get_mp_context

from resources.hardware import PoolRouter, adopt_hardware, adopt_joiner
from resources.heap import keep_workers_freed_memory
from resources.net import LOOPBACK, warn_if_exposed
from resources.pools import PoolSpec, Tag, tags_of
from resources.stall_watch import watch_worker_stalls
from resources.worker import TORCH_THREADS_ENV, quiet_close

logger = logging.getLogger(__name__)


@dataclass
class ClusterHandle:
    client: Client
    cluster: SpecCluster | None
    worker_pool: dict[str, str]  # worker address -> pool name
    worker_tags: dict[str, dict[str, float]]  # worker address -> {tag: slots}
    dashboard_link: str | None

    def workers_with(self, tag: Tag) -> list[str]:
        return sorted(a for a, r in self.worker_tags.items() if r.get(str(tag), 0) > 0)

    def slots(self, tag: Tag) -> int:
        return int(sum(r.get(str(tag), 0) for r in self.worker_tags.values()))

    # pool -> the tags its workers were given at connect (workers advertising their hardware)
    pool_tags: dict[str, list[Tag]] = field(default_factory=dict)

    def adopt(self, address: str) -> dict[str, float]:
        """A worker that joined mid-run advertising its hardware gets its pool's tags (empty:
        it advertises nothing, or hardware of no pool here)."""
        if not self.pool_tags:
            return {}
        info = self.client.scheduler_info(n_workers=-1)["workers"]
        adopted = adopt_joiner(self.client, address, info, self.pool_tags)
        if adopted is None:
            return {}
        self.worker_pool[address], tags = adopted
        self.worker_tags[address] = dict(tags)
        return tags

    def refresh(self) -> None:
        """Catch up with workers that left or joined while no run was watching (between a
        session's runs): the scheduler's view, tags read from the workers' resources."""
        info = self.client.scheduler_info(n_workers=-1)["workers"]
        for address in set(self.worker_tags) - set(info):
            self.remove_worker(address)
        for address, w in info.items():
            tags = tags_of(w.get("resources"))
            if address in self.worker_tags:
                continue
            if tags:
                self.add_worker(address, str(w.get("name", address)), tags)
            else:
                self.adopt(address)

    def add_worker(self, address: str, name: str, tags: dict[str, float]) -> None:
        """A worker joined during the run, with its RollArc tags."""
        self.worker_tags[address] = dict(tags)
        self.worker_pool[address] = _pool_name(name, tags, self.cluster is not None)

    def remove_worker(self, address: str) -> dict[str, float]:
        """A worker left: the tags it had (empty: not one of ours). Its pool name is kept for
        the run's records."""
        return self.worker_tags.pop(address, {})

    def close(self) -> None:
        """In order: a local cluster retires and closes its workers, then its scheduler, while
        the client is still connected; the client goes last. (Closing the client first left
        worker heartbeats racing the scheduler's exit, which logged CommClosedError.)"""
        if self.cluster is not None:
            try:  # the workers' heartbeats may race the scheduler's exit: not an error now
                self.client.run(quiet_close, on_error="ignore")
            except Exception as exc:  # a worker gone already: nothing to quiet there
                logger.debug("quieting the workers' logs: %s", exc)
            self.cluster.close()
        self.client.close()


# Dask's logs for developers (``distributed.admin.low-level-log-length``, 1000 by default) keep
# the last messages each batched connection sent, tasks' inline arguments included: the
# scheduler's log of each worker's stream holds its last 1000 batches of compute-task messages
# (a train step's batch, a cohort's observations), the client's its last 1000 graphs. In the
# driver of a long run, which hosts the embedded scheduler, that grew the process by 175 MB over
# 80 train steps of the default. The run keeps 50: enough to debug a connection.
DEBUG_LOG_LENGTH = 50
# The dashboard's task stream (``distributed.scheduler.dashboard.tasks.task-stream-length``,
# 100,000 by default) keeps a record of every task the scheduler saw finish, about 1 KB each
# (960 bytes for a task that only computed): the default runs 80 to 100 tasks a train step, more
# under faults, so the buffer grew the driver by about 0.1 MB a step for 1,000 steps. The run
# keeps the last 10,000 tasks (some 100 steps): the dashboard's task stream and the performance
# report show those.
TASK_STREAM_LENGTH = 10_000
BOUNDED_LOGS = {"distributed.admin.low-level-log-length": DEBUG_LOG_LENGTH,
                "distributed.scheduler.dashboard.tasks.task-stream-length": TASK_STREAM_LENGTH}

# Worker processes log warnings only, never reach for a model hub, and keep short debug logs.
WORKER_ENV = {"DASK_LOGGING__DISTRIBUTED": "warning", "TRANSFORMERS_VERBOSITY": "error",
              "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
              "DASK_DISTRIBUTED__ADMIN__LOW_LEVEL_LOG_LENGTH": str(DEBUG_LOG_LENGTH)}


def bounded_logs() -> None:
    """This process's Dask logs of recent messages and tasks kept to :data:`BOUNDED_LOGS`
    (before its client and an embedded scheduler are made: each reads its length when it
    starts). A length the user set lower is kept."""
    for key, length in BOUNDED_LOGS.items():
        current = dask.config.get(key, None)
        if current is None or current > length:
            dask.config.set({key: length})


LOST_WORKER_TIMEOUT = "distributed.deploy.lost-worker-timeout"


def keep_restarting_lost_workers(seconds: float) -> None:
    """A worker of the embedded cluster killed mid-run is restarted by its Nanny; but
    ``SpecCluster`` closes the Nanny of a worker that has not come back within
    ``distributed.deploy.lost-worker-timeout`` (15 s by default), and does not start it again:
    a restart slower than that (torch and the engine loading on a busy machine) would leave its
    pool empty for the rest of the run. The embedded cluster waits ``seconds`` (the run's
    ``cluster.pool_empty_timeout_s``, after which the run stops anyway). A longer time the user
    set is kept."""
    current = parse_timedelta(dask.config.get(LOST_WORKER_TIMEOUT, None)) or 0
    if current < seconds:
        dask.config.set({LOST_WORKER_TIMEOUT: f"{seconds}s"})


MP_METHOD = "distributed.worker.multiprocessing-method"
# what a worker process imports before it can run a task: torch, transformers and the engine
# (several seconds of CPU each time); it replaces Dask's own preload list (distributed and the
# optional packages Dask finds)
WORKER_IMPORTS = ["distributed", "resources.worker"]


def fork_workers_from_a_preloaded_server() -> None:
    """Worker processes started from a fork server that has imported :data:`WORKER_IMPORTS`
    once, instead of each spawned process importing them again: on a machine of few cores
    the embedded cluster's five workers (and a Nanny's restart of a killed one) come up
    several seconds sooner. Python's ``forkserver`` start method with its preload (Dask's own
    test suite starts its workers so); a worker still imports the parent's ``__main__`` and
    gets its Nanny's environment, as a spawned one does. A method the user configured other
    than Dask's default (``spawn``) is kept; the preload takes effect only if this process's
    fork server has not started yet."""
    if dask.config.get(MP_METHOD) != "spawn":
        return
    dask.config.set({MP_METHOD: "forkserver"})
    # Dask sets its preload list the first time it makes the context; this one replaces it
    get_mp_context().set_forkserver_preload(WORKER_IMPORTS)


def _free_port(preferred: int) -> int:
    """The preferred port if free, else the next free one."""
    for port in range(preferred, preferred + 100):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    return 0


def worker_specs(pools: list[PoolSpec], tags: dict[str, list[Tag]], processes: bool) -> dict:
    specs = {}
    for pool in pools:
        for i in range(pool.workers):
            specs[f"{pool.name}-{i}"] = {
                "cls": Nanny if processes else Worker,
                "options": {
                    "nthreads": pool.slots,
                    "resources": {str(t): pool.slots for t in tags[pool.name]},
                    "memory_limit": 0,
                    **({"env": WORKER_ENV | {TORCH_THREADS_ENV: str(pool.torch_threads)},
                        "silence_logs": logging.WARNING} if processes else {}),
                },
            }
    return specs


def start_local_cluster(pools: list[PoolSpec], tags: dict[str, list[Tag]], dashboard_port: int = 8787,
                        processes: bool = True, timeout: float = 120, host: str = LOOPBACK,
                        security: Security | None = None,
                        lost_worker_timeout_s: float = 300,
                        worker_ttl_s: float = 60, stall_dump_s: float = 0,
                        heap_keep_mb: float = 0) -> ClusterHandle:
    """The embedded cluster, its scheduler and dashboard on ``host`` (loopback by default; any
    other address is logged as reachable from other machines). With ``security`` every
    connection (client, scheduler, workers) is TLS. A killed worker is restarted by its Nanny
    for up to ``lost_worker_timeout_s`` (:func:`keep_restarting_lost_workers`); one that sends
    no heartbeat for ``worker_ttl_s`` (stuck, not dead) is restarted by the scheduler, and one
    whose event loop has not turned for ``stall_dump_s`` writes its threads' stacks first
    (:func:`resources.stall_watch.watch_worker_stalls`; 0: not); each worker process keeps up
    to ``heap_keep_mb`` of freed memory for reuse (:mod:`resources.heap`; 0: the C library's
    defaults)."""
    warn_if_exposed("the Dask scheduler and dashboard (the scheduler runs code its clients "
                    "send)", host)
    bounded_logs()
    keep_restarting_lost_workers(lost_worker_timeout_s)
    if processes:
        fork_workers_from_a_preloaded_server()
    port = _free_port(dashboard_port) if dashboard_port else 0
    tls = {"security": security, "protocol": "tls"} if security is not None else {}
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": unparse_host_port(host, port),
                                                "host": host, "worker_ttl": f"{worker_ttl_s}s",
                                                **tls}}
    specs = worker_specs(pools, tags, processes)
    for spec in specs.values():
        # the host too: an in-process Worker given none listens on every interface
        spec["options"].update(host=host, **tls)
    cluster = SpecCluster(workers=specs, scheduler=scheduler, silence_logs=logging.WARNING,
                          name="rollarc", security=security)
    client = Client(cluster)
    watch_worker_stalls(client, stall_dump_s)
    keep_workers_freed_memory(client, heap_keep_mb)
    client.wait_for_workers(len(specs), timeout=timeout)
    handle = _describe(client, cluster)
    return handle


def connect(
    address: str, timeout: float = 60, route_pools: PoolRouter | None = None,
    security: Security | None = None, stall_dump_s: float = 0, heap_keep_mb: float = 0,
) -> ClusterHandle:
    """Connect to a running scheduler; with ``route_pools``, the workers advertising hardware
    are pooled and given the tags it routes them; ``security`` for a ``tls://`` scheduler;
    ``stall_dump_s`` and ``heap_keep_mb`` as for :func:`start_local_cluster`."""
    bounded_logs()
    client = Client(address, timeout=timeout, security=security)
    watch_worker_stalls(client, stall_dump_s)
    keep_workers_freed_memory(client, heap_keep_mb)
    client.wait_for_workers(1, timeout=timeout)
    return _describe(client, None, route_pools)


def _pool_name(name: str, tags: dict[str, float], spec_cluster: bool) -> str:
    """SpecCluster names workers '<pool>-<i>'; elsewhere the pool is the set of tags."""
    return name.rsplit("-", 1)[0] if spec_cluster else "+".join(sorted(tags))


def _describe(
    client: Client, cluster: SpecCluster | None, route_pools: PoolRouter | None = None
) -> ClusterHandle:
    info = client.scheduler_info(n_workers=-1)["workers"]
    adopted = adopt_hardware(client, info, route_pools) if route_pools is not None else {}
    worker_pool, worker_tags = {}, {}
    for addr, w in info.items():
        if addr in adopted:
            worker_pool[addr], res = adopted[addr]
            worker_tags[addr] = {k: v for k, v in res.items() if v > 0}
            continue
        res = tags_of(w.get("resources"))
        worker_tags[addr] = res
        worker_pool[addr] = _pool_name(str(w.get("name", addr)), res, cluster is not None)
    pool_tags: dict[str, list[Tag]] = {}
    for pool, res in adopted.values():
        pool_tags.setdefault(pool, [Tag(k) for k, v in res.items() if v > 0])
    try:
        link = client.dashboard_link
    except Exception:  # no dashboard (bokeh missing on a remote scheduler)
        link = None
    return ClusterHandle(client, cluster, worker_pool, worker_tags, link, pool_tags)
