"""env_reset / env_step / env_close: environment work on a CPU_ENV worker.

Instances live in that worker's registry; the trajectory's later steps are pinned to it, so an
environment's state is never rebuilt by replaying seeds and past actions.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from tasks.components import COMPONENT, accepts, instantiate, resolve
from tasks.policy import encode_first_turn, encode_next_turn
from tasks.records import EnvHandle, EnvObservation, TurnSample


class EnvRegistry:
    """Environment instances of one worker, by id, with a live-instance count."""

    def __init__(self, address: str, time_scale: float = 1.0):
        self.address = address
        # environments that emulate remote latency (they take a time_scale) wait this much less
        self.time_scale = time_scale
        self._envs: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.created = 0
        self.closed = 0

    def create(self, spec: dict, instance_id: str) -> Any:
        scaled = (self.time_scale != 1.0 and "time_scale" not in spec
                  and accepts(resolve(spec[COMPONENT]), "time_scale"))
        env = instantiate(spec, **({"time_scale": self.time_scale} if scaled else {}))
        with self._lock:
            if instance_id in self._envs:
                raise KeyError(f"environment {instance_id} already exists on {self.address}")
            self._envs[instance_id] = env
            self.created += 1
        return env

    def get(self, instance_id: str) -> Any:
        try:
            return self._envs[instance_id]
        except KeyError:
            raise KeyError(f"environment {instance_id} is not live on {self.address}") from None

    def close(self, instance_id: str) -> bool:
        with self._lock:
            env = self._envs.pop(instance_id, None)
            if env is not None:
                self.closed += 1
        if env is None:
            return False
        env.close()
        return True

    @property
    def live(self) -> int:
        return len(self._envs)


def env_reset(registry, tokenizer, env_spec: dict, seed: int, instance_id: str,
              system_prompt: str | None = None) -> EnvObservation:
    """Create the instance under the id the driver chose (so the driver can close it even if
    this result never reaches it) and reset it."""
    t0 = time.perf_counter()
    env = registry.create(env_spec, instance_id)
    text, info = env.reset(seed=seed)
    return EnvObservation(
        handle=EnvHandle(registry.address, instance_id), text=text,
        input_ids=encode_first_turn(tokenizer, text, system_prompt), info=dict(info),
        step_seconds=time.perf_counter() - t0,
    )


def env_step(registry, tokenizer, prev: EnvObservation, sample: TurnSample) -> EnvObservation:
    """Apply the policy's response to the instance ``prev`` came from; close it when the episode
    ends. The result carries ``prev.input_ids`` back as ``consumed_ids`` so the driver can write the
    trajectory's tokens in order without fetching earlier results."""
    t0 = time.perf_counter()
    handle = prev.handle
    env = registry.get(handle.instance_id)
    text, reward, terminated, truncated, info = env.step(sample.text)
    done = terminated or truncated
    if done:
        registry.close(handle.instance_id)
        input_ids: list[int] = []
    else:
        input_ids = encode_next_turn(tokenizer, text, sample.token_ids)
    return EnvObservation(
        handle=handle, text=text, input_ids=input_ids, reward=float(reward),
        terminated=bool(terminated), truncated=bool(truncated), info=dict(info), sample=sample,
        consumed_ids=list(prev.input_ids), step_seconds=time.perf_counter() - t0,
    )


def env_close(registry, handle: EnvHandle) -> bool:
    """Close an instance whose trajectory was dropped; True if it was still open."""
    return registry.close(handle.instance_id)
