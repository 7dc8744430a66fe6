"""The clock of one emulated inference engine: continuous batching on a production GPU.

:class:`EmulatedEngine` stands for one engine of a pool's GPUs running a production model. It
computes nothing: the caller's real backend does. It decides how long the work *would* take and
makes the calling task wait that long, by sleeping (no core is burned):

- **continuous batching** (as vLLM's scheduler runs it): requests join and leave the running
  batch between engine steps; each step lasts what :class:`resources.device_model.DeviceModel`
  says for the batch it holds. Prefills are read in chunks of at most ``chunk_tokens`` per step
  beside the running decodes (a *mixed* step when both share the engine: colocation); a decode
  holds its slot for as many steps as its response is long.
- **KV memory** caps the batch: a request reserves its context's KV when it is admitted and
  frees it when it leaves; requests that do not fit wait in FIFO order.
- **KV held while a trajectory waits for its environment**: a request given ``hold=key`` leaves
  its KV (context and new tokens) on the engine under ``key`` when it finishes, counted against
  the KV capacity, until a later request with ``resume=key`` is admitted here (its reservation
  takes the held tokens over: only its new tokens need room), or ``release(key)`` (the
  trajectory ended, or its KV moved elsewhere and the last handle to it here was dropped). Held
  KV does not block admissions: when the FIFO head needs room, the KV held longest is evicted
  first (vLLM's prefix cache likewise reallocates its least recently used free blocks, its
  "Automatic Prefix Caching" design), and a request resuming evicted KV first recomputes it (a
  prefill of the evicted tokens, chunked like any other) before its own work. Memory pressure
  so costs recomputation, never a stall. :class:`resources.sim_engine.SimEngine` holds and
  evicts by the same rule.
- **pauses**: a weight load, or a train step of colocated training, holds the engine between
  two steps.

Every wait is the device-model time multiplied by ``time_scale``; :class:`EngineStats` keeps
unscaled (production) seconds. The ``emulated`` backend (:mod:`resources.emulated`) and a
dedicated reward-model engine (:mod:`resources.emulated_judge`) run on it.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

from resources.device_model import DeviceModel
from resources.kv_holds import KVHolds


@dataclass
class _Work:
    prefill: bool
    left: int  # prefill: tokens still to read; decode: tokens still to generate
    context: int  # prefill: tokens cached before its next chunk; decode: current context
    kv_tokens: int  # KV reserved while it runs
    hold: Hashable | None = None  # leave the KV held under this key when done
    resume: Hashable | None = None  # take over (or recompute) the KV held under this key
    then_decode: int = 0  # a decode recomputing evicted KV: tokens to generate after it
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
    kv_held_max: int = 0  # most tokens of KV held for waiting trajectories at once
    kv_resumed: int = 0  # requests that found their KV still held
    kv_evictions: int = 0
    kv_recomputed_tokens: int = 0  # evicted tokens read again by the requests resuming them


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
        self._kv = KVHolds()
        self._arrivals = 0  # requests and pauses asked for so far: an interruptible wait ends
        self._admitted_at = 0  # ... when one came after the last admission
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="rollarc-emulated", daemon=True)
        self._thread.start()

    # -- called from task threads ---------------------------------------------------------------
    def prefill(self, tokens: int, cached: int = 0, hold: Hashable | None = None,
                resume: Hashable | None = None) -> None:
        """Read ``tokens`` new tokens after ``cached`` ones; returns when the engine has.
        ``hold``/``resume``: the KV held while a trajectory waits (module docstring)."""
        if tokens > 0:
            self._submit(_Work(True, tokens, cached, cached + tokens, hold, resume))

    def decode(self, context: int, tokens: int, hold: Hashable | None = None,
               resume: Hashable | None = None) -> None:
        """Generate ``tokens`` tokens after a context of ``context``; returns when done."""
        if tokens > 0:
            self._submit(_Work(False, tokens, context, context + tokens, hold, resume))

    def release(self, key: Hashable) -> None:
        """Free the KV held under ``key`` (and forget that it was evicted); safe to repeat."""
        with self._cond:
            self._kv.release(key)

    @property
    def held_tokens(self) -> int:
        """Tokens of KV held now for trajectories between requests."""
        return self._kv.tokens

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
            if not self._kv.make_room(self._reserved, w.kv_tokens, w.resume, self.capacity):
                break  # FIFO: the head waits for running requests' memory, the rest behind it
            self._waiting.popleft()
            self._kv.resume(w)  # its held KV, or recompute what was evicted
            self._reserved += w.kv_tokens
            self._running.append(w)
        self.stats.max_running = max(self.stats.max_running, len(self._running))
        self._kv_stats()

    def _kv_stats(self) -> None:
        kv = self._kv
        self.stats.kv_held_max, self.stats.kv_resumed = kv.max_tokens, kv.resumed
        self.stats.kv_evictions, self.stats.kv_recomputed_tokens = (kv.evictions,
                                                                    kv.recomputed_tokens)

    def _finish(self, w: _Work) -> None:
        self._running.remove(w)
        self._reserved -= w.kv_tokens
        if w.hold is not None:  # the reservation stays, as the trajectory's held KV
            self._kv.keep(w.hold, w.kv_tokens)
            self._kv_stats()
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
                    if w.left <= 0 and w.then_decode:  # recomputed: now decode
                        w.prefill, w.left, w.then_decode = False, w.then_decode, 0
                    elif w.left <= 0:
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
