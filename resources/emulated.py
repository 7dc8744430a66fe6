"""The ``emulated`` inference backend: the tiny policy's real tokens on a production GPU's clock.

Each inference worker stands for one engine of its pool's GPUs (``PoolSpec.gpus`` devices of
the pool's profile) running a production model (``engine.device.model``). The real backend
underneath (``hf`` by default) still computes every token and log-prob, so learning is real;
an :class:`resources.emulated_engine.EmulatedEngine` decides how long the work *would* take
(continuous batching under KV memory) and makes the task wait that long, by sleeping:

- **virtual lengths**: each turn carries a :class:`tasks.records.TurnShape` (the prompt tokens
  it reads, the response tokens it generates) drawn by the flows from the env task's workload;
  the real tokens stand for them. Without a shape the real lengths are used.
- KV hand-offs take their transfer time, at the narrower end's bandwidth (each handle carries
  the :class:`resources.device_model.Link` of the engine holding its KV): the conversation's KV
  from the engine that decoded the last turn to the prefill engine, and the new tokens' KV from
  there to the decode engine (as the ``hf`` backend moves them); new weights pause the engine
  for a weight broadcast.
- **KV held while the trajectory waits for its environment**: a decode leaves the conversation's
  KV held on its engine (:class:`resources.emulated_engine.EmulatedEngine`, counted against the
  KV capacity, evicted oldest first under memory pressure and then recomputed) under a key its
  :class:`EmulatedCache` names; the next turn's request on that engine resumes it, and the hold
  is released when the last handle to it on that worker is dropped (the trajectory ended, or
  its KV moved on and Dask released the copy there).

:class:`DeviceEmulation` (``engine.device``) configures the engines and, through
:func:`device_of`, the emulated trainer (:mod:`resources.emulated_trainer`) too; the emulated
reward model is :mod:`resources.emulated_judge`.

``engine.time_scale`` multiplies every emulated wait (device time here, and in the flows
environment and reward latency), so a benchmark finishes in minutes with every ratio kept.
Emulated seconds reported in ``stats()`` are unscaled (production seconds).
"""

from __future__ import annotations

import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from resources.catalog import HardwareProfile
from resources.device_model import DeviceModel, Link, ModelName, model_spec
from resources.emulated_engine import EmulatedEngine
from tasks.records import DecodeOutput, SamplingParams, TurnShape
from tasks.specs import PolicySpec


class DeviceEmulation(BaseModel):
    """How the emulated engines and trainer behave (``engine.device``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: ModelName = Field(default="dense-8b", description="Production model: a device-model "
                             "preset (dense-8b, dense-32b, moe-30b-a3b, moe-235b-a22b) or a "
                             "Hugging Face config.json")
    mfu: float = Field(default=0.5, gt=0, le=1, description="Fraction of peak FLOP/s reached")
    mbu: float = Field(default=0.8, gt=0, le=1, description="Fraction of peak bandwidth reached")
    memory_utilization: float = Field(default=0.9, gt=0, le=1,
                                      description="Share of device memory for weights and KV")
    chunk_tokens: int = Field(default=8192, ge=64, description="Tokens one engine step reads at "
                              "most (prefill chunks plus one per decode; vLLM's "
                              "max_num_batched_tokens)")
    max_seqs: int = Field(default=256, ge=1, description="Sequences one engine runs at once at "
                          "most (vLLM's max_num_seqs)")


@dataclass
class EmulatedCache:
    """The emulated backend's cache handle: the real backend's, plus the virtual context."""

    inner: Any
    virtual_tokens: int
    engine_id: str = ""  # the engine holding this KV (where the turn decoded)
    kv_key: str = ""  # the key its KV is held under on that engine
    link: Link | None = None  # that engine's end of a KV transfer

    def __sizeof__(self) -> int:
        import sys

        return sys.getsizeof(self.inner) + 64


@dataclass
class EmulatedPrefill:
    """What prefill hands decode: the real prefill's output, where it ran and what it read."""

    inner: Any
    engine_id: str
    new_tokens: int  # virtual tokens read: their KV moves if decode runs elsewhere
    context: int  # virtual context after the prefill
    waited_s: float = 0.0  # real seconds the prefill waited on the emulated engine
    link: Link | None = None  # the prefill engine's end of a KV transfer
    transfer_s: float = 0.0  # of waited_s: the conversation's KV received first

    def __sizeof__(self) -> int:
        import sys

        return sys.getsizeof(self.inner) + 64


def _held_key(cache: EmulatedCache | None) -> str | None:
    return cache.kv_key or None if cache is not None else None


