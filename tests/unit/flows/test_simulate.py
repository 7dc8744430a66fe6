"""The simulator (flows/simulation/, flows/simulate.py): deterministic, driven by the flow's own
decision functions, engines on the device model, and its command line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flows.config import ConfigError, with_overrides
from flows.config.derived import lambda_function_of
from flows.simulation import settings, systems
from flows.simulation.settings import SimSettings, TurnCount
from flows.simulation.simulator import simulate as run_sim
from flows.training import core
from resources.catalog import get_profile
from resources.device_model import DeviceModel, model_spec
from resources.sim_engine import Clock, SimEngine
from tests import ROOT

LONG_TAIL = ROOT / "config" / "bench" / "long_tail.yaml"
DATA = ROOT / "tests" / "data" / "simulator"


def _cfg(*overrides):
    return settings.load(LONG_TAIL, ["trainer.max_steps=3", *overrides])


def test_the_simulation_is_deterministic_for_a_seed():
    cfg, sim = _cfg()
    a, b = run_sim(cfg, sim), run_sim(cfg, sim)
    assert a.step_times == b.step_times and a.tasks == b.tasks and a.busy == b.busy
    assert a.steps == 3 and a.trajectories["trained"] > 0
    c = run_sim(*_cfg("seed=1"))
    assert c.step_times != a.step_times  # another seed, other turn lengths


def test_it_calls_the_flows_admission_room(monkeypatch):
    """Replacing the flow's admission decision changes the simulated run: it is the flow's,
    not a copy."""
    cfg, sim = _cfg()
    base = run_sim(cfg, sim)
    calls = []
    real = core.admission_room

    def one_group_at_a_time(state):
        calls.append(state)
        return min(real(state), 8 - state.rolling_out) if state.rolling_out < 8 else 0

    monkeypatch.setattr(core, "admission_room", one_group_at_a_time)
    narrow = run_sim(cfg, sim)
    assert calls and all(c.max_in_flight == cfg.rollout.max_in_flight for c in calls)
    assert narrow.steps == base.steps == 3
    assert narrow.step_s > 1.5 * base.step_s  # one group rolling out at a time is slower
    assert max(narrow.busy.values()) < max(base.busy.values())


def test_sync_cuts_at_the_barrier_and_async_overlaps_training():
    cfg, sim = _cfg()
    a = run_sim(cfg, sim)
    s = run_sim(with_overrides(cfg, ["mode=sync"]), sim)
    assert s.staleness_mean == 0 and a.staleness_mean > 0
    assert s.step_s > a.step_s
    assert sum(s.trajectories["dropped"].values()) == 0
    for r in (a, s):  # every trajectory is accounted for
        t = r.trajectories
        assert t["started"] == t["trained"] + sum(t["dropped"].values())


def _engine(clock, chunk=8192):
    dev = DeviceModel(model_spec("dense-8b"), get_profile("H20"), 4)
    return SimEngine(clock, "e", dev, chunk, 256), dev


def test_an_engine_decodes_and_prefills_in_device_model_time():
    clock = Clock()
    engine, dev = _engine(clock)
    done = []
    engine.submit(False, 100, 1000, lambda: done.append(clock.now))
    clock.run(1e9, lambda: False)
    # one decode alone: 100 steps at its mid context, as the emulated engine times it
    assert done[0] == pytest.approx(100 * dev.decode_step_time([1000 + 50]), rel=1e-9)
    clock2 = Clock()
    engine2, dev2 = _engine(clock2, chunk=1000)
    engine2.submit(True, 2500, 0, lambda: done.append(clock2.now))
    clock2.run(1e9, lambda: False)
    chunks = [(1000, 0), (1000, 1000), (500, 2000)]
    assert done[1] == pytest.approx(sum(dev2.prefill_time(n, c) for n, c in chunks), rel=1e-9)
    assert engine2.busy_s == pytest.approx(done[1])


def test_an_arrival_cuts_a_decode_run_at_a_step_boundary():
    clock = Clock()
    engine, dev = _engine(clock)
    ends = {}
    engine.submit(False, 1000, 100, lambda: ends.setdefault("long", clock.now))
    clock.at(0.5, engine.submit, False, 10, 100, lambda: ends.setdefault("short", clock.now))
    clock.run(1e9, lambda: False)
    # the short request joined the batch and left it long before the long one ended
    assert ends["short"] < 1.0 < ends["long"]
    alone = 1000 * dev.decode_step_time([100 + 500])
    assert ends["long"] > alone  # sharing the engine made it slower


def test_turn_counts_have_the_configured_mean():
    import random

    rng = random.Random(0)
    tc = TurnCount(mean=2.3, max=5)
    draws = [tc.sample(rng) for _ in range(20000)]
    assert set(draws) == {2, 3}
    assert sum(draws) / len(draws) == pytest.approx(2.3, abs=0.02)


def test_shards_split_the_scheduler_load():
    cfg, _ = _cfg()
    one = run_sim(cfg, SimSettings(scheduler_us_per_task=500, driver_us_per_event=500))
    two = run_sim(cfg, SimSettings(scheduler_us_per_task=500, driver_us_per_event=500,
                                   shards=2))
    assert len(two.scheduler_busy) == 2 and all(b > 0 for b in two.scheduler_busy)
    assert max(two.scheduler_busy) < one.scheduler_busy[0]


def test_scaled_configs_grow_pools_and_batch():
    cfg, _ = _cfg()
    big = with_overrides(cfg, systems.scaled(cfg, 1024))
    assert 900 <= systems.gpus_of(big) <= 1100
    assert big.trainer.groups_per_step > cfg.trainer.groups_per_step
    workers, gpus = systems.monolithic_shape(big)
    assert gpus == max(p.gpus for p in big.cluster.pools if p.role.value == "inference")


def test_the_command_line_simulates_and_names_a_bad_key(tmp_path):
    out = tmp_path / "sim"
    r = subprocess.run([sys.executable, "flows/simulate.py", "--config", str(LONG_TAIL),
                        "--systems", "rollarc", "sync-monolithic", "--out", str(out),
                        "trainer.max_steps=2"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    results = json.loads((out / "simulate.json").read_text())
    assert set(results) == {"rollarc", "sync-monolithic"}
    assert results["rollarc"]["steps"] == 2
    bad = subprocess.run([sys.executable, "flows/simulate.py", "--config", str(LONG_TAIL),
                          "simulate.shardz=2"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "simulate.shardz" in bad.stderr
    with pytest.raises(ConfigError, match="simulate.turns.chess"):
        settings.load(LONG_TAIL, ["simulate.turns.chess={mean: 3}"])


def test_a_calibration_alone_simulates_a_config_with_what_a_bench_measured(tmp_path):
    """--config with --calibration: the calibration's host time per turn and per train step
    lengthen the steps of the devices alone (at the calibration's own time scale, where the host
    time is a large share of a turn); without a config or benches it names what it needs."""
    steps = {}
    for name, extra in (("plain", []),
                        ("calibrated", ["--calibration", str(DATA / "calibration-uniform-s0.json")])):
        r = subprocess.run([sys.executable, "flows/simulate.py", "--config", str(LONG_TAIL),
                            "--systems", "rollarc", "--out", str(tmp_path / name), *extra,
                            "trainer.max_steps=3", "engine.time_scale=0.05"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        steps[name] = json.loads((tmp_path / name / "simulate.json").read_text())["rollarc"]
    assert steps["calibrated"]["steps"] == steps["plain"]["steps"] == 3
    assert steps["calibrated"]["step_s"] > steps["plain"]["step_s"]
    alone = subprocess.run([sys.executable, "flows/simulate.py", "--calibration",
                            str(DATA / "calibration-uniform-s0.json")], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert alone.returncode == 2 and "--validate" in alone.stderr and "--config" in alone.stderr


@pytest.mark.long
def test_the_simulation_predicts_a_fresh_emulated_bench_run(tmp_path):
    """The real pipeline on emulated devices (flows/bench.py, a seed the stored calibration did
    not see) against the simulator's prediction from the stored calibration and the run's
    config alone, through the command line. Loose: a short run on a shared machine; the
    stored-run test in test_simulate_validation.py is the precise one."""
    out = tmp_path / "bench"
    r = subprocess.run([sys.executable, "flows/bench.py", "--workload", "uniform", "--sections",
                        "end_to_end", "--only", "sync-disaggregated", "--steps", "4", "--repeats", "1",
                        "--out", str(out), "--", "engine.time_scale=0.05", "seed=3"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    v = subprocess.run([sys.executable, "flows/simulate.py", "--calibration",
                        str(DATA / "calibration-uniform-s0.json"), "--validate", str(out),
                        "--out", str(tmp_path / "validation")], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert v.returncode == 0, v.stderr[-2000:]
    report = json.loads((tmp_path / "validation" / "validation.json").read_text())
    assert {rec["system"] for rec in report["records"]} == {"rollarc", "sync-disaggregated"}
    for rec in report["records"]:
        assert abs(rec["step_error"]) < 0.5, rec
        assert rec["devices_only_step_s"] < rec["simulated_step_s"]


def test_environment_failures_restart_or_drop_and_every_trajectory_is_counted():
    # a task per trajectory: a reset per start
    cfg, sim = _cfg("faults.env.crash_rate=0.1", "rollout.max_attempts=1",
                    "rollout.cohort_max=1")
    r = run_sim(cfg, sim)
    t = r.trajectories
    assert t["dropped"].get("rollout_error", 0) > 0
    assert t["started"] == t["trained"] + sum(t["dropped"].values())
    retried = run_sim(*_cfg("faults.env.crash_rate=0.1", "rollout.max_attempts=3",
                            "rollout.cohort_max=1"))
    # a failed trajectory restarts from a fresh environment and is dropped after its last
    # attempt (or when the run ends): a reset for every start, and with three attempts more
    # than one more for every one dropped
    assert r.tasks["env_reset"] == t["started"]
    rt = retried.trajectories
    assert rt["started"] == rt["trained"] + sum(rt["dropped"].values())
    assert retried.tasks["env_reset"] > rt["started"] + rt["dropped"]["rollout_error"]


def test_lambda_concurrency_throttles_and_cold_starts():
    # reward.min_batch=1: a burst of several finished trajectories goes out as several calls
    free = run_sim(*_cfg("simulate.lambda_concurrency=1000", "reward.min_batch=1"))
    tight = run_sim(*_cfg("simulate.lambda_concurrency=1", "reward.min_batch=1"))
    functions = len({lambda_function_of(settings.load(LONG_TAIL)[0].reward, t)
                     for t in settings.load(LONG_TAIL)[0].env_tasks})
    assert free.reward.get("throttles", 0) == 0 < tight.reward["throttles"]
    assert tight.reward["cold_starts"] == functions  # one instance per function, kept warm
    assert free.reward["cold_starts"] >= tight.reward["cold_starts"]


def test_a_failed_reset_ends_the_turn_there():
    """A trajectory whose environment failed to start neither prefills nor decodes: its turn
    ends at the reset (as the flow's later stages pass a member's error on)."""
    fine = run_sim(*_cfg("simulate.hours=0.02"))
    failing = run_sim(*_cfg("faults.env.crash_rate=0.99", "simulate.hours=0.02"))
    per_reset = failing.generated_tokens / failing.tasks["env_reset"]
    assert failing.tasks["env_reset"] > 100
    assert per_reset < 0.05 * fine.generated_tokens / fine.tasks["env_reset"]


def test_cohorts_run_one_task_per_stage_and_a_barrier_holds_members_for_their_mates():
    """rollout.cohort_max: turns ready together on the same workers go as one task per stage
    (one slot each). With the barrier a stage ends with its slowest member and the members go
    on together, turn after turn; without it members leave as they finish (the rest continued
    by collect tasks), so the cohorts break up into small tasks and no one waits for a mate."""
    single = run_sim(*_cfg("rollout.cohort_max=1"))
    assert single.tasks["decode"] == single.turns  # a task per trajectory and turn
    barrier = run_sim(*_cfg("rollout.cohort_max=16", "rollout.cohort_barrier=true"))
    free = run_sim(*_cfg("rollout.cohort_max=16", "rollout.cohort_barrier=false",
                         "rollout.cohort_grace_s=0.001"))
    assert barrier.tasks["decode"] < barrier.turns / 3  # cohorts formed and stayed together
    assert free.tasks["decode"] > 2 * barrier.tasks["decode"]
    for r in (barrier, free):
        t = r.trajectories
        assert t["started"] == t["trained"] + sum(t["dropped"].values())
    assert barrier.steady_step_s > 1.2 * max(free.steady_step_s, single.steady_step_s)
