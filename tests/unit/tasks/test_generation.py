"""prefill/decode: KV for new tokens only, decode runs only its own samples, logprobs truthful."""

from __future__ import annotations

import numpy as np
import torch

from flows.config import EnvTaskConfig
from flows.training.episode import RolloutRecord
from flows.training.orchestration import staleness
from tasks.generation import decode, prefill
from tasks.records import EnvHandle, EnvObservation, SamplingParams, WeightsSnapshot


def _teacher_forced(model, seq):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([seq])).logits[0], -1)


def test_two_turns_compute_each_token_once_and_match_teacher_forcing(make_backend, policy, obs):
    model, tok = policy
    backend = make_backend(stop_ids=[])
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    turn0 = [3, 6, 7, 8, 4]
    p0 = prefill(backend, None, obs(turn0))
    assert (p0.n_past, p0.n_new) == (0, len(turn0))
    d0 = decode(backend, p0, None, params, seed=1)
    s0 = d0.sample
    # decode runs the tokens it sampled but the last, which the next prefill reads first;
    # prefill ran exactly the turn's input
    assert s0.decode_tokens_processed == len(s0.token_ids) - 1
    assert d0.cache.n_tokens == len(turn0) + len(s0.token_ids) - 1
    assert d0.cache.pending_ids == s0.token_ids[-1:]
    turn1 = [5, 3, 9, 10, 4]
    p1 = prefill(backend, d0, obs(turn1))
    assert p1.n_past == d0.cache.n_tokens and p1.n_new == 1 + len(turn1)
    d1 = decode(backend, p1, d0, params, seed=2)
    seq = turn0 + s0.token_ids + turn1 + d1.sample.token_ids
    assert d1.cache.n_tokens + len(d1.cache.pending_ids) == len(seq)
    # behaviour log-probs equal teacher-forced log-probs of the same weights
    logp = _teacher_forced(model, seq)
    start1 = len(turn0) + len(s0.token_ids) + len(turn1)
    for i, t in enumerate(d1.sample.token_ids):
        assert abs(float(logp[start1 + i - 1, t]) - d1.sample.logprobs[i]) < 1e-4
    for i, t in enumerate(s0.token_ids):
        assert abs(float(logp[len(turn0) + i - 1, t]) - s0.logprobs[i]) < 1e-4


def test_stop_token_ends_turn(make_backend, policy, obs):
    _, tok = policy
    # any token is a stop token: the turn ends after one sample, decode runs nothing
    backend = make_backend(stop_ids=list(range(len(tok))))
    p = prefill(backend, None, obs([3, 6, 4]))
    out = decode(backend, p, None, SamplingParams(max_new_tokens=5), seed=0)
    assert out.sample.stopped and len(out.sample.token_ids) == 1
    assert out.sample.decode_tokens_processed == 0 and out.cache.n_tokens == 3
    assert out.cache.pending_ids == out.sample.token_ids


def test_context_limit_marks_context_full(make_backend, obs):
    backend = make_backend(stop_ids=[], max_context=24)
    ids = list(np.random.default_rng(0).integers(6, 50, size=20))
    p = prefill(backend, None, obs([int(i) for i in ids]))
    out = decode(backend, p, None, SamplingParams(max_new_tokens=50), seed=0)
    assert out.sample.context_full and out.cache.pending_ids == out.sample.token_ids[-1:]
    assert out.cache.n_tokens + 1 == 24


