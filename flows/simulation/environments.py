"""The simulated environments: how many turns a trajectory takes and how long its
environment's reset and steps wait.

Environments do not run. Each env task's reset and step latencies are drawn from its
:class:`tasks.envs.latency.RemoteLatency` layers (``faults.env`` adds one) with their failure
rates, from the same per-episode streams, so the members of a group (one seed) wait alike; an
environment with no remote latency steps in ``simulate.local_env_step_s``. The number of turns
of a trajectory (what the policy and environment decide) is drawn from ``simulate.turns``, by
default the env's ``max_turns``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from flows.config import TrainConfig
from flows.config.derived import with_env_faults
from flows.simulation.settings import SimSettings, TurnCount
from tasks.envs.latency import Latency


def max_turns_of(spec: dict) -> int | None:
    """``max_turns`` of an env spec, looking through wrappers (``env: {...}``)."""
    while isinstance(spec, dict):
        if "max_turns" in spec:
            return int(spec["max_turns"])
        spec = spec.get("env")
    return None


def turn_counts(cfg: TrainConfig, sim: SimSettings) -> dict[str, TurnCount]:
    """Turns per trajectory by env task: ``simulate.turns``, else the env's ``max_turns``."""
    return {t.name: sim.turns.get(t.name) or TurnCount(
        mean=max_turns_of(t.env) or 1, max=max_turns_of(t.env) or 1000) for t in cfg.env_tasks}


@dataclass(frozen=True)
class EnvLatency:
    """A RemoteLatency-wrapped environment's latencies, drawn as it draws them: from a stream
    seeded by its seed and the episode's, so the members of a group (one seed) wait alike."""

    reset: Latency
    step: Latency
    seed: int
    failure_rate: float
    hang_rate: float

    def stream(self, episode_seed: int) -> random.Random:
        return random.Random(f"{self.seed}/{episode_seed}")

    def draw(self, step: bool, rng: random.Random) -> tuple[float, bool]:
        """(seconds, whether the call failed) of a step or a reset."""
        if step and self.hang_rate:
            rng.random()  # the hang draw (hangs are not simulated)
        seconds = (self.step if step else self.reset).sample(rng)
        return seconds, bool(self.failure_rate) and rng.random() < self.failure_rate


def latency_layers(spec: dict) -> list[EnvLatency]:
    """The RemoteLatency layers around an environment, outermost first; none for a local
    environment."""
    layers = []
    while isinstance(spec, dict) and str(spec.get("_component_", "")).endswith("RemoteLatency"):
        layers.append(EnvLatency(Latency.of(spec.get("reset_latency")),
                                 Latency.of(spec.get("step_latency")), int(spec.get("seed", 0)),
                                 float(spec.get("failure_rate", 0.0)),
                                 float(spec.get("hang_rate", 0.0))))
        spec = spec.get("env")
    return layers


def env_latencies(cfg: TrainConfig) -> dict[str, list[EnvLatency]]:
    """Each env task's latency layers, ``faults.env``'s wrapped around its own."""
    return {t.name: latency_layers(with_env_faults(cfg.faults, t.env)) for t in cfg.env_tasks}


def call_time(layers: list[EnvLatency], streams: list[random.Random], step: bool,
              local_s: float) -> tuple[float, bool]:
    """(seconds, whether it failed) of one reset or step through ``layers``: a failing layer
    raises after its latency, so the inner layers never run."""
    seconds = 0.0 if layers else local_s
    for lat, rng in zip(layers, streams, strict=True):
        s, failed = lat.draw(step, rng)
        seconds += s
        if failed:
            return seconds, True
    return seconds, False
