"""New weights handed from loader threads to an engine's own thread, applied at its safe point.

Both inference engines (``hf``: :class:`resources.engine.InferenceEngine`; ``vllm``:
:class:`resources.vllm_engine.VLLMEngine`) run their forward passes on one thread and take new
weights only between two passes. A loader (the ``load_weights`` Dask task) stages a snapshot and
blocks; the engine thread applies the newest staged snapshot when it reaches the safe point and
releases every loader waiting, also those whose older snapshot was skipped for it. Versions only
move forward, and a failed load keeps the old weights serving and raises in the loader.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import numpy as np

logger = logging.getLogger(__name__)


class WeightStaging:
    """The snapshot waiting for an engine's safe point, and the loaders waiting on it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: tuple[dict[str, np.ndarray], int] | None = None
        self._waiters: list[threading.Event] = []
        self._error: Exception | None = None

    def stage(self, state: dict[str, np.ndarray], version: int, in_use: int,
              wake: Callable[[], None], timeout: float) -> None:
        """Called by a loader: stage ``version`` unless it is not newer than what is staged or
        ``in_use``, then block until the engine thread has applied a snapshot at least as new."""
        done = threading.Event()
        with self._lock:
            newest = self._pending[1] if self._pending else in_use
            if version > newest:
                self._pending = (state, version)
            elif self._pending is None:
                return  # already at this version or past it
            self._waiters.append(done)
        wake()
        if not done.wait(timeout):
            raise TimeoutError("the engine did not reach a safe point to load weights")
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"weights v{version} not loaded: {err}") from err

    def apply(self, in_use: int, load: Callable[[dict[str, np.ndarray], int], None]) -> None:
        """Called by the engine thread at its safe point: ``load(state, version)`` the staged
        snapshot if it is newer than ``in_use``, and release the loaders."""
        with self._lock:
            pending, self._pending = self._pending, None
            waiters, self._waiters = self._waiters, []
        if pending is None:
            return
        state, version = pending
        try:
            if version > in_use:  # an older snapshot staged during a switch is skipped
                load(state, version)
        except Exception as exc:  # keep serving the old weights; the loader sees the error
            logger.exception("could not load weights v%d", version)
            self._error = exc
        for done in waiters:
            done.set()
