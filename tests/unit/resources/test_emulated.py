"""The emulated backend: production-GPU time for real tokens. Engines take the device model's
time, KV memory caps the batch, time_scale scales time and nothing else, and the tokens (and so
the learning) are those of the real backend underneath."""

from __future__ import annotations

import threading
import time

import pytest

from flows.config import load_config
from flows.reference import run_reference
from flows.training.workload import LengthDist, TurnShapeConfig, turn_shape
from resources.catalog import CATALOG
from resources.device_model import DeviceModel, ModelSpec, model_spec
from resources.emulated_engine import EmulatedEngine

H800, H20 = CATALOG["H800"], CATALOG["H20"]


def _engine(profile, model="dense-8b", time_scale=1.0, **kw):
    return EmulatedEngine(DeviceModel(model_spec(model), profile), time_scale, **kw)


def _concurrently(target, args_list) -> float:
    """Run ``target(*args)`` for each args at once, in threads; the wall seconds it took."""
    threads = [threading.Thread(target=target, args=args) for args in args_list]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


@pytest.mark.parametrize("profile,prefill_tokens", [(H800, 4096), (H20, 1024)])
def test_a_prefill_and_a_decode_take_the_device_models_time(profile, prefill_tokens):
    engine = _engine(profile)
    try:
        dm = engine.device
        want = dm.prefill_time(prefill_tokens, 512)
        assert 0.05 < want < 1.0
        assert _timed(engine.prefill, prefill_tokens, 512) == pytest.approx(want, rel=0.10)
        steps = 40
        want = sum(dm.decode_step_time([2048 + i]) for i in range(steps))
        assert _timed(engine.decode, 2048, steps) == pytest.approx(want, rel=0.10)
        assert engine.stats.prefill_tokens == prefill_tokens
        assert engine.stats.decode_tokens == steps
    finally:
        engine.close()


def test_h800_wins_prefill_and_h20_decode_per_dollar_on_emulated_engines():
    """Measured on engines (time_scale 0.02), priced per device-hour."""
    cost = {}
    for profile in (H800, H20):
        engine = _engine(profile, time_scale=0.02)
        try:
            pre = _timed(engine.prefill, 8192, 0)
            dec = _concurrently(engine.decode, [(4096, 200)] * 32)
        finally:
            engine.close()
        cost[profile.name] = (pre * profile.price_per_hour, dec * profile.price_per_hour)
    assert cost["H800"][0] < cost["H20"][0]  # prefill: compute per dollar
    assert cost["H20"][1] < cost["H800"][1]  # decode: bandwidth per dollar


def test_kv_memory_caps_the_running_batch():
    # dense-32b on one H20 leaves ~80k tokens of KV beside its 64 GB of weights: 4 sequences
    # of 19k tokens fit at once, the others queue
    engine = _engine(H20, model="dense-32b", time_scale=0.5)
    try:
        assert 4 * 19_010 <= engine.capacity < 5 * 19_010
        _concurrently(engine.decode, [(19_000, 10)] * 8)
        assert engine.stats.max_running == 4
        assert engine.stats.max_waiting >= 4
        assert engine.stats.decode_tokens == 80
        with pytest.raises(ValueError, match="can never fit"):
            engine.decode(200_000, 1)
    finally:
        engine.close()
    # a 70B dense model's 140 GB of weights do not fit on one 96 GB H20
    huge = ModelSpec(name="dense-70b", params_total=70e9, params_active=70e9,
                     kv_bytes_per_token=327680)
    with pytest.raises(ValueError, match="does not fit"):
        EmulatedEngine(DeviceModel(huge, H20))


def _turn(engine, i):
    engine.prefill(512, 0)
    engine.decode(512, 50 + 10 * i)


def test_time_scale_scales_time_and_nothing_else():
    results = {}
    for scale in (0.2, 0.05):
        engine = _engine(H20, time_scale=scale)
        try:
            wall = _concurrently(_turn, [(engine, i) for i in range(8)])
            s = engine.stats
            results[scale] = (wall, s.prefill_tokens, s.decode_tokens)
        finally:
            engine.close()
    (w1, *work1), (w2, *work2) = results[0.2], results[0.05]
    assert work1 == work2  # the same work ...
    assert 2.0 < w1 / w2 < 6.0  # ... in about a quarter of the time (timing noise allowed)


