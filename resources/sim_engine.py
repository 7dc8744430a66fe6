"""The simulator's clock and devices: a discrete-event loop, FIFO servers, resource slots, and
an engine running continuous batching on the device model.

:class:`SimEngine` batches the way :class:`resources.emulated.EmulatedEngine` does (FIFO
admission under KV memory and ``max_seqs``, prefill chunks of ``chunk_tokens`` beside the running
decodes as mixed steps, decode-only runs up to the next finish, cut at a step boundary by an
arrival, weight loads and colocated training as pauses between steps), with step times from
:class:`resources.device_model.DeviceModel`; instead of sleeping it schedules its step ends on a
:class:`Clock`. :mod:`flows.simulation.simulator` drives these with the flow's decisions.

KV memory while a trajectory waits for its environment is **held**, by the emulated engine's
rule: a request submitted with ``hold=key`` leaves its KV on the engine under ``key`` when it
finishes, counted against the KV capacity, until a request with ``resume=key`` is admitted here
(it takes the held tokens over) or ``release(key)``; when the FIFO head needs room the KV held
longest is evicted first, and a request resuming evicted KV recomputes it (a prefill of the
evicted tokens) before its own work.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from resources.device_model import DeviceModel
from resources.kv_holds import KVHolds


class Clock:
    """A heap of callbacks on a virtual clock; ties run in insertion order."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list = []
        self._seq = 0
        self.events = 0

    def at(self, t: float, fn, *args) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, args))

    def after(self, dt: float, fn, *args) -> None:
        self.at(self.now + dt, fn, *args)

    def run(self, until: float, stop) -> None:
        heap = self._heap
        while heap and not stop():
            t, _, fn, args = heapq.heappop(heap)
            if t > until:
                heapq.heappush(heap, (t, 0, fn, args))
                self.now = until
                return
            self.now = t
            self.events += 1
            fn(*args)


class Queue:
    """A FIFO server of fixed service time (a scheduler or a driver): the delay a job waits."""

    def __init__(self, clock: Clock, service_s: float):
        self.clock, self.service_s = clock, service_s
        self.free_at = 0.0
        self.busy_s = 0.0
        self.jobs = 0

    def delay(self, jobs: int = 1) -> float:
        """Serve ``jobs`` arriving now; seconds until the last is done."""
        if not self.service_s:
            return 0.0
        start = max(self.clock.now, self.free_at)
        self.free_at = start + jobs * self.service_s
        self.busy_s += jobs * self.service_s
        self.jobs += jobs
        return self.free_at - self.clock.now


class Slots:
    """A worker's resource slots (Dask's resource totals): tasks beyond them wait, FIFO."""

    def __init__(self, n: int):
        self.free = n
        self.waiting: deque = deque()

    def acquire(self, fn, *args) -> None:
        if self.free > 0:
            self.free -= 1
            fn(*args)
        else:
            self.waiting.append((fn, args))

    def release(self) -> None:
        if self.waiting:
            fn, args = self.waiting.popleft()
            fn(*args)
        else:
            self.free += 1


# -- an engine ------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Req:
    prefill: bool
    left: int  # prefill: tokens to read; decode: tokens to generate
    context: int
    kv: int
    done: Any  # callback
    finish_step: int = 0  # decode: the engine's decode-step count at which it ends
    hold: Hashable | None = None  # leave the KV held under this key when done
    resume: Hashable | None = None  # take over (or recompute) the KV held under this key
    then_decode: int = 0  # a decode recomputing evicted KV: tokens to generate after it


