"""KV held while a trajectory waits for its environment, the same in the emulated engine (real
threads and sleeps) and the simulator's engine (a virtual clock): a finished request's KV stays
counted against the capacity under its key, the next request resuming it takes it over, memory
pressure evicts the oldest hold and the request resuming it recomputes it; the emulated backend
releases a hold when its cache handle is dropped. Also: the emulated trainer's steps grow with
the trainer's PPO epochs."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from resources.catalog import CATALOG
from resources.device_model import DeviceModel, model_spec
from resources.emulated import emulated_backend
from resources.emulated_engine import EmulatedEngine
from resources.emulated_trainer import EmulatedTrainer
from resources.sim_engine import Clock, SimEngine
from tasks.components import instantiate
from tasks.records import SamplingParams, TrainBatch, TrainSample, TurnShape
from tasks.specs import PolicySpec

H800 = CATALOG["H800"]
CAPACITY = 10_000  # tokens of KV: two conversations of ~5-6k cannot both stay
SCALE = 1e-3  # the emulated engine's real seconds per device second


def _device(capacity: int = CAPACITY) -> DeviceModel:
    m = model_spec("dense-8b")
    memory = (m.weight_bytes + capacity * m.kv_bytes_per_token + 1) / 0.9
    return DeviceModel(m, H800.model_copy(update={"memory_bytes": memory}))


class _Emulated:
    """Requests one after another on an :class:`EmulatedEngine`."""

    def __init__(self):
        self.engine = EmulatedEngine(_device(), SCALE, chunk_tokens=8192)

    def run(self, prefill: bool, tokens: int, context: int, hold=None, resume=None) -> None:
        fn = self.engine.prefill if prefill else self.engine.decode
        fn(tokens, context, hold, resume) if prefill else fn(context, tokens, hold, resume)

    def release(self, key) -> None:
        self.engine.release(key)

    def state(self) -> dict:
        s = self.engine.stats
        return dict(held=self.engine.held_tokens, resumed=s.kv_resumed, evictions=s.kv_evictions,
                    recomputed=s.kv_recomputed_tokens, prefilled=s.prefill_tokens,
                    decoded=s.decode_tokens, busy=s.busy_s)

    def close(self) -> None:
        self.engine.close()


class _Sim:
    """Requests one after another on a :class:`SimEngine`, each run to its end."""

    def __init__(self):
        self.clock = Clock()
        self.engine = SimEngine(self.clock, "e", _device(), 8192, 256)
        self.prefilled = self.decoded = 0

    def run(self, prefill: bool, tokens: int, context: int, hold=None, resume=None) -> None:
        done = []
        self.engine.submit(prefill, tokens, context, lambda: done.append(True), hold, resume)
        self.clock.run(1e12, lambda: bool(done))
        assert done

    def release(self, key) -> None:
        self.engine.release(key)

    def state(self) -> dict:
        e = self.engine
        return dict(held=e.kv.tokens, resumed=e.kv.resumed, evictions=e.kv.evictions,
                    recomputed=e.kv.recomputed_tokens, busy=e.busy_s)

    def close(self) -> None:
        pass


ENGINES = [_Emulated, _Sim]


@pytest.mark.parametrize("kind", ENGINES)
def test_a_waiting_trajectorys_kv_stays_held_and_its_next_turn_takes_it_over(kind):
    e = kind()
    try:
        e.run(False, 100, 1000, hold="a")  # turn 0's decode: 1,100 tokens of KV stay
        assert e.state()["held"] == 1100
        dev = _device()
        before = e.state()["busy"]
        e.run(True, 200, 1100, resume="a")  # turn 1's prefill reads only its 200 new tokens
        assert e.state()["busy"] - before == pytest.approx(dev.prefill_time(200, 1100))
        s = e.state()
        assert s["held"] == 0 and s["resumed"] == 1 and s["recomputed"] == 0
        e.run(False, 50, 1300, hold="a")
        assert e.state()["held"] == 1350
        e.release("a")  # the trajectory ended
        e.release("a")
        assert e.state()["held"] == 0
    finally:
        e.close()


def _pressure(e) -> list[dict]:
    """Two conversations of 5-6k tokens on an engine of 10k: each new turn evicts the other's
    held KV, and resuming evicted KV recomputes it."""
    states = []
    e.run(False, 100, 5000, hold="a")
    e.run(False, 100, 6000, hold="b")  # needs 6,100 beside a's 5,100: a is evicted
    states.append(e.state())
    e.run(True, 200, 5100, resume="a")  # a's context is gone: read 5,100 + 200 again
    states.append(e.state())
    e.run(False, 50, 5300, hold="a", resume="a")  # b evicted for a's decode
    states.append(e.state())
    e.run(False, 40, 6100, hold="b", resume="b")  # b recomputes its 6,100 before decoding
    states.append(e.state())
    return states


@pytest.mark.parametrize("kind", ENGINES)
def test_memory_pressure_evicts_the_oldest_hold_and_its_next_turn_recomputes_it(kind):
    e = kind()
    try:
        first, second, third, fourth = _pressure(e)
    finally:
        e.close()
    assert first["held"] == 6100 and first["evictions"] == 1  # held KV never blocks admission
    assert second["recomputed"] == 5100
    assert third["evictions"] == 2 and third["held"] == 5350
    assert fourth["recomputed"] == 5100 + 6100 and fourth["evictions"] == 3
    assert fourth["held"] == 6140


def test_both_engines_hold_evict_and_recompute_identically():
    runs = []
    for kind in ENGINES:
        e = kind()
        try:
            runs.append(_pressure(e))
        finally:
            e.close()
    emulated, sim = runs
    for a, b in zip(emulated, sim, strict=True):
        assert {k: a[k] for k in b if k != "busy"} == {k: b[k] for k in b if k != "busy"}
        assert a["busy"] == pytest.approx(b["busy"], rel=1e-9)
    # the recomputation is paid in device time: without the evictions (room for both) the
    # same turns take less
    roomy = _Sim()
    roomy.engine = SimEngine(roomy.clock, "e", _device(100_000), 8192, 256)
    relaxed = _pressure(roomy)
    assert relaxed[-1]["recomputed"] == 0 and relaxed[-1]["evictions"] == 0
    assert relaxed[-1]["busy"] < sim[-1]["busy"]


def test_the_emulated_backend_holds_a_turns_kv_until_its_handle_is_dropped():
    backend = emulated_backend(PolicySpec(device="cpu"), max_batch=4, hardware=H800,
                               time_scale=SCALE)
    try:
        engine = backend.engine
        shape = TurnShape(prompt_tokens=800, response_tokens=120)
        params = SamplingParams(max_new_tokens=4)
        pre = backend.prefill(None, [1, 2, 3], shape=shape)
        out = backend.decode(pre, None, params, seed=0, shape=shape)
        handle = out.cache
        assert handle.kv_key and handle.link == engine.device.link()
        assert engine.held_tokens == 920
        # the next turn resumes it on this engine: only the new tokens are read
        pre2 = backend.prefill(handle, [4, 5], shape=TurnShape(300, 60))
        assert engine.held_tokens == 0 and engine.stats.kv_resumed == 1
        out2 = backend.decode(pre2, handle, params, seed=1, shape=TurnShape(300, 60))
        assert engine.held_tokens == 920 + 300 + 60
        del out, handle, pre2
        gc.collect()
        assert engine.held_tokens == 920 + 300 + 60  # the newest handle still holds it
        del out2
        gc.collect()
        assert engine.held_tokens == 0  # the trajectory's last handle is gone
    finally:
        backend.close()


def test_the_emulated_trainer_spends_more_with_more_ppo_epochs():
    def trainer(epochs: int) -> EmulatedTrainer:
        inner = instantiate({"_component_": "tasks.trainer.policy_trainer"},
                            policy=PolicySpec(device="cpu"),
                            hparams={"ppo_epochs": epochs, "minibatches": 2}, seed=0, loss=None)
        return EmulatedTrainer(inner, DeviceModel(model_spec("dense-8b"), H800, 8), SCALE,
                               ppo_epochs=epochs, minibatches=2)

    rng = np.random.default_rng(0)
    samples = []
    for t in (8, 11, 9, 12):
        mask = np.arange(t) >= t // 2
        behav = np.where(mask, -4.0, 0.0).astype(np.float32)
        samples.append(TrainSample(rng.integers(1, 60, t), mask, behav, float(rng.normal())))
    batch = TrainBatch(samples, 0)
    one, three = trainer(1), trainer(3)
    for t in (one, three):
        t.train_step(batch)
    assert three.busy_s > 2 * one.busy_s
    # the head's logits at the loss's positions only: the second half of each sample
    assert one.busy_s == pytest.approx(one.device.train_step_time([8, 11, 9, 12], 1, 2,
                                                                  loss_tokens=4 + 6 + 5 + 6))
    assert one.busy_s < one.device.train_step_time([8, 11, 9, 12], 1, 2)


class _Clock:
    """A fake ``time`` for the emulated trainer: the real step takes ``real`` seconds of it,
    ``sleep`` advances it."""

    def __init__(self, real: float):
        self.now, self.real, self.slept = 0.0, real, []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_the_emulated_trainers_real_step_runs_inside_its_device_time(monkeypatch):
    """The tiny policy's CPU step is emulation overhead: a step sleeps what is left of its
    scaled device time after the real step, and takes the real time when that is longer."""
    inner = instantiate({"_component_": "tasks.trainer.policy_trainer"},
                        policy=PolicySpec(device="cpu"), hparams={"minibatches": 2}, seed=0,
                        loss=None)
    clock = _Clock(real=0.5)
    real_step = inner.train_step

    def timed_step(batch):  # the real step, taking 0.5 s of the fake clock
        stats = real_step(batch)
        clock.now += clock.real
        return stats

    monkeypatch.setattr(inner, "train_step", timed_step)
    monkeypatch.setattr("resources.emulated_trainer.time", clock)
    rng = np.random.default_rng(0)
    samples = [TrainSample(rng.integers(1, 60, t), np.arange(t) >= t // 2,
                           np.full(t, -4.0, np.float32), float(rng.normal()))
               for t in (8, 11, 9, 12)]
    trainer = EmulatedTrainer(inner, DeviceModel(model_spec("dense-8b"), H800, 8), 1.0,
                              minibatches=2)
    device_s = trainer.step_seconds(TrainBatch(samples, 0))
    trainer.time_scale = 2.0 / device_s  # the device time: 2 s of the clock
    stats = trainer.train_step(TrainBatch(samples, 0))
    assert clock.slept == [pytest.approx(1.5)] and stats.seconds == pytest.approx(2.0)
    assert trainer.busy_s == pytest.approx(device_s)  # unscaled device seconds, as before
    trainer.time_scale = 0.2 / device_s  # shorter than the real step: no sleep, the real time
    stats = trainer.train_step(TrainBatch(samples, 1))
    assert clock.slept[-1] == 0.0 and stats.seconds == pytest.approx(0.5)
    assert stats.policy_version == 2  # both steps trained for real
