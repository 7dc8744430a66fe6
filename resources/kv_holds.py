"""KV held for trajectories between their requests: one rule for the emulated engine
(:mod:`resources.emulated_engine`) and the simulator's (:mod:`resources.sim_engine`).

A request given ``hold=key`` leaves its KV held under ``key`` when it ends (the trajectory waits
for its environment); the next request with ``resume=key`` takes the held tokens over. Held KV
never blocks an admission: when a request needs room, the KV held longest is evicted first
(as vLLM's prefix cache evicts least recently used blocks), and a request resuming evicted KV
recomputes it before its own work.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class KVHolds:
    """The held KV of one engine, by key, oldest first, with its counters."""

    def __init__(self) -> None:
        self.held: OrderedDict[Hashable, int] = OrderedDict()  # key -> tokens, oldest first
        self.tokens = 0  # held now
        self.max_tokens = 0  # most held at once
        self.evicted: dict[Hashable, int] = {}  # key -> tokens evicted, until resumed/released
        self.resumed = self.evictions = self.recomputed_tokens = 0

    def release(self, key: Hashable) -> None:
        """Free the KV held under ``key`` (and forget that it was evicted); safe to repeat."""
        self.tokens -= self.held.pop(key, 0)
        self.evicted.pop(key, None)

    def make_room(self, reserved: int, need: int, resume: Hashable | None,
                  capacity: int) -> bool:
        """Whether a request needing ``need`` tokens fits beside ``reserved`` tokens of running
        requests, evicting held KV (never ``resume``'s) if that is what it takes; False: it
        must wait for running requests to end."""
        own = self.held.get(resume, 0) if resume is not None else 0
        over = reserved + self.tokens - own + need - capacity
        if over > self.tokens - own:
            return False
        freed = 0
        for key in list(self.held):
            if freed >= over:
                break
            if key == resume:
                continue
            n = self.held.pop(key)
            self.tokens -= n
            self.evicted[key] = n
            freed += n
            self.evictions += 1
        return True

    def take(self, resume: Hashable | None, context: int) -> int:
        """An admitted request takes over its held KV: the tokens of its ``context`` it must
        recompute (those evicted; 0 when its KV was still held or it resumes nothing)."""
        if resume is None:
            return 0
        if resume in self.held:
            self.tokens -= self.held.pop(resume)
            self.resumed += 1
            return 0
        lost = min(self.evicted.pop(resume, 0), context)
        self.recomputed_tokens += lost
        return lost

    def resume(self, request) -> None:
        """An admitted request (``resume``, ``context``, ``prefill``, ``left``, ``then_decode``)
        takes over its held KV; if it was evicted, the request first recomputes it (a decode
        turns into a prefill of the lost context, then decodes)."""
        lost = self.take(request.resume, request.context)
        if lost:
            if not request.prefill:
                request.prefill, request.then_decode, request.left = True, request.left, 0
            request.left += lost
            request.context -= lost

    def keep(self, hold: Hashable, tokens: int) -> None:
        """A finished request's reservation stays, held under ``hold``."""
        self.tokens += tokens - self.held.pop(hold, 0)
        self.held[hold] = tokens
        self.max_tokens = max(self.max_tokens, self.tokens)
