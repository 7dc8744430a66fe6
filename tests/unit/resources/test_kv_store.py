"""The per-worker store of conversations' KV: longest matching prefix, LRU within capacity."""

from __future__ import annotations

import numpy as np
import pytest

from resources.kv_store import KVStore


def kv(n: int, fill: float = 1.0) -> np.ndarray:
    return np.full((2, 2, 2, n, 4), fill, dtype=np.float32)  # 128 bytes a token


def test_lookup_returns_the_longest_prefix_whose_tokens_match():
    store = KVStore(1 << 20)
    assert store.lookup("a", [1, 2, 3], 3) is None  # nothing held: a miss
    store.put("a", [1, 2, 3, 4], kv(4))
    assert store.lookup("a", [1, 2, 3, 4, 5, 6], 6).shape[3] == 4  # all it holds
    assert store.lookup("a", [1, 2, 3, 4, 5], 2).shape[3] == 2  # no further than asked
    # a retried turn that went another way: only the shared prefix is the conversation's
    assert store.lookup("a", [1, 2, 9, 4], 4).shape[3] == 2
    assert store.lookup("a", [7, 2, 3, 4], 4) is None
    assert store.lookup("b", [1, 2, 3, 4], 4) is None
    assert (store.stats.hits, store.stats.misses, store.stats.reused_tokens) == (3, 3, 8)


def test_the_least_recently_used_conversations_are_evicted_beyond_capacity():
    store = KVStore(10 * 128)  # ten tokens' KV
    store.put("a", [1, 2, 3, 4], kv(4))
    store.put("b", [1, 2, 3, 4], kv(4))
    assert store.lookup("a", [1, 2, 3, 4], 4) is not None  # "a" is now the most recent
    store.put("c", [5, 6, 7], kv(3))
    assert store.lookup("b", [1, 2, 3, 4], 4) is None
    assert store.lookup("a", [1, 2, 3, 4], 4) is not None
    assert store.stats.evictions == 1 and store.nbytes == 7 * 128 and len(store) == 2
    store.put("a", [1, 2, 3, 4, 5, 6], kv(6))  # a longer entry replaces the shorter one
    assert store.nbytes == 9 * 128 and len(store) == 2


def test_put_rejects_kv_of_another_length_and_the_store_a_capacity_of_nothing():
    with pytest.raises(ValueError, match="3 token ids for KV of 4 positions"):
        KVStore(1 << 20).put("a", [1, 2, 3], kv(4))
    with pytest.raises(ValueError, match="capacity must be positive"):
        KVStore(0)
