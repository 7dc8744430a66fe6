"""A train step's critical path: from a hand-made task stream and turn timings, from the driver's
timings alone, bounded records, the summary's reading and rendering, and the dashboard page."""

from __future__ import annotations

import json

import pytest

from flows.monitoring.critical_path import (
    Category,
    RunShape,
    StepLog,
    TurnTiming,
    TurnTimings,
    breakdowns,
    markdown,
    step_breakdown,
)
from flows.monitoring.dashboard_page import RollArcPage
from flows.monitoring.records import RecordKind, RunRecords
from resources.catalog import CATALOG
from resources.emulated import emulated_backend
from tasks.records import EnvHandle, EnvObservation, SamplingParams, TurnSample, TurnShape
from tasks.specs import PolicySpec

POOLS = {"wc": "compute", "wb": "bandwidth", "we": "env", "wt": "trainer", "wr": "reward"}
TAG = "@t"


def shape(sync: bool = False) -> RunShape:
    return RunShape(POOLS, "trainer", "reward", sync)


def turn(n, submitted, answered, legs, prefill=0.0, kv=0.0, decode=0.0, env=0.0):
    return TurnTiming(n, submitted, answered, ("we", "wc", "wb"), legs, prefill, kv, decode, env)


# two trajectories; "1-0" finished its only turn at 4.0, "0-0" its second at 8.0: it gates
# the cut. Its second turn's decode was left running by cohort c1 and collected by c2.
TURNS = {
    "0-0": [turn(0, 0.0, 4.0, ((f"c0-2-0{TAG}", None),), prefill=0.3, kv=0.5, decode=1.2,
                 env=0.9),
            turn(1, 4.1, 8.0, ((f"c1-1-0{TAG}", "decode"), (f"c2-1-0{TAG}", None)),
                 prefill=0.3, decode=2.0, env=0.8)],
    "1-0": [turn(0, 0.0, 4.0, ((f"c0-2-0{TAG}", None),))],
}
STREAM = [
    (f"env_reset-c0-2-0{TAG}", "we", 0.1, 0.5), (f"prefill-c0-2-0{TAG}", "wc", 0.6, 1.0),
    (f"decode-c0-2-0{TAG}", "wb", 1.1, 3.0), (f"env_step-c0-2-0{TAG}", "we", 3.0, 3.9),
    (f"score-0{TAG}", "wr", 4.2, 4.4),
    (f"prefill-c1-1-0{TAG}", "wc", 4.2, 4.6), (f"decode-c1-1-0{TAG}", "wb", 4.7, 5.0),
    # passes the running member through: not on its path
    (f"env_step-c1-1-0{TAG}", "we", 5.0, 5.05),
    (f"decode-c2-1-0{TAG}", "wb", 5.2, 7.0), (f"env_step-c2-1-0{TAG}", "we", 7.0, 7.8),
    (f"score-1{TAG}", "wr", 8.3, 9.5),
    (f"train_step-0{TAG}", "wt", 9.7, 11.8),
]


def one_step(cut=9.6, end=12.0) -> StepLog:
    log = StepLog()
    log.cut(1, ["1-0", "0-0"], cut)
    log.trained(end)
    return log


def test_a_hand_made_stream_gives_the_split_and_the_bottleneck():
    (step,) = breakdowns(one_step(), TURNS.get, shape(), run_start=0.0, tasks=STREAM)
    assert step["step"] == 1 and step["seconds"] == pytest.approx(12.0)
    assert step["gating_trajectory"] == "0-0" and step["gating_turns"] == 2
    assert step["source"] == "task_stream"
    expected = {"prefill": 0.8, "decode": 3.7, "kv_transfer": 0.5, "env": 2.1, "reward": 1.2,
                "train": 2.1, "queue": 0.9, "orchestration": 0.7}
    assert step["categories"] == pytest.approx(expected)
    assert sum(step["categories"].values()) == pytest.approx(step["seconds"])
    # decode, its KV hand-off and the queueing before its two decode tasks
    assert step["pools"]["bandwidth"] == pytest.approx(4.4)
    assert step["bottleneck"] == "bandwidth"


