"""env_reset / env_step / env_close: environment work on a CPU_ENV worker.

Instances live in that worker's registry; the trajectory's later steps are pinned to it, so an
environment's state is never rebuilt by replaying seeds and past actions.

Nor is it replayed by Dask. When a worker is lost, Dask recomputes every result that lived there
and is still wanted, and for that runs again the tasks it came from whose results were released,
on the workers still there, pinned ones included (the scheduler's lineage recomputation). A
decode's result lost with its worker thus re-runs the env_reset and env_step of its turn on the
environment's worker: the reset would create again an instance already closed (one nothing will
close), the step would apply an action a second time. The registry refuses both
(:class:`ReplayedEnvWork`): an instance id is created once, and each step names the step it is.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from tasks.components import COMPONENT, accepts, instantiate, resolve
from tasks.policy import encode_first_turn, encode_next_turn
from tasks.records import EnvHandle, EnvObservation, TurnSample


class ReplayedEnvWork(RuntimeError):
    """An env_reset or env_step run a second time (see the module docstring)."""


class EnvRegistry:
    """Environment instances of one worker, by id, with a live-instance count, the number of
    steps applied to each, and the ids of every instance created (a reset run again must not
    revive a closed one)."""

    def __init__(self, address: str, time_scale: float = 1.0):
        self.address = address
        # environments that emulate remote latency (they take a time_scale) wait this much less
        self.time_scale = time_scale
        self._envs: dict[str, Any] = {}
        self._steps: dict[str, int] = {}  # steps applied to each live instance
        self._created_ids: set[str] = set()  # every instance's, closed ones too (~100 B each)
        self._lock = threading.Lock()
        self.created = 0
        self.closed = 0
        self.replays_refused = 0

    def create(self, spec: dict, instance_id: str) -> Any:
        """A new instance under ``instance_id``, which the driver never gives twice: one
        created before (live or closed) means the reset was run again, and is refused."""
        with self._lock:
            if instance_id in self._created_ids:
                self.replays_refused += 1
                raise ReplayedEnvWork(f"environment {instance_id} was created on {self.address}"
                                      f" before: its reset was run again (a lost result "
                                      f"recomputed); not created twice")
            self._created_ids.add(instance_id)
        scaled = (self.time_scale != 1.0 and "time_scale" not in spec
                  and accepts(resolve(spec[COMPONENT]), "time_scale"))
        env = instantiate(spec, **({"time_scale": self.time_scale} if scaled else {}))
        with self._lock:
            self._envs[instance_id] = env
            self._steps[instance_id] = 0
            self.created += 1
        return env

    def step(self, instance_id: str, index: int) -> Any:
        """The instance, to apply its step ``index`` (0: the first after the reset): a step
        already applied (a recomputation) is refused."""
        with self._lock:
            env = self.get(instance_id)
            done = self._steps[instance_id]
            if done != index:
                self.replays_refused += 1
                raise ReplayedEnvWork(f"environment {instance_id} on {self.address} is past "
                                      f"step {index} ({done} applied): its step was run again "
                                      f"(a lost result recomputed); not applied twice")
            self._steps[instance_id] = done + 1
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
                del self._steps[instance_id]
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
    env = registry.step(handle.instance_id, prev.env_steps)
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
        env_steps=prev.env_steps + 1,
    )


def env_close(registry, handle: EnvHandle) -> bool:
    """Close an instance whose trajectory was dropped; True if it was still open."""
    return registry.close(handle.instance_id)
