"""The bench's lower bound (flows/benchmarks/bound.py) and the work it prices
(flows/benchmarks/work.py, TurnLog's turn work): the arithmetic on small hand-made runs."""

from __future__ import annotations

import pytest

from flows.benchmarks import bound
from flows.benchmarks.bound import Hardware, Pool
from flows.benchmarks.report import turn_overhead
from flows.benchmarks.work import RunWork, TrainedBatches, TrajectoryWork, Turn, run_work
from flows.config import load_config, with_overrides
from flows.training.episode import RolloutRecord
from flows.training.lifecycle import TrajectoryLedger, TrajState
from flows.training.turn_tasks import Cohort, TurnLog
from resources.catalog import get_profile
from resources.device_model import DeviceModel, model_spec
from tasks.records import EnvHandle, EnvObservation, TurnSample, TurnShape
from tests import ROOT

UNIFORM = ROOT / "config" / "bench" / "uniform.yaml"
H800, H20 = get_profile("H800"), get_profile("H20")
DENSE_8B = model_spec("dense-8b")


def _device(hw=H800, gpus=1, model=DENSE_8B) -> DeviceModel:
    return DeviceModel(model, hw, gpus)


def _hw(*pools: Pool, trainer: DeviceModel | None = None, time_shared=False, **kw) -> Hardware:
    return Hardware(list(pools), trainer or _device(gpus=2), time_shared, {}, **kw)


def _traj(key: str, *turns: Turn, reset_s: float = 0.0) -> TrajectoryWork:
    return TrajectoryWork(key, "game", list(turns), reset_s)


# -- one engine's best rates ---------------------------------------------------------------------


def test_prefill_is_priced_in_full_chunks_each_split_prefill_going_on_after_its_first_part():
    d = _device()
    got = bound.prefill_seconds(d, [(3000, 0), (3000, 500), (3000, 0)], chunk_tokens=4096)
    want = (d.mixed_batch_time([(3000, 0), (1096, 500)], 0, 0)
            + d.mixed_batch_time([(1904, 1596), (2192, 0)], 0, 0)
            + d.mixed_batch_time([(808, 2192)], 0, 0))
    assert got == pytest.approx(want)
    # short prefills: reading the weights once per full chunk beats a step for each
    short = [(50, 100)] * 30
    assert bound.prefill_seconds(d, short, 4096) < sum(d.prefill_time(n, c) for n, c in short)


def test_decode_runs_at_the_largest_batch_the_limits_allow():
    d = _device()
    turns = [Turn(prompt=200, cached=800, response=100)] * 64
    tokens, context = 6400, 64 * (100 * 1000 + 100 * 99 / 2)
    # memory is ample: the longest response sets the step count, all 64 in every step
    got = bound.decode_seconds(d, turns, chunk_tokens=8192, max_seqs=256)
    assert got == pytest.approx(100 * d.decode_batch_time(tokens / 100, context / 100))
    # max_seqs of 16: four times the steps, each a quarter as full
    capped = bound.decode_seconds(d, turns, chunk_tokens=8192, max_seqs=16)
    assert capped == pytest.approx(400 * d.decode_batch_time(16, context / 400))
    assert capped > got


def test_decode_steps_are_as_many_as_the_reserved_kv_needs():
    small = _device(model=model_spec("dense-32b"))  # 64 GB of weights on one 80 GB H800
    turns = [Turn(prompt=4000, cached=20000, response=500)] * 16
    reserved = 16 * 500 * (24000 + 500)
    steps = reserved / small.kv_capacity_tokens
    assert steps > 500  # the limit binds, not the response length
    tokens, context = 16 * 500, 16 * (500 * 24000 + 500 * 499 / 2)
    assert bound.decode_seconds(small, turns, 8192, 256) == pytest.approx(
        steps * small.decode_batch_time(tokens / steps, context / steps))


