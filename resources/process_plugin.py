"""Worker plugins whose setting is the whole process's (:mod:`faulthandler`'s watchdog, the C
library's allocator): applied in worker processes, and not in the process of the client that
registers them, where in-process workers (``cluster.processes: false``, a notebook's cluster)
share the client's process and its own settings (e.g. pytest's faulthandler timeout)."""

from __future__ import annotations

import os

from distributed.diagnostics.plugin import WorkerPlugin


class ProcessWorkerPlugin(WorkerPlugin):
    """``client_pid``: the process of the client that registers the plugin (default: this
    one, where it is made)."""

    def __init__(self, client_pid: int | None = None):
        self.client_pid = os.getpid() if client_pid is None else client_pid

    def in_client_process(self) -> bool:
        """Whether the worker it is set up on runs in the client's process."""
        return os.getpid() == self.client_pid
