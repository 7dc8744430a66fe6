"""prefill/decode: KV for new tokens only, decode runs only its own samples, logprobs truthful."""

from __future__ import annotations

import numpy as np
import torch

from tasks.generation import decode, prefill
from tasks.records import SamplingParams


def test_two_turns_compute_each_token_once_and_match_teacher_forcing(engine, policy, obs):
    model, tok = policy
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    turn0 = [3, 6, 7, 8, 4]
    p0 = prefill(engine, None, obs(turn0))
    assert (p0.n_past, p0.n_new) == (0, len(turn0))
    d0 = decode(engine, p0, None, tok, params, [], 256, seed=1)
    s0 = d0.sample
    # decode runs exactly the tokens it sampled; prefill ran exactly the turn's input
    assert s0.decode_tokens_processed == len(s0.token_ids)
    assert d0.n_tokens == len(turn0) + len(s0.token_ids) and d0.pending_ids == []
    turn1 = [5, 3, 9, 10, 4]
    p1 = prefill(engine, d0, obs(turn1))
    assert p1.n_past == d0.n_tokens and p1.n_new == len(turn1)
    d1 = decode(engine, p1, d0, tok, params, [], 256, seed=2)
    seq = turn0 + s0.token_ids + turn1 + d1.sample.token_ids
    assert d1.n_tokens == len(seq)
    # behaviour log-probs equal teacher-forced log-probs of the same weights
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([seq])).logits[0], -1)
    start1 = len(turn0) + len(s0.token_ids) + len(turn1)
    for i, t in enumerate(d1.sample.token_ids):
        assert abs(float(logp[start1 + i - 1, t]) - d1.sample.logprobs[i]) < 1e-4
    for i, t in enumerate(s0.token_ids):
        assert abs(float(logp[len(turn0) + i - 1, t]) - s0.logprobs[i]) < 1e-4


def test_stop_token_ends_turn(engine, policy, obs):
    _, tok = policy
    p = prefill(engine, None, obs([3, 6, 4]))
    # any token is a stop token: the turn ends after one sample, decode runs nothing
    out = decode(engine, p, None, tok, SamplingParams(max_new_tokens=5), list(range(len(tok))),
                 256, seed=0)
    assert out.sample.stopped and len(out.sample.token_ids) == 1
    assert out.sample.decode_tokens_processed == 1 and out.n_tokens == 4


def test_context_limit_marks_context_full(engine, policy, obs):
    _, tok = policy
    ids = list(np.random.default_rng(0).integers(6, 50, size=20))
    p = prefill(engine, None, obs([int(i) for i in ids]))
    out = decode(engine, p, None, tok, SamplingParams(max_new_tokens=50), [], 24, seed=0)
    assert out.sample.context_full and out.pending_ids == out.sample.token_ids[-1:]
    assert out.n_tokens + 1 == 24
