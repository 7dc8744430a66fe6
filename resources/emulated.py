"""The ``emulated`` inference backend: the tiny policy's real tokens on a production GPU's clock.

Each inference worker stands for one engine of its pool's GPUs (``PoolSpec.gpus`` devices of
the pool's profile) running a production model (``engine.device.model``). The real backend
underneath (``hf`` by default) still computes every token and log-prob, so learning is real;
:class:`EmulatedEngine` decides how long the work *would* take and makes the task wait that long,
by sleeping (no core is burned):

- **continuous batching** (as vLLM's scheduler runs it): requests join and leave the running
  batch between engine steps; each step lasts what :class:`resources.device_model.DeviceModel`
  says for the batch it holds. Prefills are read in chunks of at most ``chunk_tokens`` per step
  beside the running decodes (a *mixed* step when both share the engine: colocation); a decode
  holds its slot for as many steps as its response is long.
- **KV memory** caps the batch: a request reserves its context's KV when it is admitted and
  frees it when it leaves; requests that do not fit wait in FIFO order.
- **virtual lengths**: each turn carries a :class:`tasks.records.TurnShape` (the prompt tokens
  it reads, the response tokens it generates) drawn by the flows from the env task's workload;
  the real tokens stand for them. Without a shape the real lengths are used.
- KV hand-offs take their transfer time: the conversation's KV from the engine that decoded the
  last turn to the prefill engine, and the new tokens' KV from there to the decode engine (as
  the ``hf`` backend moves them); new weights pause the engine for a weight broadcast.

:class:`EmulatedTrainer` does the same for the trainer: the real step runs, then the step waits
the device-model time of a training step over the batch's virtual tokens; exporting weights
waits a broadcast.

``engine.time_scale`` multiplies every emulated wait (device time here, and in the flows
environment and reward latency), so a benchmark finishes in minutes with every ratio kept.
Emulated seconds reported in ``stats()`` are unscaled (production seconds).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from resources.catalog import HardwareProfile
from resources.device_model import DeviceModel, ModelName, model_spec
from tasks.records import DecodeOutput, SamplingParams, TrainBatch, TrainStats, TurnShape
from tasks.specs import PolicySpec

logger = logging.getLogger(__name__)


class DeviceEmulation(BaseModel):
    """How the emulated engines and trainer behave (``engine.device``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: ModelName = Field(default="dense-8b", description="Production model: a device-model "
                             "preset (dense-8b, dense-32b, moe-30b-a3b) or a Hugging Face "
                             "config.json")
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
class _Work:
    prefill: bool
    left: int  # prefill: tokens still to read; decode: tokens still to generate
    context: int  # prefill: tokens cached before its next chunk; decode: current context
    kv_tokens: int  # KV reserved while it runs
    done: threading.Event = field(default_factory=threading.Event)
    error: Exception | None = None


@dataclass
class EngineStats:
    """Unscaled (production) seconds and counts of one emulated engine."""

    busy_s: float = 0.0  # engine steps and weight loads
    prefill_steps: int = 0
    decode_steps: int = 0
    mixed_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    weight_loads: int = 0
    weight_load_s: float = 0.0
    training_s: float = 0.0  # held by colocated training (monolithic placement)
    kv_transfer_s: float = 0.0  # hand-offs received (they wait on the link, not the engine)
    max_running: int = 0
    max_waiting: int = 0


class EmulatedEngine:
    """Continuous batching on one engine of ``device``'s GPUs; waits are sleeps x ``time_scale``."""

    def __init__(self, device: DeviceModel, time_scale: float = 1.0, chunk_tokens: int = 8192,
                 max_seqs: int = 256):
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        if device.kv_capacity_tokens <= 0:
            raise ValueError(
                f"{device.model.name} ({device.model.weight_bytes / 1e9:.0f} GB of weights) does "
                f"not fit on {device.gpus} x {device.hw.name}: give the pool more gpus")
        self.device, self.time_scale = device, time_scale
        self.chunk_tokens, self.max_seqs = chunk_tokens, max_seqs
        self.capacity = device.kv_capacity_tokens
        self.stats = EngineStats()
        self._cond = threading.Condition()
        self._waiting: deque[_Work] = deque()
        self._running: list[_Work] = []
        self._pause_s = 0.0
        self._pause_done: list[threading.Event] = []
        self._reserved = 0
        self._arrivals = 0  # requests and pauses asked for so far: an interruptible wait ends
        self._admitted_at = 0  # ... when one came after the last admission
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="rollarc-emulated", daemon=True)
        self._thread.start()

    # -- called from task threads ---------------------------------------------------------------
    def prefill(self, tokens: int, cached: int = 0) -> None:
        """Read ``tokens`` new tokens after ``cached`` ones; returns when the engine has."""
        if tokens > 0:
            self._submit(_Work(True, tokens, cached, cached + tokens))

    def decode(self, context: int, tokens: int) -> None:
        """Generate ``tokens`` tokens after a context of ``context``; returns when done."""
        if tokens > 0:
            self._submit(_Work(False, tokens, context, context + tokens))

    def pause(self, seconds: float, training: bool = False) -> None:
        """Hold the engine for ``seconds`` (unscaled) between two steps: a weight load, or a
        train step of colocated training that time-shares these GPUs."""
        done = threading.Event()
        with self._cond:
            self._arrivals += 1
            self._pause_s += seconds
            self._pause_done.append(done)
            if training:
                self.stats.training_s += seconds
            else:
                self.stats.weight_loads += 1
                self.stats.weight_load_s += seconds
            self._cond.notify()
        done.wait()

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` of emulated time outside the engine (a transfer on the link)."""
        if seconds > 0:
            time.sleep(seconds * self.time_scale)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _submit(self, work: _Work) -> None:
        if work.kv_tokens > self.capacity:
            raise ValueError(f"a request of {work.kv_tokens} tokens' KV can never fit: the "
                             f"engine holds {self.capacity} tokens")
        with self._cond:
            self._arrivals += 1
            self._waiting.append(work)
            self.stats.max_waiting = max(self.stats.max_waiting, len(self._waiting))
            self._cond.notify()
        work.done.wait()
        if work.error is not None:
            raise work.error

    # -- engine thread ---------------------------------------------------------------------------
    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_seqs:
            w = self._waiting[0]
            if self._reserved + w.kv_tokens > self.capacity:
                break  # FIFO: the head waits for memory, the rest wait behind it
            self._waiting.popleft()
            self._reserved += w.kv_tokens
            self._running.append(w)
        self.stats.max_running = max(self.stats.max_running, len(self._running))

    def _finish(self, w: _Work) -> None:
        self._running.remove(w)
        self._reserved -= w.kv_tokens
        w.done.set()

    def _wait(self, seconds: float, interruptible: bool) -> float:
        """Sleep ``seconds`` of emulated time; an arrival cuts it short when interruptible.
        Returns the emulated seconds that passed."""
        start = time.perf_counter()
        real = seconds * self.time_scale
        with self._cond:
            if interruptible:
                seen = self._admitted_at  # arrivals after the last admission cut the wait
                self._cond.wait_for(lambda: self._arrivals != seen or self._closed,
                                    timeout=real)
            else:
                self._cond.wait_for(lambda: self._closed, timeout=real)
        return (time.perf_counter() - start) / self.time_scale

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    self._admit()
                    self._admitted_at = self._arrivals
                    if self._closed:
                        break
                    pause, self._pause_s = self._pause_s, 0.0
                    released, self._pause_done = self._pause_done, []
                    if not pause and not released and not self._running:
                        self._cond.wait()
                        continue
                if pause or released:
                    self._wait(pause, interruptible=False)
                    self.stats.busy_s += pause
                    for e in released:
                        e.set()
                    continue
                self._step()
        finally:
            with self._cond:
                for w in list(self._running) + list(self._waiting):
                    w.error = RuntimeError("emulated engine closed")
                    w.done.set()
                for e in self._pause_done:
                    e.set()

    def _step(self) -> None:
        """One engine step with prefill chunks, or a run of decode-only steps up to the next
        finish (cut at a step boundary when a request arrives)."""
        dev = self.device
        decodes = [w for w in self._running if not w.prefill]
        budget = self.chunk_tokens - len(decodes)
        chunks: list[tuple[_Work, int]] = []
        for w in self._running:
            if w.prefill and budget > 0:
                n = min(w.left, budget)
                chunks.append((w, n))
                budget -= n
        if chunks:
            dt = dev.mixed_step_time([(n, w.context) for w, n in chunks],
                                     [d.context for d in decodes])
            self._wait(dt, interruptible=False)
            self.stats.busy_s += dt
            if decodes:
                self.stats.mixed_steps += 1
            else:
                self.stats.prefill_steps += 1
            for w, n in chunks:
                w.left -= n
                w.context += n
                self.stats.prefill_tokens += n
            self._advance(decodes, 1)
            with self._cond:
                for w, _ in chunks:
                    if w.left <= 0:
                        self._finish(w)
            return
        # decode only: the batch holds until its shortest request ends or someone arrives
        k = min(d.left for d in decodes)
        dt = dev.decode_step_time([d.context + k // 2 for d in decodes])
        passed = self._wait(k * dt, interruptible=True)
        steps = min(k, max(1, math.ceil(passed / dt - 1e-9)))
        if steps * dt > passed:  # finish the step under way
            self._wait(steps * dt - passed, interruptible=False)
        self.stats.busy_s += steps * dt
        self.stats.decode_steps += steps
        self._advance(decodes, steps)

    def _advance(self, decodes: list[_Work], steps: int) -> None:
        for d in decodes:
            d.left -= steps
            d.context += steps
            self.stats.decode_tokens += steps
        with self._cond:
            for d in decodes:
                if d.left <= 0:
                    self._finish(d)


# -- the backend --------------------------------------------------------------------------------


@dataclass
class EmulatedCache:
    """The emulated backend's cache handle: the real backend's, plus the virtual context."""

    inner: Any
    virtual_tokens: int
    engine_id: str = ""  # the engine holding this KV (where the turn decoded)

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

    def __sizeof__(self) -> int:
        import sys

        return sys.getsizeof(self.inner) + 64


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
        if cache is not None and cache.engine_id != self.engine_id:
            # the conversation's KV comes from the engine that decoded the last turn
            seconds = self.engine.device.kv_transfer_time(cached)
            self.engine.stats.kv_transfer_s += seconds
            self.engine.sleep(seconds)
        self.engine.prefill(n, cached)
        return EmulatedPrefill(out, self.engine_id, n, cached + n, time.perf_counter() - t0)

    def decode(self, prefilled: EmulatedPrefill, cache: EmulatedCache | None,
               params: SamplingParams, seed: int, shape: TurnShape | None = None) -> DecodeOutput:
        t0 = time.perf_counter()
        if prefilled.engine_id != self.engine_id:  # the new tokens' KV crosses the network
            moved = prefilled.new_tokens
            if cache is not None and cache.engine_id != self.engine_id:
                moved = prefilled.context  # ... and the context's, from where it last decoded
            seconds = self.engine.device.kv_transfer_time(moved)
            self.engine.stats.kv_transfer_s += seconds
            self.engine.sleep(seconds)
        waited = time.perf_counter() - t0
        out = self.inner.decode(prefilled.inner, cache.inner if cache is not None else None,
                                params, seed, shape=shape)
        n = shape.response_tokens if shape is not None else len(out.sample.token_ids)
        t0 = time.perf_counter()
        self.engine.decode(prefilled.context, n)
        waited += time.perf_counter() - t0
        out.sample.virtual_tokens = prefilled.new_tokens + n
        out.sample.emulated_wait_s = prefilled.waited_s + waited
        return DecodeOutput(EmulatedCache(out.cache, prefilled.context + n, self.engine_id),
                            out.sample)

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


# -- the trainer --------------------------------------------------------------------------------


def sequence_lengths(samples) -> list[int]:
    """Each train sample's length on emulated devices (its real length without a shape)."""
    return [s.virtual_tokens or len(s.token_ids) for s in samples]


class EmulatedTrainer:
    """A :class:`tasks.trainer.Trainer` whose steps and weight exports take device-model time
    on the trainer pool's GPUs (real steps run first: the tokens and gradients are real)."""

    def __init__(self, inner, device: DeviceModel, time_scale: float = 1.0):
        self.inner, self.device, self.time_scale = inner, device, time_scale
        self.busy_s = 0.0  # unscaled seconds of emulated work

    @property
    def version(self) -> int:
        return self.inner.version

    def _spend(self, seconds: float) -> None:
        self.busy_s += seconds
        time.sleep(seconds * self.time_scale)

    def train_step(self, batch: TrainBatch) -> TrainStats:
        stats = self.inner.train_step(batch)
        seconds = self.device.train_step_time(sequence_lengths(batch.samples))
        self._spend(seconds)
        stats.seconds += seconds * self.time_scale
        return stats

    def export_weights(self):
        snapshot = self.inner.export_weights()
        self._spend(self.device.weight_broadcast_time())
        return snapshot

    def save_checkpoint(self, run_dir: str) -> str:
        return self.inner.save_checkpoint(run_dir)

    def load_checkpoint(self, path: str) -> int:
        return self.inner.load_checkpoint(path)


# -- a model-based reward's GPU time ------------------------------------------------------------


class JudgeEmulation(BaseModel):
    """A reward model's GPUs (``reward.judge``): with ``reward.backend: lambda`` each invocation
    runs on a serverless GPU instance of its own (elastic: as many as calls in flight); with
    ``local`` every call queues on one dedicated engine of ``gpus`` devices on the reward
    worker, whose utilisation is then measured."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: ModelName = Field(default="dense-8b", description="The reward model (device-model "
                             "preset or Hugging Face config.json)")
    profile: str = Field(default="H800", description="GPUs the reward model runs on")
    gpus: int = Field(default=1, ge=1, description="Devices per engine (serverless: per "
                      "instance; local: the dedicated pool)")


class JudgedRewardClient:
    """A :class:`tasks.scoring.RewardClient` whose calls also take a reward model's time: one
    prefill over the batch's virtual tokens, on a serverless instance of its own
    (``dedicated=False``) or on the one dedicated engine every call shares."""

    def __init__(self, inner, device: DeviceModel, time_scale: float, dedicated: bool):
        self.inner, self.device, self.time_scale = inner, device, time_scale
        self.engine = EmulatedEngine(device, time_scale) if dedicated else None
        self.billed_s = 0.0  # serverless GPU seconds (unscaled) paid for
        self.ledger = inner.ledger

    def check(self) -> None:
        self.inner.check()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.inner.close()

    def score(self, requests):
        batch = self.inner.score(requests)
        tokens = sum(r.virtual_tokens for r in requests)
        if self.engine is not None:
            self.engine.prefill(tokens)
        else:
            seconds = self.device.prefill_time(tokens)
            self.billed_s += seconds
            time.sleep(seconds * self.time_scale)
        return batch

    def stats(self) -> dict[str, Any]:
        if self.engine is not None:
            return {"dedicated_busy_s": self.engine.stats.busy_s,
                    "gpus": self.device.gpus, "profile": self.device.hw.name}
        return {"serverless_billed_s": self.billed_s, "gpus": self.device.gpus,
                "profile": self.device.hw.name}