def test_kv_only_forward_passes_count_for_staleness(make_backend, policy, obs):
    """Prefill on v1 weights, decode on a worker still at v0, two tokens per turn: the first is
    sampled from prefill's (v1) logits, the second from decode's pass on v0, which writes the
    first one's KV; the trajectory's oldest version must be 0. The last token's KV is written
    by the next turn's prefill (v1), whose version its first sample carries."""
    model, _ = policy
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    compute, bandwidth = make_backend(stop_ids=[]), make_backend(stop_ids=[])
    compute.load_weights(WeightsSnapshot(1, state))
    bandwidth.load_weights(WeightsSnapshot(0, state))
    params = SamplingParams(max_new_tokens=2)
    rec = RolloutRecord(0, "g", EnvTaskConfig(name="e", env={"_component_": "e.E"}), 0)
    past = None
    for turn, ids in enumerate(([3, 6, 7, 4], [5, 3, 9, 4])):
        p = prefill(compute, past, obs(ids))
        past = decode(bandwidth, p, past, params, seed=turn)
        assert past.sample.versions == [1, 0] and past.sample.oldest_version == 0
        rec.record_turn(EnvObservation(EnvHandle("w", "e"), "", [], consumed_ids=ids,
                                       sample=past.sample))
    traj = rec.to_trajectory(EnvObservation(EnvHandle("w", "e"), "", []), False)
    assert traj.versions[traj.loss_mask].tolist() == [1, 0, 1, 0]
    assert traj.oldest_version == 0
    assert staleness(1, traj) == 1


def test_only_the_new_tokens_kv_moves_and_a_worker_that_lacks_the_rest_runs_it(
        make_backend, policy, obs):
    """Turn 0 on one pair of workers, turn 1's prefill and decode each on a worker that saw
    nothing of the conversation: they compute its KV again from the handle's token ids, and the
    sampled log-probs are still the model's."""
    model, _ = policy
    a_pre, a_dec = make_backend(stop_ids=[]), make_backend(stop_ids=[])
    b_pre, b_dec = make_backend(stop_ids=[]), make_backend(stop_ids=[])
    params = SamplingParams(max_new_tokens=3)
    turn0, turn1 = [3, 6, 7, 8, 4], [5, 3, 9, 4]
    p0 = prefill(a_pre, None, obs(turn0))
    d0 = decode(a_dec, p0, None, params, seed=1)
    # the handle carries tokens, no KV; prefill handed decode the turn's tokens' KV only
    assert not any(isinstance(v, np.ndarray) for v in vars(d0.cache).values())
    assert p0.kv_new.shape[3] == len(turn0)
    p1 = prefill(b_pre, d0, obs(turn1))
    assert p1.kv_new.shape[3] == p1.n_new == len(d0.cache.pending_ids) + len(turn1)
    assert b_pre.store.stats.recomputed_tokens == d0.cache.n_tokens
    d1 = decode(b_dec, p1, d0, params, seed=2)
    assert b_dec.store.stats.recomputed_tokens == d0.cache.n_tokens
    assert a_pre.store.stats.recomputed_tokens == a_dec.store.stats.recomputed_tokens == 0
    seq = turn0 + d0.sample.token_ids + turn1 + d1.sample.token_ids
    assert d1.cache.token_ids == seq
    logp = _teacher_forced(model, seq)
    start1 = len(turn0) + len(d0.sample.token_ids) + len(turn1)
    for i, t in enumerate(d1.sample.token_ids):
        assert abs(float(logp[start1 + i - 1, t]) - d1.sample.logprobs[i]) < 1e-4


def test_a_worker_that_ran_the_last_turn_reads_the_conversation_from_its_store(
        make_backend, obs):
    """Prefill on one worker, decode on another, three turns: prefill computes only the tokens
    decode sampled but did not run, decode nothing again."""
    pre, dec = make_backend(stop_ids=[]), make_backend(stop_ids=[])
    params = SamplingParams(max_new_tokens=3)
    past = None
    for turn, ids in enumerate(([3, 6, 7, 4], [5, 3, 9, 4], [8, 9, 4])):
        p = prefill(pre, past, obs(ids))
        past = decode(dec, p, past, params, seed=turn)
    decoded_not_prefilled = 2 * 2  # turns 0 and 1 each ran two of their three samples
    assert pre.store.stats.recomputed_tokens == decoded_not_prefilled
    assert dec.store.stats.recomputed_tokens == 0
    assert dec.store.stats.hits == 2 and pre.store.stats.hits == 2
