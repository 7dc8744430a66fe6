"""Worker processes keep the memory they free for their next allocations.

A train step, a prefill or a decode step allocates the same large tensors every time (a layer's
attention scores, logits, gradients) and frees them at its end. glibc's allocator serves a
block above its mmap threshold (128 KiB, raised as blocks are freed, up to 32 MiB) with a
fresh ``mmap`` and unmaps it when freed, and returns free memory at the top of its heap past
its trim threshold: the next step touches new pages, and the kernel zero-fills every one of
them in a page fault. On the embedded default that cost the trainer's worker 95,000-99,000
page faults and 0.17-0.20 s of kernel time a train step, about 40 % of its CPU time, and the
prefill worker 18,000-21,000 faults a step (docs/bench.md). :func:`keep_freed_memory` raises both
thresholds with ``mallopt`` (``M_MMAP_THRESHOLD``, ``M_TRIM_THRESHOLD``; glibc's
``mallopt(3)``), so blocks below the limit come from the heap and freed memory stays there
for reuse: a process holds at most the peak it reached, up to the limit, instead of giving it
back after each step. :class:`KeepFreedMemory` applies it in every worker process of a
cluster, embedded or external (``cluster.heap_keep_mb``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

from resources.process_plugin import ProcessWorkerPlugin

logger = logging.getLogger(__name__)

PLUGIN_NAME = "rollarc-heap"
# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def keep_freed_memory(nbytes: int) -> bool:
    """This process's allocator serves blocks up to ``nbytes`` from its heap and keeps up to
    ``nbytes`` (at most 2 GiB) of freed memory there; False where the C library has no glibc
    ``mallopt`` or refuses either value."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    value = min(int(nbytes), 2**31 - 1)
    return bool(mallopt(M_MMAP_THRESHOLD, value)) and bool(mallopt(M_TRIM_THRESHOLD, value))


class KeepFreedMemory(ProcessWorkerPlugin):
    """:func:`keep_freed_memory` of ``nbytes`` in each worker process; the process of the
    client that registers it (in-process workers: ``cluster.processes: false``, a notebook's
    cluster) is left as it is."""

    name = PLUGIN_NAME

    def __init__(self, nbytes: int, client_pid: int | None = None):
        super().__init__(client_pid)
        self.nbytes = int(nbytes)

    def setup(self, worker) -> None:
        self.applied = False
        if self.in_client_process():
            return
        self.applied = keep_freed_memory(self.nbytes)
        if not self.applied:
            logger.warning("worker %s: its C library's allocator cannot be told to keep freed "
                           "memory (cluster.heap_keep_mb): left as it is", worker.name)


def keep_workers_freed_memory(client, megabytes: float) -> None:
    """Every worker process of ``client``'s cluster, and every one that joins later, keeps up
    to ``megabytes`` of freed memory for reuse (0: the C library's defaults)."""
    if megabytes > 0:
        client.register_plugin(KeepFreedMemory(int(megabytes * 2**20)), name=PLUGIN_NAME)
