"""The worker-resident engine: batched forward passes, equal results, versioned weight switches,
float32 CPU results from a model of any dtype."""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from resources.engine import HFBackend, InferenceEngine
from tasks.generation import decode, prefill
from tasks.policy import load_policy, stop_token_ids
from tasks.records import SamplingParams
from tasks.specs import PolicySpec


def test_forward_matches_full_forward(engine, policy):
    model, _ = policy
    ids = [3, 6, 7, 8, 9, 10, 11, 12]
    with torch.no_grad():
        full = model(torch.tensor([ids])).logits[0]
    a = engine.forward(None, ids[:5])
    b = engine.forward(a.kv_new, ids[5:])
    assert a.kv_new.shape[3] == 5 and b.kv_new.shape[3] == 3
    torch.testing.assert_close(b.last_logits, full[-1], atol=1e-4, rtol=1e-4)


def test_concurrent_requests_share_forward_passes_and_match_sequential(engine, policy, obs):
    _, tok = policy
    prompts = [[3] + list(range(6, 6 + n)) + [4] for n in (2, 5, 9, 13, 3, 7, 11, 1)]
    params = SamplingParams(greedy=True, max_new_tokens=6)
    backend = HFBackend(engine, tok, stop_token_ids(tok), 256)

    def run(ids, i):
        pre = prefill(backend, None, obs(ids))
        return decode(backend, pre, None, params, seed=i)

    sequential = [run(p, i) for i, p in enumerate(prompts)]
    before = engine.stats.forward_passes
    results: dict[int, object] = {}
    barrier = threading.Barrier(len(prompts))

    def worker(i):
        barrier.wait()
        results[i] = run(prompts[i], i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    passes = engine.stats.forward_passes - before
    requests = sum(1 + r.sample.decode_tokens_processed for r in sequential)  # prefill + decode
    assert passes < requests, (passes, requests)
    assert engine.stats.max_batch_seen > 1
    for i, seq in enumerate(sequential):
        assert results[i].sample.token_ids == seq.sample.token_ids
        np.testing.assert_allclose(results[i].sample.logprobs, seq.sample.logprobs, atol=1e-4)


def test_weights_switch_at_safe_point_and_versions_are_recorded(engine, policy, obs):
    model, tok = policy
    state = {k: (v.detach().numpy() * 0.5).astype(np.float32) for k, v in model.state_dict().items()}
    assert engine.load_weights(state, version=7) == 7
    backend = HFBackend(engine, tok, [], 256)
    pre = prefill(backend, None, obs([3, 6, 7, 4]))
    out = decode(backend, pre, None, SamplingParams(max_new_tokens=3), seed=0)
    assert pre.policy_version == 7
    assert out.sample.versions == [7] * len(out.sample.token_ids)
    assert engine.stats.weight_loads == 1


def test_older_weights_never_replace_newer(engine, policy):
    model, _ = policy
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    assert engine.load_weights(state, version=5) == 5
    assert engine.load_weights(state, version=3) == 5  # late arrival of an older version
    assert engine.version == 5 and engine.stats.weight_loads == 1


def test_weights_staged_while_a_pass_gathers_its_batch_load_without_another_request(policy):
    """A loader stages weights and wakes the engine thread with an empty request; if that
    wake-up is taken while the thread gathers a pass's batch, the weights still switch right
    after that pass, not only with a next request (at a run's end none may come)."""
    model, _ = policy
    engine = InferenceEngine(model, batch_wait_s=1.0)  # a pass gathers its batch for 1 s
    try:
        state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
        request = threading.Thread(target=engine.forward, args=(None, [3, 6, 7]))
        request.start()
        time.sleep(0.3)  # the engine thread took it and gathers its batch: the wake-up joins it
        assert engine.load_weights(state, version=2, timeout=10) == 2
        request.join()
    finally:
        engine.close()


def test_a_bfloat16_model_hands_back_float32_cpu_results(policy, obs):
    model, tok = policy
    half, _ = load_policy(PolicySpec(device="cpu", dtype="bfloat16"))
    engine = InferenceEngine(half)
    try:
        state = {k: (v.detach().numpy() * 0.5).astype(np.float32)
                 for k, v in model.state_dict().items()}
        assert engine.load_weights(state, version=1) == 1  # float32 arrays, cast on loading
        for k, v in half.state_dict().items():
            assert v.dtype == torch.bfloat16
            assert torch.equal(v, torch.from_numpy(state[k]).to(torch.bfloat16)), k
        a = engine.forward(None, [3, 6, 7, 8, 9])
        b = engine.forward(a.kv_new, [10, 11])
        for t in (a.kv_new, a.last_logits, b.kv_new, b.last_logits):
            assert t.dtype == torch.float32 and t.device.type == "cpu"
        backend = HFBackend(engine, tok, stop_token_ids(tok), 256)
        pre = prefill(backend, None, obs([3, 6, 7, 4]))
        out = decode(backend, pre, None, SamplingParams(max_new_tokens=5), seed=0)
        kept = backend.store.lookup(out.cache.key, out.cache.token_ids, out.cache.n_tokens)
        assert pre.kv_new.dtype == kept.dtype == np.float32
        assert kept.shape[3] == out.cache.n_tokens == 4 + out.sample.decode_tokens_processed
        assert out.sample.decode_tokens_processed == len(out.sample.token_ids) - 1
        assert np.isfinite(out.sample.logprobs).all()
    finally:
        engine.close()


def _wait_until(cond, timeout=30.0):
    deadline = threading.Event()
    timer = threading.Timer(timeout, deadline.set)
    timer.start()
    try:
        while not cond():
            assert not deadline.wait(0.005), "timed out"
    finally:
        timer.cancel()


def test_announced_members_arriving_one_after_another_share_one_pass(engine):
    engine.hold_s = 600.0  # only the members' arrival may release the pass here
    n, go = 5, threading.Event()
    before = engine.stats.forward_passes
    results: dict[int, object] = {}

    def member(i):
        if i:
            assert go.wait(30)
        return engine.forward(None, [3, 6 + i, 7])

    with engine.members(n) as run:
        threads = [threading.Thread(target=lambda i=i: results.update({i: run(member, i)}))
                   for i in range(n)]
        for t in threads:
            t.start()
        # the first request is queued alone; without the announcement it would run by itself
        _wait_until(lambda: engine._expected == n - 1)
        go.set()
        for t in threads:
            t.join(60)
    assert len(results) == n
    assert engine.stats.forward_passes - before == 1 and engine.stats.max_batch_seen == n
    assert engine._expected == 0


def test_a_member_that_fails_before_its_request_holds_no_pass(engine):
    engine.hold_s = 600.0
    out: dict[int, object] = {}

    def member(i):
        if i == 2:
            raise ValueError("bad observation")
        return engine.forward(None, [3, 6, 7])

    def guarded(run, i):
        try:
            out[i] = run(member, i)
        except ValueError as exc:
            out[i] = exc

    with engine.members(3) as run:
        threads = [threading.Thread(target=guarded, args=(run, i)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert isinstance(out[2], ValueError) and out[0].kv_new.shape[3] == 3


def test_a_member_still_running_when_its_task_returns_holds_no_later_pass(engine):
    engine.hold_s = 600.0
    release = threading.Event()
    with engine.members(2) as run:
        stuck = threading.Thread(target=run, args=(lambda i: release.wait(30), 1))
        stuck.start()
    # the task returned with member 1 deferred: a later request runs without waiting for it
    done = threading.Thread(target=lambda: engine.forward(None, [3, 6]))
    done.start()
    done.join(60)
    assert not done.is_alive() and engine._expected == 0
    release.set()
    stuck.join(30)
