"""Weights on their way to the inference workers.

After every train step (and a trainer's restore) the trainer publishes its weights and each
inference worker loads them, worker to worker (:class:`flows.training.trainer_handle.
TrainerHandle`). :class:`WeightLoads` keeps what is in flight: each load (and, monolithic on
emulated devices, each engine's time-share with the train step) pinned to its worker; the
inference workers that joined and get work only once they hold the weights; the version each
worker holds; and, with rollout shards, the weights on their way to the further shards.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from distributed import Future

from flows.training.core import RunCore
from flows.training.events import Abandoned, Event, EventLoop, FutureKind
from flows.training.shards import RolloutShards
from flows.training.trainer_handle import TrainerHandle

logger = logging.getLogger(__name__)


class WeightLoads:
    def __init__(self, core: RunCore, trainer: TrainerHandle, events: EventLoop,
                 abandoned: Abandoned, shards: RolloutShards,
                 serving: Callable[[str, dict[str, float], int, str | None], None]):
        """``serving(worker, tags, version, pool)`` is called when an inference worker that
        joined holds the weights and may get work (``pool``: its pool on a further rollout
        shard, whose pool workers took it already; None: shard 0's, with ``tags``)."""
        self.core, self.trainer, self.events = core, trainer, events
        self.abandoned, self.shards, self.serving = abandoned, shards, serving
        self.pinned: dict[str, tuple[str, Future]] = {}  # load/time-share key -> worker, future
        self.joining: dict[str, dict[str, float]] = {}  # inference workers waiting for weights
        self.worker_versions: dict[str, int] = {}  # the version each inference worker holds
        self._publishing: Future | None = None  # weights on their way to the other shards

    def load(self, loads: dict[str, Future], events: EventLoop | None = None) -> None:
        for w, f in loads.items():
            (events or self.events).track(f, FutureKind.LOAD_WEIGHTS)
            self.pinned[f.key] = (w, f)
            self.core.loads_in_flight += 1

    def publish(self, version: int) -> None:
        """The trainer's weights of ``version`` to every inference worker (and, with rollout
        shards, to the further shards once they are ready: a PUBLISH event, counted as a load in
        flight until then)."""
        self.load(self.trainer.sync_weights(version))
        if len(self.shards) > 1:
            self._publishing = self.events.track(self.trainer.snapshot, FutureKind.PUBLISH)
            self.core.loads_in_flight += 1

    def time_share(self, version: int, seconds: float) -> None:
        """Every emulated engine yields its GPUs to the train step of ``version``."""
        for w, f in zip(self.trainer.inference_workers,
                        self.trainer.time_share(version, seconds), strict=True):
            self.events.track(f, FutureKind.TIME_SHARE)
            self.pinned[f.key] = (w, f)

    # -- workers ---------------------------------------------------------------------------
    def joined(self, worker: str, tags: dict[str, float], version: int) -> None:
        """An inference worker joined: it loads the current weights (now, or once the trainer
        is back) before it gets work."""
        self.trainer.add_inference_worker(worker, tags)
        self.joining[worker] = tags
        if self.trainer.snapshot is not None and self.trainer.worker is not None:
            self.load({worker: self.trainer.load_on(worker, version)})

    def load_joiners(self, version: int) -> None:
        """Every joining inference worker has a load on its way while weights exist: one that
        joined while none could be sent (the trainer lost), or whose load was lost, gets one now
        rather than with a next version that may never come (the end of the run)."""
        if self.trainer.snapshot is None or self.trainer.worker is None:
            return
        loading = {w for w, _ in self.pinned.values()}
        for worker in self.joining:
            if worker not in loading and worker in self.trainer.inference_workers:
                logger.warning("worker %s joined and has no weight load in flight: loading v%d",
                               worker, version)
                self.load({worker: self.trainer.load_on(worker, version)})

    def worker_left(self, worker: str) -> None:
        """Its loads are given up on."""
        self.worker_versions.pop(worker, None)
        self.joining.pop(worker, None)
        self.trainer.remove_inference_worker(worker)
        self.abandoned.cancel([f for w, f in self.pinned.values() if w == worker])

    def trainer_lost(self) -> None:
        """Every load of weights published on the lost trainer is given up on: one that has not
        fetched them yet would wait for ever on a publish Dask can only recompute there; the
        restored trainer publishes again."""
        if self._publishing is not None:
            self.abandoned.cancel([self._publishing])
            self._publishing = None
        self.abandoned.cancel([f for _, f in self.pinned.values()])

    # -- completions ---------------------------------------------------------------------------
    def on_load(self, ev: Event) -> None:
        self.core.loads_in_flight -= 1
        worker, _ = self.pinned.pop(ev.future.key)
        if self.abandoned.lost(ev):  # its worker left
            return
        if ev.future.status != "finished":
            raise RuntimeError(f"weight load {ev.future.key} failed: {ev.future.exception()}")
        self.worker_versions[worker] = int(ev.result)
        tags = self.joining.pop(worker, None)
        if tags is not None:
            self.serving(worker, tags, int(ev.result), None)
        elif (shard := self.shards.loaded(worker)) is not None:
            self.serving(worker, {}, int(ev.result), shard.cluster.worker_pool.get(worker, "?"))

    def on_time_share(self, ev: Event) -> None:
        self.pinned.pop(ev.future.key, None)
        if not self.abandoned.lost(ev) and ev.future.status != "finished":
            raise RuntimeError(f"{ev.future.key} failed: {ev.future.exception()!r}")

    def on_publish(self, ev: Event) -> None:
        self.core.loads_in_flight -= 1
        if self._publishing is ev.future:
            self._publishing = None
        if self.abandoned.lost(ev):  # with the trainer's worker: the rebuilt trainer publishes
            logger.warning("weights %s lost before reaching the rollout shards", ev.future.key)
            return
        if ev.future.status != "finished":
            raise RuntimeError(f"{ev.future.key} failed: {ev.future.exception()!r}")
        for events, loads in self.shards.load_weights(ev.result):
            self.load(loads, events)
