"""A worker process whose event loop is blocked writes every thread's stack to its stderr while
it is blocked (``cluster.stall_dump_s``), and only then; a worker in the client's process is
neither watched nor has its heap setting (``cluster.heap_keep_mb``) applied. On a ``dask
scheduler`` and a ``dask worker`` (Nanny on) started as a user starts them, whose output is its
log file."""

from __future__ import annotations

import re
import time

import pytest

from resources.cluster import connect, start_local_cluster
from resources.heap import PLUGIN_NAME as HEAP
from resources.pools import PoolSpec, Role, Tag
from resources.stall_watch import CALLBACK, PLUGIN_NAME, StallWatch
from tests.external_cluster import ExternalCluster

pytestmark = pytest.mark.integration


def test_a_blocked_worker_writes_its_threads_stacks_while_it_is_blocked(tmp_path):
    with ExternalCluster(tmp_path, pools={str(Tag.CPU_ENV): 1}) as external:
        handle = connect(external.address, timeout=60, stall_dump_s=1)
        try:
            [worker] = external.workers_by_tag().values()
            log = tmp_path / f"worker-{Tag.CPU_ENV}.log"
            time.sleep(2.5)  # idle, its loop turning: the watchdog is re-armed, never fires
            assert "Timeout (" not in log.read_text()
            # Client.run calls a function on the worker's event loop: nothing else runs there
            # meanwhile (no heartbeat, no task handled), as when a thread holds the GIL in C
            # code (a function of this module would import it, and torch, there first)
            handle.client.run(time.sleep, 2.5, workers=[worker])
            time.sleep(1)  # the loop's next tick logs the stall
        finally:
            handle.client.close()
        text = log.read_text()
    dumps = text.count("Timeout (0:00:01)!")
    assert dumps >= 1, text  # at 1 s, and again each second while it stays blocked
    # the stuck thread's stack: the worker's handler of Client.run, on its event loop
    assert len(re.findall(r'distributed/worker\.py", line \d+ in run\n', text)) == dumps, text
    stuck = re.search(r"its event loop did not turn for (\d+\.\d) s", text)
    assert stuck and float(stuck[1]) >= 2.4, text


def test_workers_in_the_clients_process_are_neither_watched_nor_tuned():
    """The watchdog and the heap setting are the whole process's: the client's process (here,
    pytest's, whose own faulthandler timeout must stay armed) is left as it is."""
    pools = [PoolSpec(name="env", profile="CPU", role=Role.ENV, workers=1, slots=2)]
    handle = start_local_cluster(pools, {"env": [Tag.CPU_ENV]}, dashboard_port=0,
                                 processes=False, timeout=30, stall_dump_s=1, heap_keep_mb=64)
    try:
        settings = handle.client.run(lambda dask_worker: (
            CALLBACK in dask_worker.periodic_callbacks,
            isinstance(dask_worker.plugins.get(PLUGIN_NAME), StallWatch),
            dask_worker.plugins[HEAP].applied))
    finally:
        handle.close()
    assert settings and set(settings.values()) == {(False, True, False)}
