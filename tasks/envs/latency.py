"""Remote-sandbox latency: give any environment the step and reset latency of a remote service.

Agentic environments differ wildly in cost: a grid game steps in microseconds, a code sandbox or
a browser takes seconds, with a long tail. :class:`RemoteLatency` wraps any environment (by its
``_component_`` spec) and spends a latency drawn per call before the inner reset or step:

- ``{"kind": "constant", "seconds": s}``;
- ``{"kind": "lognormal", "median_s": m, "sigma": s}``;
- ``{"kind": "normal", "mean_s": m, "std_s": s}``, clipped at zero (arXiv 2512.22560 Sec. 7
  injects per-turn environment latency of mean 10 s and a standard deviation of 1 s to 10 s);
- ``{"kind": "heavy_tail", "p50_s": m, "p99_over_p50": r}``: a mixture of a narrow body around
  ``m`` and a 2 % tail around ``r * m`` (so the 99th percentile sits at about ``r * m``), the
  shape of sandboxes that mostly answer fast and now and then stall.

The latency waits (``time.sleep``: a remote call holds no core) unless ``cpu_work`` is set, for
environments whose cost is local computation; ``time_scale`` (the run's ``engine.time_scale``,
given by the worker) shrinks every wait by one factor. ``failure_rate`` makes a call raise
:class:`RemoteEnvError` (a sandbox that crashed or timed out); the flow retries the trajectory
from a fresh environment and records a drop with the reason when attempts run out.
``hang_rate`` makes a step stop answering for ``hang_s`` (unscaled: a hang is not emulated
time), for the run's turn watchdog (``rollout.turn_timeout_s``) to notice.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Any

from tasks.components import check_component, instantiate

TAIL_PROBABILITY = 0.02
_BODY_SIGMA = 0.25


class RemoteEnvError(RuntimeError):
    """An injected failure of a remote environment."""


@dataclass(frozen=True)
class Latency:
    """A latency distribution (see the module docstring for the kinds)."""

    kind: str = "constant"
    seconds: float = 0.0
    median_s: float = 0.0
    sigma: float = 0.5
    p50_s: float = 0.0
    p99_over_p50: float = 10.0
    mean_s: float = 0.0
    std_s: float = 0.0

    @classmethod
    def of(cls, spec: dict[str, Any] | float | None) -> Latency:
        if spec is None:
            return cls()
        if isinstance(spec, int | float):
            return cls(seconds=float(spec))
        lat = cls(**spec)
        if lat.kind not in ("constant", "lognormal", "heavy_tail", "normal"):
            raise ValueError(f"latency kind must be constant, lognormal, heavy_tail or normal, "
                             f"got {lat.kind!r}")
        if min(lat.seconds, lat.median_s, lat.p50_s, lat.sigma, lat.mean_s,
               lat.std_s) < 0 or lat.p99_over_p50 < 1:
            raise ValueError("latencies and sigma must be >= 0 and p99_over_p50 >= 1")
        return lat

    def sample(self, rng: random.Random) -> float:
        if self.kind == "constant":
            return self.seconds
        if self.kind == "lognormal":
            return self.median_s * math.exp(rng.gauss(0.0, self.sigma)) if self.median_s else 0.0
        if self.kind == "normal":
            return max(0.0, rng.gauss(self.mean_s, self.std_s))
        # heavy_tail: the body holds 98 % of calls, so the 99th percentile is the tail's median
        center = self.p50_s * (self.p99_over_p50 if rng.random() < TAIL_PROBABILITY else 1.0)
        return center * math.exp(rng.gauss(0.0, _BODY_SIGMA))


def spend(seconds: float, cpu_work: bool) -> None:
    """Wait ``seconds`` (a remote call) or burn them on this core (local computation)."""
    if seconds <= 0:
        return
    if not cpu_work:
        time.sleep(seconds)
        return
    deadline = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < deadline:
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF


class RemoteLatency:
    """Any environment, with remote-service latency and failures (see module docstring)."""

    @staticmethod
    def check_config(env: dict[str, Any], step_latency: dict | float | None = None,
                     reset_latency: dict | float | None = None, failure_rate: float = 0.0,
                     hang_rate: float = 0.0, hang_s: float = 600.0, **_) -> None:
        """Argument checks, the wrapped environment's included, without building anything."""
        if not 0.0 <= failure_rate < 1.0:
            raise ValueError("failure_rate must be in [0, 1)")
        if not 0.0 <= hang_rate < 1.0 or hang_s < 0:
            raise ValueError("hang_rate must be in [0, 1) and hang_s >= 0")
        Latency.of(step_latency), Latency.of(reset_latency)
        try:
            check_component(env)
        except Exception as exc:
            raise ValueError(f"env: {type(exc).__name__}: {exc}") from None

    def __init__(self, env: dict[str, Any], step_latency: dict | float | None = None,
                 reset_latency: dict | float | None = None, failure_rate: float = 0.0,
                 cpu_work: bool = False, seed: int = 0, time_scale: float = 1.0,
                 hang_rate: float = 0.0, hang_s: float = 600.0):
        self.check_config(env, step_latency, reset_latency, failure_rate, hang_rate, hang_s)
        self.hang_rate, self.hang_s = hang_rate, hang_s
        self.inner = instantiate(env)
        self.step_latency, self.reset_latency = Latency.of(step_latency), Latency.of(reset_latency)
        self.failure_rate, self.cpu_work, self.seed = failure_rate, cpu_work, seed
        self.time_scale = time_scale  # engine.time_scale: latencies are stated unscaled
        self.max_turns = self.inner.max_turns
        self._rng = random.Random(seed)

    def _call(self, latency: Latency, what: str) -> float:
        seconds = latency.sample(self._rng)
        spend(seconds * self.time_scale, self.cpu_work)
        if self.failure_rate and self._rng.random() < self.failure_rate:
            raise RemoteEnvError(f"remote environment failed during {what} (injected, "
                                 f"failure_rate={self.failure_rate})")
        return seconds

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        # latency draws depend on the episode's seed, so a rerun of a seed sees the same delays
        self._rng = random.Random(f"{self.seed}/{seed}")
        waited = self._call(self.reset_latency, "reset")
        obs, info = self.inner.reset(seed=seed)
        return obs, dict(info, remote_latency_s=waited)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.hang_rate and self._rng.random() < self.hang_rate:
            time.sleep(self.hang_s)  # stops answering; the turn watchdog gives up on it
        waited = self._call(self.step_latency, "step")
        obs, reward, terminated, truncated, info = self.inner.step(action)
        return obs, reward, terminated, truncated, dict(info, remote_latency_s=waited)

    def close(self) -> None:
        self.inner.close()