def test_fill_time_shares_a_job_between_pools_at_their_rates_after_their_delays():
    assert bound.fill_time([1 / 10, 1 / 30], [0.0, 0.0]) == pytest.approx(7.5)
    # the second pool starts late: the first does 2 s alone, then both share the rest
    assert bound.fill_time([1 / 10, 1 / 10], [0.0, 2.0]) == pytest.approx(6.0)
    # so late that the first finishes alone
    assert bound.fill_time([1 / 10, 1 / 10], [0.0, 20.0]) == pytest.approx(10.0)
    assert bound.fill_time([0.0], [0.0]) == float("inf")


def test_generation_is_shared_by_the_pools_each_doing_the_longer_of_its_two_shares():
    fast, slow = _device(H800), _device(H20, gpus=4)
    turns = [Turn(1500, 0, 600)] * 32
    pre = {d: bound.prefill_seconds(d, [(1500, 0)] * 32, 8192) for d in (fast, slow)}
    dec = {d: bound.decode_seconds(d, turns, 8192, 256) for d in (fast, slow)}
    one = bound.generation_seconds(_hw(Pool("h800", fast, 2, 8192, 256)), turns, 0)
    assert one == pytest.approx(max(pre[fast], dec[fast]) / 2)
    both = bound.generation_seconds(
        _hw(Pool("h800", fast, 1, 8192, 256), Pool("h20", slow, 3, 8192, 256)), turns, 0)
    shared = [1 / (1 / pre[fast] + 3 / pre[slow]), 1 / (1 / dec[fast] + 3 / dec[slow])]
    assert both == pytest.approx(max(shared))
    # weight loads hold every engine before it can take its share
    loaded = bound.generation_seconds(_hw(Pool("h800", fast, 2, 8192, 256)), turns, 3)
    assert loaded == pytest.approx(one + 3 * fast.weight_broadcast_time())


# -- the bound -----------------------------------------------------------------------------------


def _run() -> RunWork:
    a = _traj("0-0", Turn(1200, 0, 600, env_latency_s=2.0), Turn(150, 1800, 600, 2.0),
              reset_s=5.0)
    b = _traj("1-0", Turn(600, 0, 2000, env_latency_s=0.0))
    c = _traj("2-0", Turn(2000, 0, 800, 4.0), Turn(1500, 2800, 800, 4.0))
    return RunWork([[a, b], [c]])


def test_on_time_shared_gpus_generation_and_training_add():
    work = _run()
    mono = Pool("monolithic", _device(gpus=4), 2, 8192, 256)
    trainer = _device(gpus=8)
    shared = bound.bound_terms(work, _hw(mono, trainer=trainer, time_shared=True))
    apart = bound.bound_terms(work, _hw(mono, trainer=trainer))
    # the head's logits at the responses' tokens only
    train = [trainer.train_step_time([1200 + 600 + 150 + 600, 2600],
                                     loss_tokens=600 + 600 + 2000),
             trainer.train_step_time([2800 + 2300], loss_tokens=800 + 800)]
    generation = bound.generation_seconds(_hw(mono), [t for s in work.steps for x in s
                                                      for t in x.turns], 1)
    assert shared["generation + training"] == pytest.approx(generation + sum(train))
    assert apart["generation"] == pytest.approx(generation)
    assert apart["training"] == pytest.approx(sum(train))
    assert "generation" not in shared and "training" not in shared


