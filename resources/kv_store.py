"""Each conversation's KV on one inference worker, kept between its turns.

A multi-turn trajectory's next prefill reads its new tokens after everything the conversation
said so far. Rather than ship that whole cache back from the worker that decoded the last turn,
every ``hf`` inference worker keeps the KV it computed, keyed by conversation, as a serving
engine's prefix cache keeps a session's blocks: the cache handle that moves between turns holds
only the conversation's token ids (:class:`tasks.records.KVCache`). What a worker lacks (the last
turn ran on another pool, the entry was evicted, the worker restarted) it computes again from
those ids, so a miss costs a forward pass, never correctness.

An entry is used only as far as its tokens match the conversation's: KV written by a turn that
was retried with another outcome is never read as this conversation's. Entries are evicted least
recently used first beyond ``capacity_bytes``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


@dataclass
class KVStoreStats:
    hits: int = 0  # lookups that found some of the conversation's KV
    misses: int = 0  # lookups that found none of it (a first turn is not a lookup)
    reused_tokens: int = 0
    recomputed_tokens: int = 0  # what a lookup lacked and its caller ran again
    evictions: int = 0
    max_bytes: int = 0


class KVStore:
    """Conversation key -> (token ids, KV ``[layers, 2, kv_heads, tokens, head_dim]``), LRU."""

    def __init__(self, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise ValueError(f"KV store capacity must be positive, got {capacity_bytes} bytes")
        self.capacity_bytes = capacity_bytes
        self.stats = KVStoreStats()
        self._entries: OrderedDict[str, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def lookup(self, key: str, token_ids: list[int], upto: int) -> np.ndarray | None:
        """The KV of the longest prefix of ``token_ids[:upto]`` held for ``key`` (its token
        count is the result's ``shape[3]``), or None when none is held."""
        if upto <= 0:
            return None
        with self._lock:
            entry = self._entries.get(key)
            n = 0
            if entry is not None:
                self._entries.move_to_end(key)
                ids, kv = entry
                n = min(upto, len(ids))
                differ = np.flatnonzero(ids[:n] != np.asarray(token_ids[:n], dtype=ids.dtype))
                n = int(differ[0]) if len(differ) else n
            if n == 0:
                self.stats.misses += 1
                return None
            self.stats.hits += 1
            self.stats.reused_tokens += n
            return kv[:, :, :, :n]

    def recomputed(self, tokens: int) -> None:
        with self._lock:
            self.stats.recomputed_tokens += tokens

    def put(self, key: str, token_ids: list[int], kv: np.ndarray) -> None:
        """Keep ``kv``, the KV of ``token_ids`` (one position each), as ``key``'s entry."""
        if len(token_ids) != kv.shape[3]:
            raise ValueError(f"{len(token_ids)} token ids for KV of {kv.shape[3]} positions")
        ids = np.asarray(token_ids, dtype=np.int64)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1].nbytes
            self._entries[key] = (ids, kv)
            self._bytes += kv.nbytes
            while self._bytes > self.capacity_bytes and len(self._entries) > 1:
                _, (_, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped.nbytes
                self.stats.evictions += 1
            self.stats.max_bytes = max(self.stats.max_bytes, self._bytes)