class SimEngine:
    """Continuous batching on one engine, as :class:`resources.emulated.EmulatedEngine` runs
    it, with the running decodes kept as a count and a context sum so an event costs O(log n).
    """

    def __init__(self, clock: Clock, name: str, device: DeviceModel, chunk_tokens: int,
                 max_seqs: int, slowdown: float = 1.0):
        if device.kv_capacity_tokens <= 0:
            raise ValueError(f"{device.model.name} does not fit on {device.gpus} x "
                             f"{device.hw.name}: give the pool more gpus")
        self.clock, self.name, self.device = clock, name, device
        self.chunk_tokens, self.max_seqs, self.slowdown = chunk_tokens, max_seqs, slowdown
        self.capacity = device.kv_capacity_tokens
        self.version = 0
        self.waiting: deque[_Req] = deque()
        self.prefills: list[_Req] = []
        self.decodes: list[tuple[int, int, _Req]] = []  # heap of (finish step, seq, req)
        self._seq = 0
        self.n_dec = 0
        self.ctx_base = 0  # sum over decodes of (context at admission - step at admission)
        self.step = 0  # decode steps run so far (every running decode advances together)
        self.reserved = 0
        self.kv = KVHolds()  # KV held for trajectories waiting for their environments
        self.pauses: list[tuple[float, Any]] = []
        self.busy_s = 0.0
        self.training_s = 0.0
        self._gen = 0  # the scheduled end of the current run; a newer one supersedes it
        self._run: tuple | None = None  # decode-only run: (t0, dt, k)
        self._stepping = False

    # -- callers -----------------------------------------------------------------------------
    def submit(self, prefill: bool, tokens: int, context: int, done,
               hold: Hashable | None = None, resume: Hashable | None = None) -> None:
        """A prefill of ``tokens`` after ``context`` cached, or a decode of ``tokens`` after a
        context of ``context``; ``done()`` when it ends. ``hold``/``resume``: the KV held while
        a trajectory waits (module docstring)."""
        if tokens <= 0:
            done()
            return
        kv = context + tokens
        if kv > self.capacity:
            raise ValueError(f"a request of {kv} tokens' KV never fits on {self.name}")
        self.waiting.append(_Req(prefill, tokens, context, kv, done, hold=hold, resume=resume))
        self._arrival()

    def release(self, key: Hashable) -> None:
        """Free the KV held under ``key`` (and forget that it was evicted); safe to repeat."""
        self.kv.release(key)

    def pause(self, seconds: float, done=None, training: bool = False) -> None:
        self.pauses.append((seconds, done))
        if training:
            self.training_s += seconds
        self._arrival()

    # -- the engine ---------------------------------------------------------------------------
    def _arrival(self) -> None:
        if not self._stepping:
            self._plan()
        elif self._run is not None:  # cut the decode-only run at the next step boundary
            t0, dt, k = self._run
            steps = min(k, max(1, math.ceil((self.clock.now - t0) / dt - 1e-9)))
            if steps < k:
                self._schedule(t0 + steps * dt, self._end_decode_run, steps, dt)
                self._run = (t0, dt, steps)

    def _schedule(self, t: float, fn, *args) -> None:
        self._gen += 1
        self.clock.at(t, self._fire, self._gen, fn, args)

    def _fire(self, gen: int, fn, args) -> None:
        if gen == self._gen:
            fn(*args)

    def _admit(self) -> None:
        while self.waiting and len(self.prefills) + self.n_dec < self.max_seqs:
            r = self.waiting[0]
            if not self.kv.make_room(self.reserved, r.kv, r.resume, self.capacity):
                break  # FIFO: the head waits for running requests' memory
            self.waiting.popleft()
            self.kv.resume(r)  # its held KV, or recompute what was evicted
            self.reserved += r.kv
            if r.prefill:
                self.prefills.append(r)
            else:
                self._add_decode(r)

    def _keep(self, r: _Req) -> None:
        """A finished request's reservation stays as its trajectory's held KV."""
        self.kv.keep(r.hold, r.kv)

    def _add_decode(self, r: _Req) -> None:
        r.finish_step = self.step + r.left
        self._seq += 1
        heapq.heappush(self.decodes, (r.finish_step, self._seq, r))
        self.n_dec += 1
        self.ctx_base += r.context - self.step

    def _plan(self) -> None:
        self._admit()
        self._run = None
        if self.pauses:
            total = sum(s for s, _ in self.pauses)
            released, self.pauses = self.pauses, []
            self._stepping = True
            self.busy_s += total
            self._schedule(self.clock.now + total * self.slowdown, self._end_pause, released)
            return
        if self.prefills:
            budget = self.chunk_tokens - self.n_dec
            chunks = []
            for r in self.prefills:
                if budget <= 0:
                    break
                n = min(r.left, budget)
                chunks.append((r, n))
                budget -= n
            ctx = self.ctx_base + self.n_dec * self.step
            dt = self.device.mixed_batch_time([(n, r.context) for r, n in chunks], self.n_dec,
                                              ctx)
            self._stepping = True
            self.busy_s += dt
            self._schedule(self.clock.now + dt * self.slowdown, self._end_mixed, chunks)
            return
        if self.n_dec:
            k = self.decodes[0][0] - self.step
            mid = self.ctx_base + self.n_dec * (self.step + k // 2)
            dt = self.device.decode_batch_time(self.n_dec, mid) * self.slowdown
            self._stepping = True
            self._run = (self.clock.now, dt, k)
            self._schedule(self.clock.now + k * dt, self._end_decode_run, k, dt)
            return
        self._stepping = False

    def _end_pause(self, released) -> None:
        for _, done in released:
            if done is not None:
                done()
        self._plan()

    def _end_mixed(self, chunks) -> None:
        for r, n in chunks:
            r.left -= n
            r.context += n
        self._advance(1)
        for r, _ in chunks:
            if r.left <= 0 and r.then_decode:  # recomputed: now decode
                self.prefills.remove(r)
                r.prefill, r.left, r.then_decode = False, r.then_decode, 0
                self._add_decode(r)
            elif r.left <= 0:
                self.prefills.remove(r)
                self.reserved -= r.kv
                if r.hold is not None:
                    self._keep(r)
                r.done()
        self._plan()

    def _end_decode_run(self, steps: int, dt: float) -> None:
        self.busy_s += steps * dt / self.slowdown
        self._advance(steps)
        self._plan()

    def _advance(self, steps: int) -> None:
        self.step += steps
        while self.decodes and self.decodes[0][0] <= self.step:
            _, _, r = heapq.heappop(self.decodes)
            self.n_dec -= 1
            self.ctx_base -= r.context - (r.finish_step - r.left)
            self.reserved -= r.kv
            if r.hold is not None:
                self._keep(r)
            r.done()
