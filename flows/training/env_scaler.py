"""The environment pool follows rollout demand (``cluster.adaptive_env``, embedded cluster).

Environment work is CPU work whose amount changes during a run (a task mix shifts to a slower
sandbox, a simulator's latency grows). :class:`EnvPoolScaler` measures the pool's busy share
(environment step seconds per second, over the pool's slots, in a sliding window) and asks the
pure rule :func:`flows.training.orchestration.env_pool_change` what to do:

- **grow**: a worker spec ``<pool>-<n>`` copied from the pool's first is added to the
  ``SpecCluster`` (the cluster's own ``scale`` starts it); it joins through the run's
  membership events and takes new trajectories at once (environments need no weights);
- **shrink**: the newest worker is *drained*: it gets no new trajectories, the ones whose
  environment instances live there run to their end, and only once none is left is its spec
  removed and the worker closed. No environment instance is lost in a shrink.

Dask's own ``Adaptive`` sizes a whole cluster from its total occupancy; here one pool is sized
from one kind of work, so the decision is ours and the workers come and go through
``SpecCluster``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from distributed import SpecCluster

from flows.config import AdaptiveEnvConfig
from flows.training.orchestration import env_pool_change
from resources.pools import Tag

logger = logging.getLogger(__name__)


class EnvPoolScaler:
    """Grows and drains one pool of a ``SpecCluster``.

    ``env_seconds()`` is the run's running total of environment step seconds; ``workers()`` the
    pool's serving workers (address -> slots); ``holds(address)`` whether live trajectories
    still have environment instances on a worker; ``stop_routing(address)`` takes a worker out
    of the pool_workers."""

    def __init__(self, cfg: AdaptiveEnvConfig, cluster: SpecCluster, pool: str,
                 env_seconds: Callable[[], float], workers: Callable[[], dict[str, float]],
                 holds: Callable[[str], bool], stop_routing: Callable[[str], None],
                 names: Callable[[str], str]):
        self.cfg, self.cluster, self.pool = cfg, cluster, pool
        self.env_seconds, self.workers, self.holds = env_seconds, workers, holds
        self.stop_routing, self.names = stop_routing, names
        self._samples: deque[tuple[float, float]] = deque()
        self._last_change = time.perf_counter()
        self._next = 1 + max(map(_index, self._specs()), default=0)
        self.draining: dict[str, str] = {}  # address -> spec name
        self.retired: set[str] = set()  # addresses closed by a shrink (not a loss)
        self.history: list[dict] = []  # every change: time, action, workers, busy share
        self.last_busy: float | None = None

    def busy(self, now: float) -> float | None:
        """Mean environment steps running over the pool's slots, in the window (None: not a
        full window yet)."""
        self._samples.append((now, self.env_seconds()))
        # keep the newest sample at least a window old: the window spans window_s or more
        while len(self._samples) > 1 and now - self._samples[1][0] >= self.cfg.window_s:
            self._samples.popleft()
        t0, s0 = self._samples[0]
        slots = sum(self.workers().values())
        if now - t0 < 0.8 * self.cfg.window_s or not slots:
            return None
        return (self._samples[-1][1] - s0) / (now - t0) / slots

    def step(self, now: float | None = None) -> None:
        """Called every watchdog tick by the run."""
        now = time.perf_counter() if now is None else now
        for address, name in list(self.draining.items()):
            if not self.holds(address):  # drained: its last instance is closed
                del self.draining[address]
                self.retired.add(address)
                self.cluster.worker_spec.pop(name, None)
                self.cluster.scale(len(self.cluster.worker_spec))
                self._note(now, "retired", name)
        busy = self.busy(now)
        if busy is not None:
            self.last_busy = busy
        if busy is None or now - self._last_change < self.cfg.cooldown_s:
            return
        c = self.cfg
        # workers asked for, started or not, and not draining
        workers = len(self._specs()) - len(self.draining)
        change = env_pool_change(busy, workers, len(self.draining), c.min_workers,
                                 c.max_workers, c.high, c.low)
        if change > 0:
            template = next(v for k, v in self.cluster.worker_spec.items()
                            if k.startswith(f"{self.pool}-"))
            name = f"{self.pool}-{self._next}"
            self._next += 1
            self.cluster.worker_spec[name] = template
            self.cluster.scale(len(self.cluster.worker_spec))
            self._note(now, "grow", name, busy)
        elif change < 0:
            serving = self.workers()
            if len(serving) < 2:  # the one left serving is never drained
                return
            address = max(serving, key=lambda a: _index(self.names(a)))  # the newest
            self.stop_routing(address)
            self.draining[address] = self.names(address)
            self._note(now, "drain", self.draining[address], busy)

    def _specs(self) -> list[str]:
        return [n for n in self.cluster.worker_spec if n.rsplit("-", 1)[0] == self.pool]

    def _note(self, now: float, action: str, name: str, busy: float | None = None) -> None:
        self._last_change = now
        self._samples.clear()  # the next decision sees the pool as it is now
        logger.warning("environment pool %s: %s %s (busy share %s)", self.pool, action, name,
                       "-" if busy is None else f"{busy:.2f}")
        self.history.append({"at": now, "action": action, "worker": name,
                             "busy": None if busy is None else round(busy, 3)})


def _index(name: str) -> int:
    """The number of a worker named ``<pool>-<n>``."""
    tail = name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def env_scaler_for(cfg, cluster, driver) -> EnvPoolScaler | None:
    """``cluster.adaptive_env`` of ``cfg`` on the embedded cluster (a
    :class:`resources.cluster.ClusterHandle`): the scaler of the environment pool that
    ``driver`` (a :class:`flows.training.rollout.RolloutDriver`) routes to."""
    c = cfg.cluster.adaptive_env
    if not c.enabled:
        return None
    if cluster.cluster is None:
        logger.warning("cluster.adaptive_env needs the embedded cluster: ignored")
        return None
    env_tag = str(Tag.CPU_ENV)
    pool = cluster.worker_pool[cluster.workers_with(Tag.CPU_ENV)[0]]
    pool_workers = driver.pool_workers

    def names(address: str) -> str:
        return str(cluster.client.scheduler_info(n_workers=-1)["workers"][address]["name"])

    def workers() -> dict[str, float]:
        return {w: cluster.worker_tags[w][env_tag] for w in pool_workers.workers_by_tag.get(env_tag, [])
                if cluster.worker_pool.get(w) == pool}

    return EnvPoolScaler(c, cluster.cluster, pool, lambda: driver.turns.env_seconds, workers,
                         driver.holds, pool_workers.remove, names)