def test_the_chain_is_the_trajectory_at_zero_queueing_then_the_steps_left_to_train():
    h800, h20 = _device(H800), _device(H20, gpus=4)
    hw = _hw(Pool("compute", h800, 1, 8192, 256), Pool("bandwidth", h20, 3, 8192, 256))
    turn = Turn(1500, 2800, 800, env_latency_s=4.0)
    options = []
    for p in (h800, h20):
        for d in (h800, h20):
            handoff = d.kv_transfer_time(1500) if d is not p else 0.0
            options.append(p.prefill_time(1500, 2800) + handoff
                           + 800 * d.decode_batch_time(1, 4300 + 799 / 2))
    assert bound.turn_chain_seconds(hw, turn) == pytest.approx(min(options) + 4.0)
    work = _run()
    a, b = work.steps[0]
    (c,) = work.steps[1]
    chain = {t.key: bound.chain_seconds(hw, t) for t in (a, b, c)}
    assert chain["0-0"] == pytest.approx(5.0 + sum(bound.turn_chain_seconds(hw, t)
                                                   for t in a.turns))
    train = [bound.train_seconds(hw, s) for s in work.steps]
    terms = bound.bound_terms(work, hw)
    assert terms["chain"] == pytest.approx(max(max(chain["0-0"], chain["1-0"]) + sum(train),
                                               chain["2-0"] + train[1]))
    # a reward model's prefill ends each chain
    judge = _device(H800)
    judged = _hw(*hw.inference, judge=judge)
    assert bound.chain_seconds(judged, c) == pytest.approx(chain["2-0"]
                                                           + judge.prefill_time(c.tokens))


def test_a_dedicated_reward_pool_must_prefill_every_trained_trajectory():
    work = _run()
    judge = _device(H800)
    hw = _hw(Pool("compute", _device(), 1, 8192, 256), judge=judge, judge_dedicated=True)
    lengths = [(t.tokens, 0) for t in work.trained]
    assert bound.bound_terms(work, hw)["reward pool"] == pytest.approx(
        bound.prefill_seconds(judge, lengths, bound.JUDGE_CHUNK_TOKENS))
    assert "reward pool" not in bound.bound_terms(work, _hw(*hw.inference, judge=judge))


def test_a_config_gives_its_pools_trainer_and_time_sharing():
    cfg = load_config(UNIFORM)
    hw = bound.hardware(cfg)
    assert [(p.name, p.engines, p.device.gpus, p.device.hw.name) for p in hw.inference] == [
        ("compute", 1, 1, "H800"), ("bandwidth", 3, 4, "H20")]
    assert hw.trainer.gpus == 2 and not hw.time_shared
    mono = bound.hardware(with_overrides(cfg, ["placement=monolithic",
                                               "cluster.monolithic_workers=2",
                                               "cluster.monolithic_gpus=4"]))
    assert [(p.engines, p.device.gpus) for p in mono.inference] == [(2, 4)]
    assert mono.trainer.gpus == 8 and mono.time_shared
    result = bound.lower_bound(_run(), cfg)
    assert result["bound_s"] == max(result["terms_s"].values()) > 0
    assert result["binding"] in result["terms_s"]


# -- the work a run did --------------------------------------------------------------------------


def _turn_work(traj: str, turn: int, prompt: int, cached: int, response: int) -> dict:
    return {"trajectory": traj, "turn": turn, "env_task": "game", "prompt_tokens": prompt,
            "cached_tokens": cached, "response_tokens": response, "env_latency_s": 1.0}


def test_the_work_holds_each_trained_trajectorys_last_attempt_by_step():
    stream = {"tasks": [["env_reset-3-0-1@r", "w", 10.0, 11.0],
                        ["env_reset-c4-2-0@r", "w", 10.0, 12.0]],
              "turn_work": [_turn_work("3-0", 0, 100, 0, 50), _turn_work("3-1", 1, 20, 150, 50),
                            _turn_work("3-1", 0, 100, 0, 50), _turn_work("5-0", 0, 80, 0, 40),
                            _turn_work("6-0", 0, 70, 0, 10)]}
    work = run_work(stream, time_scale=0.5, trained_steps=[[3], [5]])
    assert [[t.key for t in s] for s in work.steps] == [["3-1"], ["5-0"]]
    (t3,) = work.steps[0]
    assert [(x.prompt, x.cached) for x in t3.turns] == [(100, 0), (20, 150)]  # in turn order
    assert t3.reset_s == pytest.approx(2.0)  # 1 s of wall at time scale 0.5
    assert work.trained_tokens == 220 + 120
    assert work.untrained_tokens == 150 + 80  # the first attempt of 3, and 6
    unknown = run_work(stream, 0.5, None)
    assert not unknown.complete and len(unknown.trained) == 4