class EmulatedBackend:
    """An :class:`tasks.inference.InferenceBackend` whose work takes production-GPU time."""

    def __init__(self, inner, engine: EmulatedEngine, engine_id: str):
        self.inner, self.engine, self.engine_id = inner, engine, engine_id

    @property
    def version(self) -> int:
        return self.inner.version

    def prefill(self, cache: EmulatedCache | None, new_ids: list[int],
                shape: TurnShape | None = None) -> EmulatedPrefill:
        out = self.inner.prefill(cache.inner if cache is not None else None, new_ids,
                                 shape=shape)
        cached = cache.virtual_tokens if cache is not None else 0
        n = shape.prompt_tokens if shape is not None else len(new_ids)
        t0 = time.perf_counter()
        received = 0.0
        if cache is not None and cache.engine_id != self.engine_id:
            # the conversation's KV comes from the engine that decoded the last turn
            self._receive(cached, cache.link)
            received = time.perf_counter() - t0
        self.engine.prefill(n, cached, resume=_held_key(cache))
        return EmulatedPrefill(out, self.engine_id, n, cached + n, time.perf_counter() - t0,
                               self.engine.device.link(), received)

    def _receive(self, tokens: int, sender: Link | None) -> None:
        """Wait for ``tokens`` tokens' KV from ``sender``, at the narrower end's bandwidth."""
        seconds = self.engine.device.kv_transfer_time(tokens, peer=sender)
        self.engine.stats.kv_transfer_s += seconds
        self.engine.sleep(seconds)

    def decode(self, prefilled: EmulatedPrefill, cache: EmulatedCache | None,
               params: SamplingParams, seed: int, shape: TurnShape | None = None) -> DecodeOutput:
        t0 = time.perf_counter()
        received = 0.0
        if prefilled.engine_id != self.engine_id:  # the new tokens' KV crosses the network
            moved = prefilled.new_tokens
            if cache is not None and cache.engine_id != self.engine_id:
                moved = prefilled.context  # ... and the context's: this engine has none of it
            self._receive(moved, prefilled.link)
            received = time.perf_counter() - t0
        waited = time.perf_counter() - t0
        out = self.inner.decode(prefilled.inner, cache.inner if cache is not None else None,
                                params, seed, shape=shape)
        n = shape.response_tokens if shape is not None else len(out.sample.token_ids)
        t0 = time.perf_counter()
        key = uuid.uuid4().hex
        self.engine.decode(prefilled.context, n, hold=key, resume=_held_key(cache))
        waited += time.perf_counter() - t0
        out.sample.virtual_tokens = prefilled.new_tokens + n
        out.sample.virtual_response_tokens = n
        out.sample.emulated_wait_s = prefilled.waited_s + waited
        out.sample.prefill_wait_s = prefilled.waited_s - prefilled.transfer_s
        out.sample.kv_transfer_s = prefilled.transfer_s + received
        handle = EmulatedCache(out.cache, prefilled.context + n, self.engine_id, key,
                               self.engine.device.link())
        # the held KV lives as long as this handle on this worker (a copy Dask moves elsewhere
        # is another object, without this finalizer)
        weakref.finalize(handle, self.engine.release, key).atexit = False
        return DecodeOutput(handle, out.sample)

    def load_weights(self, snapshot) -> int:
        version = self.inner.load_weights(snapshot)
        self.engine.pause(self.engine.device.weight_broadcast_time())
        return version

    def stats(self) -> dict[str, Any]:
        return dict(self.inner.stats(), emulated=dict(self.engine.stats.__dict__),
                    profile=self.engine.device.hw.name, gpus=self.engine.device.gpus,
                    kv_capacity_tokens=self.engine.capacity, time_scale=self.engine.time_scale)

    def close(self) -> None:
        self.engine.close()
        self.inner.close()


def yield_to_training(backend: EmulatedBackend, seconds: float) -> float:
    """Colocated training (monolithic placement) time-shares the engine's GPUs: the engine
    serves nothing for the train step's ``seconds`` (unscaled)."""
    backend.engine.pause(seconds, training=True)
    return seconds


def device_of(hardware: HardwareProfile, gpus: int, device: DeviceEmulation) -> DeviceModel:
    return DeviceModel(model_spec(device.model), hardware, gpus, device.mfu, device.mbu,
                       device.memory_utilization)


def emulated_backend(policy: PolicySpec, max_batch: int, hardware: HardwareProfile,
                     gpus: int = 1, device: DeviceEmulation | dict | None = None,
                     time_scale: float = 1.0, engine_id: str = "engine",
                     inner: dict | None = None) -> EmulatedBackend:
    """Build the ``emulated`` backend on an inference worker: ``inner`` (a component spec, the
    ``hf`` backend by default) computes the tokens on a :class:`EmulatedEngine` of ``gpus`` x
    ``hardware`` running ``device.model``. The worker plugin passes ``hardware``, ``gpus``,
    ``device``, ``time_scale`` and ``engine_id`` from the pool and ``engine`` config."""
    from tasks.components import instantiate

    dev = device if isinstance(device, DeviceEmulation) else DeviceEmulation(**(device or {}))
    real = instantiate(inner or {"_component_": "resources.engine.hf_backend"}, policy=policy,
                       max_batch=max_batch)
    engine = EmulatedEngine(device_of(hardware, gpus, dev), time_scale, dev.chunk_tokens,
                            dev.max_seqs)
    return EmulatedBackend(real, engine, engine_id)


def sequence_lengths(samples) -> list[int]:
    """Each train sample's length on emulated devices (its real length without a shape)."""
    return [s.virtual_tokens or len(s.token_ids) for s in samples]


def loss_tokens(samples) -> int:
    """The positions the loss reads in these train samples on emulated devices: their
    responses' tokens (the real loss mask's without a shape)."""
    return sum(s.virtual_response_tokens if s.virtual_tokens else int(s.loss_mask.sum())
               for s in samples)


def train_step_seconds(device: DeviceModel, samples, ppo_epochs: int = 1,
                       minibatches: int = 1) -> float:
    """The device time of a train step over these samples
    (:meth:`DeviceModel.train_step_time` over their emulated lengths and loss positions)."""
    return device.train_step_time(sequence_lengths(samples), ppo_epochs, minibatches,
                                  loss_tokens(samples))