def test_without_a_stream_the_turns_own_measurements_split_them():
    (step,) = breakdowns(one_step(), TURNS.get, shape(), run_start=0.0)
    assert step["source"] == "driver"
    cats = step["categories"]
    assert cats["prefill"] == pytest.approx(0.6) and cats["kv_transfer"] == pytest.approx(0.5)
    assert cats["decode"] == pytest.approx(3.2) and cats["env"] == pytest.approx(1.7)
    # scoring waits until the cut, the train step from the cut to its end
    assert cats["reward"] == pytest.approx(1.6) and cats["train"] == pytest.approx(2.4)
    # what the turns' own measurements leave, at no pool; the driver's turnaround
    assert cats["unsplit"] == pytest.approx(1.9) and cats["orchestration"] == pytest.approx(0.1)
    assert sum(cats.values()) == pytest.approx(12.0)
    assert step["pools"]["unattributed"] == pytest.approx(1.9)
    assert step["bottleneck"] == "bandwidth"
    # a real engine measures no device waits: a turn is its environment step and unsplit
    real = {k: [TurnTiming(t.turn, t.submitted, t.answered, t.workers, t.legs, 0.0, 0.0, 0.0,
                           t.env_s) for t in ts] for k, ts in TURNS.items()}
    (step,) = breakdowns(one_step(), real.get, shape(), run_start=0.0)
    assert not {"prefill", "decode", "kv_transfer"} & set(step["categories"])
    assert step["categories"]["unsplit"] == pytest.approx(7.9 - 1.7)
    assert step["bottleneck"] == "trainer"  # unsplit time is never the bottleneck


def test_a_batch_ready_before_the_step_began_is_trainer_bound():
    log = StepLog()
    log.cut(1, ["1-0"], 4.5)
    log.trained(20.0)
    log.cut(2, ["0-0"], 20.01)  # its trajectories finished long before
    log.trained(30.0)
    stream = [*STREAM, (f"train_step-1{TAG}", "wt", 20.02, 29.99)]
    second = breakdowns(log, TURNS.get, shape(), run_start=0.0, tasks=stream)[-1]
    assert second["seconds"] == pytest.approx(10.0)
    assert second["bottleneck"] == "trainer"
    assert second["categories"]["train"] == pytest.approx(9.97)
    assert not {"decode", "prefill", "env", "reward"} & set(second["categories"])


def test_sync_admission_waits_for_the_weight_sync():
    late = {"0-0": [turn(0, 5.0, 8.0, ((f"c9-1-0{TAG}", None),), decode=3.0)]}
    log = StepLog()
    log.cut(1, [], 1.0)
    log.trained(2.0)
    log.cut(2, ["0-0"], 8.5)
    log.trained(10.0)
    weights = [(f"publish_weights-1-0{TAG}", "wt", 2.1, 2.5),
               (f"load_weights-1-0-wb{TAG}", "wb", 2.6, 4.8)]
    with_stream = breakdowns(log, late.get, shape(sync=True), 0.0, tasks=weights)[-1]
    assert with_stream["categories"]["weight_sync"] == pytest.approx(2.6)
    assert with_stream["pools"]["bandwidth"] >= 2.2
    driver_only = breakdowns(log, late.get, shape(sync=True), 0.0)[-1]
    assert driver_only["categories"]["weight_sync"] == pytest.approx(3.0)