def test_turn_shapes_are_deterministic_and_grow_with_the_turn():
    shape = TurnShapeConfig(prompt_tokens=LengthDist(median=1000),
                            turn_tokens=LengthDist(median=200, sigma=1.0),
                            response_tokens=LengthDist(median=300, sigma=1.0, max=4000))
    a = [turn_shape(shape, 0, 7, t) for t in range(5)]
    assert a == [turn_shape(shape, 0, 7, t) for t in range(5)]
    assert a[0].prompt_tokens == 1000 and all(s.prompt_tokens != 1000 for s in a[1:])
    assert a != [turn_shape(shape, 0, 8, t) for t in range(5)]
    assert all(1 <= s.response_tokens <= 4000 for s in a)
    assert turn_shape(None, 0, 7, 0) is None


def test_the_emulated_backend_gives_the_real_backends_tokens():
    """Same seeds: the reference loop on the emulated backend (with virtual lengths) trains on
    exactly the trajectories and losses of the hf backend, so learning is unchanged."""
    base = ["reward.backend=local", "trainer.max_steps=2", "trainer.groups_per_step=2",
            "eval.every_steps=0"]
    shape = ("{prompt_tokens: {median: 800}, turn_tokens: {median: 120, sigma: 0.5}, "
             "response_tokens: {median: 200, sigma: 1.0}}")
    hf = run_reference(load_config(overrides=base))
    emu = run_reference(load_config(overrides=[
        *base, "engine.backend=emulated", "engine.time_scale=0.001",
        f"env_tasks.0.shape={shape}"]))
    for a, b in zip(hf, emu, strict=True):
        assert [t.token_ids.tolist() for t in a["trajectories"]] == \
            [t.token_ids.tolist() for t in b["trajectories"]]
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-6)
    trajs = [t for row in emu for t in row["trajectories"]]
    frozen = [t for t in trajs if t.env_name == "frozenlake"]
    assert frozen and all(t.virtual_tokens >= 800 + t.num_turns for t in frozen)
    # of them, the responses' (where the trainer's loss, and its head, reads)
    assert all(t.num_turns <= t.virtual_response_tokens <= t.virtual_tokens - 800
               for t in frozen)
    # an env task without a shape counts its real lengths
    real = [t for t in trajs if t.env_name != "frozenlake"]
    assert real and all(t.virtual_tokens == len(t.token_ids) for t in real)
    assert all(t.virtual_response_tokens == t.loss_mask.sum() for t in real)


def test_a_reward_model_queues_on_a_dedicated_pool_and_scales_out_serverless():
    """Eight concurrent scoring calls of 20k tokens each: on the dedicated engine they share one
    H800 (its busy time is the sum of their prefills); serverless, each call has an instance of
    its own, so they overlap and are billed per use."""
    from resources.emulated_judge import JudgedRewardClient
    from resources.reward_client import LocalRewardClient
    from tasks.records import ScoreRequest

    requests = [ScoreRequest(id=str(i), idempotency_key=f"k/{i}", reward_fn="tasks.rewards."
                             "env_return", env_name="x", env_rewards=[1.0], responses=["a"],
                             info={}, virtual_tokens=20_000) for i in range(8)]
    device = DeviceModel(model_spec("dense-8b"), H800)
    one = device.prefill_time(20_000)
    walls = {}
    for dedicated in (True, False):
        client = JudgedRewardClient(LocalRewardClient(), device, 0.2, dedicated)
        try:
            walls[dedicated] = _concurrently(client.score, [([r],) for r in requests])
            stats = client.stats()
        finally:
            client.close()
        if dedicated:
            # chunked into shared steps: never more device time than eight prefills apart
            assert 0 < stats["dedicated_busy_s"] <= 8 * one * 1.01
        else:
            assert stats["serverless_billed_s"] == pytest.approx(8 * one)
    assert walls[False] < walls[True]  # serverless instances run side by side
    # the virtual tokens stay out of the JSON a Lambda function receives
    assert "virtual_tokens" not in requests[0].to_json()