def test_trained_batches_are_told_apart_by_the_transitions_between_them():
    batches = TrainedBatches()
    ledger = TrajectoryLedger(on_transition=batches)
    for tid in range(6):
        ledger.admit(tid)
        for state in (TrajState.ROLLING_OUT, TrajState.AWAITING_SCORE, TrajState.SCORING,
                      TrajState.IN_GROUP):
            ledger.transition(tid, state)
    for batch in ([0, 1], [2, 3, 4]):
        for tid in batch:
            ledger.transition(tid, TrajState.TRAINING)
        for tid in batch:
            ledger.transition(tid, TrajState.TRAINED)
    ledger.admit(7, evaluation=True)
    assert batches.steps == [[0, 1], [2, 3, 4]]


def test_the_turn_log_keeps_each_turns_submitted_lengths_and_environment_latency():
    env_task = load_config(UNIFORM).env_tasks[1]
    rec = RolloutRecord(7, "g", env_task, seed=3, attempt=1)
    log = TurnLog(keep_each=True, time_scale=0.2)
    cohort = Cohort([7], "7-0-1", 0.0, None, None, frozenset(), env_task.name)
    for turn, (shape, latency) in enumerate([(TurnShape(1500, 600), 2.0),
                                             (TurnShape(250, 500), 3.5)]):
        rec.last_shape = shape
        sample = TurnSample([1, 2], [0.0, 0.0], [0, 0], "ab", True, False, 2,
                            virtual_tokens=shape.prompt_tokens + shape.response_tokens)
        obs = EnvObservation(EnvHandle("w", "i"), "obs", [5], info={"remote_latency_s": latency},
                             sample=sample, consumed_ids=[4, 4, 4])
        log.record(rec, obs, cohort, now=1.0 + turn, suffixes=[cohort.suffix])
        rec.record_turn(obs)
    first, second = log.work
    assert (first.trajectory, first.turn, first.env_task) == ("7-1", 0, env_task.name)
    assert (first.prompt_tokens, first.cached_tokens, first.response_tokens) == (1500, 0, 600)
    assert (second.prompt_tokens, second.cached_tokens, second.response_tokens) == (250, 2100,
                                                                                    500)
    assert (first.env_latency_s, second.env_latency_s) == (2.0, 3.5)
    assert len(log.each) == 2
    quiet = TurnLog(keep_each=False, time_scale=0.2)
    quiet.record(rec, obs, cohort, now=3.0, suffixes=[cohort.suffix])
    assert quiet.work == [] and quiet.totals[0] == 1


def test_a_continued_members_turn_counts_the_tasks_of_every_cohort_it_went_through():
    """Left running in cohort c1's decode and continued by c2: its turn's compute is c1's
    chain and c2's, not c2's alone (which would book c1's compute as orchestration)."""
    stream = {"tasks": [["prefill-c1-2-0", "a", 0.0, 1.0], ["decode-c1-2-0", "b", 1.0, 3.0],
                        ["env_step-c1-2-0", "c", 3.0, 3.5], ["decode-c2-1-0", "b", 4.0, 6.0],
                        ["env_step-c2-1-0", "c", 6.0, 7.0]],
             "turns": [["c1-2-0", 0.0, 4.0, 0.0, "1-0"],
                       ["c1-2-0+c2-1-0", 0.0, 8.0, 0.0, "2-0"]]}
    over = turn_overhead(stream)
    # compute: 3.5 s for the first member, 3.5 + 3.0 for the second; wall 4 + 8
    assert over["orchestration_ms"] == pytest.approx(1e3 * ((4 - 3.5) + (8 - 6.5)) / 2)