def test_records_are_bounded_and_keep_a_members_cohorts():
    timings = TurnTimings(keep=2)
    sample = TurnSample([1], [0.0], [0], "a", True, False, 1, emulated_wait_s=1.0,
                        prefill_wait_s=0.25, kv_transfer_s=0.25)
    obs = EnvObservation(EnvHandle("we", "i"), "", [], sample=sample, step_seconds=0.5)
    timings.deferred("7-0", "c1-2-0", "decode")
    timings.turn("7-0", 0, 0.0, 2.0, ("we", "wc", "wb"), "c2-1-0", obs)
    (t,) = timings.of("7-0")
    assert t.legs == (("c1-2-0", "decode"), ("c2-1-0", None))
    assert (t.prefill_s, t.kv_s, t.decode_s, t.env_s) == (0.25, 0.25, 0.5, 0.5)
    for tid in ("8-0", "9-0"):
        timings.turn(tid, 0, 0.0, 1.0, ("we", "wc", "wb"), "x", obs)
    assert timings.of("7-0") is None and timings.of("9-0") is not None
    log = StepLog(keep=3)
    for k in range(5):
        log.cut(k + 1, [], float(k))
        log.trained(k + 0.5)
    assert [s.step for s in log.steps] == [3, 4, 5] and log.steps[0].after == 1.5


def test_an_emulated_turn_measures_its_prefill_and_kv_hand_offs():
    """What a turn's sample carries for the driver: the prefill's wait and the KV hand-offs',
    parts of its emulated wait; no hand-off when prefill and decode share the engine."""
    made = [emulated_backend(PolicySpec(device="cpu"), max_batch=4, hardware=CATALOG[hw],
                             time_scale=0.01, engine_id=hw) for hw in ("H800", "H20")]
    compute, bandwidth = made
    shape, params = TurnShape(prompt_tokens=4000, response_tokens=50), SamplingParams(4)
    try:
        for prefill_on, split in ((compute, True), (bandwidth, False)):
            pre = prefill_on.prefill(None, [1, 2, 3], shape=shape)
            s = bandwidth.decode(pre, None, params, seed=0, shape=shape).sample
            assert s.prefill_wait_s > 0
            assert (s.kv_transfer_s > 0) is split
            assert s.prefill_wait_s + s.kv_transfer_s < s.emulated_wait_s
    finally:
        for backend in made:
            backend.close()


def test_the_summary_is_read_in_emulated_seconds_and_rendered(tmp_path):
    (step,) = breakdowns(one_step(), TURNS.get, shape(), run_start=0.0, tasks=STREAM)
    (tmp_path / "summary.json").write_text(json.dumps(
        {"critical_path": {"time_scale": 0.5, "steps": [step]}}))
    (read,) = step_breakdown(tmp_path)
    assert read["seconds"] == pytest.approx(24.0)
    assert read["categories"]["decode"] == pytest.approx(7.4)
    assert step_breakdown(tmp_path, emulated=False)[0]["seconds"] == pytest.approx(12.0)
    table = markdown([read])
    header, _rule, row = table.splitlines()
    assert "kv_transfer" in header and "unsplit" not in header
    assert "bandwidth (37%)" in row and "0-0 (2 turns)" in row and "24.00" in row


def test_the_dashboard_page_shows_the_latest_steps_path():
    (step,) = breakdowns(one_step(), TURNS.get, shape(), run_start=0.0, tasks=STREAM)
    records = RunRecords()
    page = RollArcPage(lambda: records)
    records.on_record({"kind": RecordKind.RUN_START, "run_id": "r", "time": 0.0,
                       "env_tasks": ["frozenlake"], "worker_pool": POOLS})
    page.update()
    assert "No step trained yet" in page.path_table.text
    records.on_record({"kind": RecordKind.LIVE, "live": {"critical_path": step}})
    page.update()
    text = page.path_table.text
    assert "Critical path of step 1: 12.00 s" in text
    assert "<b>bandwidth</b>" in text and "0-0" in text and "bandwidth 4.40 s" in text
    for category in step["categories"]:
        assert f"> {category}</td>" in text
    assert str(Category.KV_TRANSFER) in text
