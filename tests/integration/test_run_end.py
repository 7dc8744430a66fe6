"""The end of a run is bounded: after the last train step, work that cannot finish is cancelled
within ``rollout.end_timeout_s`` and accounted; a future given up on that never comes back is
not waited on."""

from __future__ import annotations

import asyncio
import gc
import logging
import operator
import os
import time
import warnings
from pathlib import Path

import pytest
from distributed import Client, Event, LocalCluster

from flows.api import run_training
from flows.config import load_config
from flows.training import events
from flows.training.events import EventLoop, FutureKind
from flows.training.lifecycle import TrajState
from resources.placement import install_recorder, placement_snapshot
from tasks.env_steps import env_step
from tasks.stages import Stages
from tasks.trainer import train_step
from tests import NO_PICTURES, QUIET

IN_PROCESS = [*QUIET, "cluster.processes=false", *NO_PICTURES]
STEPS = 2


class LastStepMarks:
    """A train step that leaves a marker file as it starts the last step. The trajectories
    admitted when that step's batch was cut are then rolling out, so some of their turns meet
    the marker: marking the step's end instead would leave none when they all finished during
    the step (a slow train step on a busy machine)."""

    def __init__(self, marker: Path, last: int):
        self.marker, self.last = str(marker), last

    def __call__(self, trainer, batch):
        if batch.policy_version + 1 >= self.last:
            Path(self.marker).write_text("training the last step")
        return train_step(trainer, batch)


class HangsAfter:
    """Environment steps that stop answering once the marker exists, until ``seconds`` after
    it was written: work still in flight after the last step that cannot finish in time. Every
    step held answers by the same moment (a cohort's members run one after another, so a
    sleep of its own each would keep the environment worker busy for members x seconds)."""

    def __init__(self, marker: Path, seconds: float):
        self.marker, self.seconds = str(marker), seconds

    def __call__(self, registry, tokenizer, prev, sample):
        try:
            until = os.path.getmtime(self.marker) + self.seconds
        except FileNotFoundError:
            until = 0.0
        time.sleep(max(0.0, until - time.time()))
        return env_step(registry, tokenizer, prev, sample)


def test_work_that_cannot_finish_after_the_last_step_is_cut_at_end_timeout(tmp_path):
    """Turns that stop answering after the last step (the turn watchdog is 300 s away) are
    cancelled after rollout.end_timeout_s: the run returns, every trajectory is accounted
    for, the cut ones dropped as run_ended with the reason, no environment left open."""
    marker = tmp_path / "trained"
    cfg = load_config(overrides=[*IN_PROCESS, f"trainer.max_steps={STEPS}", "reward.backend=local",
                                 "trainer.groups_per_step=2", "rollout.end_timeout_s=2",
                                 "rollout.turn_timeout_s=300"])
    stages = Stages(train_step=LastStepMarks(marker, STEPS), env_step=HangsAfter(marker, 8))
    drops: list[tuple[str, str]] = []

    def on_transition(t, _ledger) -> None:
        if t.new is TrajState.DROPPED:
            drops.append((str(t.reason), t.detail))

    summary = run_training(cfg, tmp_path / "run", stages=stages, on_transition=on_transition,
                           dashboard=lambda line: None)
    t = summary["trajectories"]
    assert summary["policy_version"] == STEPS
    assert t["started"] == t["trained"] + sum(t["dropped"].values())
    assert summary["live_env_instances_at_end"] == 0
    cut = [reason for reason, detail in drops if "rollout.end_timeout_s" in detail]
    assert cut and set(cut) == {"run_ended"}


@pytest.fixture(scope="module")
def client():
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as lc, Client(lc) as c:
        yield c


def test_a_future_forgotten_is_handed_out_as_lost_and_no_longer_waited_on(client):
    """A task pinned to a worker that is gone never runs (Dask's no-worker state, no error):
    forgotten, it comes out once as an event without a result, and the loop is empty."""
    loop = EventLoop(client)
    stuck = loop.track(client.submit(sum, [1, 2], workers=["tcp://127.0.0.1:1"],
                                     allow_other_workers=False, pure=False), FutureKind.TURN)
    done = loop.track(client.submit(sum, [3, 4], pure=False), FutureKind.SCORE)
    done.result(timeout=30)
    events = loop.next_batch(wake=lambda: False)
    assert [(e.kind, e.result) for e in events] == [(FutureKind.SCORE, 7)]
    assert not loop.empty() and loop.pending_kinds() == {"turn": 1}
    [lost] = loop.forget([stuck.key, "never-tracked"])
    assert (lost.kind, lost.future, lost.result, lost.ok) == (FutureKind.TURN, stuck, None,
                                                              False)
    assert loop.empty() and loop.forget([stuck.key]) == []
    client.cancel([stuck])  # its cancellation arriving late is ignored
    assert loop.next_batch(wake=lambda: True) == []


def test_finished_failed_and_cancelled_futures_each_come_back_once(client):
    """Each tracked future is handed out once, whatever its end: a result, an error (no
    result, status error), a cancellation (no result, status cancelled)."""
    loop = EventLoop(client)
    ok = loop.track(client.submit(sum, [1, 2], pure=False), FutureKind.TURN)
    bad = loop.track(client.submit(operator.truediv, 1, 0, pure=False), FutureKind.SCORE)
    slow = loop.track(client.submit(time.sleep, 3, pure=False), FutureKind.TRAIN)
    client.cancel([slow])
    seen: list = []
    deadline = time.monotonic() + 30
    while len(seen) < 3 and time.monotonic() < deadline:
        seen += loop.next_batch(wake=lambda: time.monotonic() > deadline)
    by_key = {ev.future.key: ev for ev in seen}
    assert len(seen) == len(by_key) == 3 and loop.empty()
    assert (by_key[ok.key].result, by_key[ok.key].ok) == (3, True)
    assert (by_key[bad.key].result, by_key[bad.key].future.status) == (None, "error")
    assert (by_key[slow.key].result, by_key[slow.key].future.status) == (None, "cancelled")
    assert loop.next_batch(wake=lambda: True) == []


def test_a_gather_that_swallows_its_cancellation_does_not_hold_the_driver(client, monkeypatch):
    """A gather from a worker going away once ignored the cancellation of its time limit and held
    a run for good. The limit is the driver's own: past it, the results are fetched one by one
    and the batch comes back."""
    monkeypatch.setattr(events, "GATHER_TIMEOUT_S", 1)

    async def deaf_gather(futures, **_):
        end = asyncio.get_running_loop().time() + 8
        while asyncio.get_running_loop().time() < end:
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                pass  # swallowed
        return [None] * len(futures)

    loop = EventLoop(client)
    fut = loop.track(client.submit(sum, [1, 2], pure=False), FutureKind.TURN)
    fut.result(timeout=30)
    monkeypatch.setattr(client, "gather", deaf_gather)
    t0 = time.monotonic()
    [event] = loop.next_batch(wake=lambda: False)
    assert time.monotonic() - t0 < 5
    assert (event.kind, event.result) == (FutureKind.TURN, 3)


def test_a_gather_given_up_on_leaves_no_error_behind_when_its_futures_are_cancelled(
        client, monkeypatch, caplog):
    """A result lost while the driver gathers it keeps the gather waiting until the driver
    gives up on it and cancels the future. Dask's gather then leaves a wait per future behind;
    gathered with errors="raise", each raised AllExit as its future was cancelled, which asyncio
    logged as an ERROR with a traceback ("Task exception was never retrieved") in a run that
    had handled the loss."""
    monkeypatch.setattr(events, "GATHER_TIMEOUT_S", 0.5)
    loop = EventLoop(client)
    fut = loop.track(client.submit(sum, [1, 2], pure=False), FutureKind.TURN)
    fut.result(timeout=30)
    gate = Event(f"gate-{time.monotonic_ns()}", client=client)
    lost = client.submit(gate.wait, 60, pure=False)  # pending: what a lost result looks like
    real_gather = client.gather

    def gather_the_lost_one(futures, **kwargs):
        return real_gather([lost], **kwargs)

    monkeypatch.setattr(client, "gather", gather_the_lost_one)
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        [event] = loop.next_batch(wake=lambda: False)
        assert (event.kind, event.result) == (FutureKind.TURN, 3)  # fetched one by one
        client.cancel([lost])
        gate.set()
        deadline = time.monotonic() + 3  # the old gather's error came within a second
        while time.monotonic() < deadline and not caplog.records:
            gc.collect()  # asyncio logs an unretrieved exception when its task is collected
            time.sleep(0.2)
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


def test_a_result_lost_during_the_gather_leaves_the_batch_s_other_results_gathered_once(
        client, monkeypatch, caplog):
    """A future that finished, then was lost while the batch was being gathered (cancelled
    here, as when its worker dies), comes back without a result, logged with its state; the
    rest of the batch keeps the results of that one gather. Gathered as a list, Dask leaves a
    skipped future out, so the results no longer lined up with the batch and every future of
    it was fetched again, one by one."""
    loop = EventLoop(client)
    futs = [loop.track(client.submit(operator.add, i, 1, pure=False), FutureKind.TURN)
            for i in range(4)]
    client.gather(futs)
    # the loop hears of each finished future from Dask's callback thread, which may still be
    # running after the gather: one batch of all four needs all four heard of
    with loop.condition:
        assert loop.condition.wait_for(lambda: len(loop._done) == len(futs), timeout=30)
    victim, real_gather = futs[2], client.gather

    def gather_after_a_loss(futures, **kwargs):
        client.cancel([victim])
        return real_gather(futures, **kwargs)

    fetched_one_by_one = []
    real_result = type(victim).result

    def result(self, *args, **kwargs):
        fetched_one_by_one.append(self.key)
        return real_result(self, *args, **kwargs)

    monkeypatch.setattr(client, "gather", gather_after_a_loss)
    monkeypatch.setattr(type(victim), "result", result)
    with caplog.at_level(logging.WARNING, logger=events.__name__):
        batch = loop.next_batch(wake=lambda: False)
    assert {e.future.key: e.result for e in batch} == {
        f.key: (None if f is victim else i + 1) for i, f in enumerate(futs)}
    assert not fetched_one_by_one
    assert [r.getMessage() for r in caplog.records] == [f"result of {victim.key} lost (cancelled)"]


def test_a_later_run_on_the_same_cluster_gets_a_fresh_placement_recorder_without_a_warning(
        client):
    """Each run installs the recorder of where its tasks ran; a second run on one cluster (a
    notebook's, a long-lived ``dask scheduler``'s) replaced the first's with Dask's UserWarning
    "already contains a plugin ... overwriting". The earlier one is now removed first."""
    install_recorder(client)
    client.submit(sum, [1, 2], pure=False, key=f"prefill-{time.monotonic_ns()}").result(30)
    [worker] = client.scheduler_info()["workers"]
    assert client.run_on_scheduler(placement_snapshot) == {"prefill": {worker: 1}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        install_recorder(client, stream=True)
    assert not [w for w in caught if "plugin" in str(w.message)]
    assert client.run_on_scheduler(placement_snapshot) == {}  # the new run's counts only


def test_a_result_lost_with_its_worker_while_gathered_is_not_waited_for(client, monkeypatch):
    """A future that finished, then lost its result with its worker as the driver gathered it:
    Dask's gather marks it lost and waits for it to be computed again, which a task
    pinned to the worker that left never is. The batch comes back at once, that event
    without a result (its handler sees it lost), instead of after the gather's time limit."""
    from distributed import Worker

    async def start_worker():
        return await Worker(client.scheduler.address, nthreads=1)

    worker = client.sync(start_worker)
    loop = EventLoop(client)
    fut = loop.track(client.submit(operator.add, 1, 1, workers=[worker.address],
                                   allow_other_workers=False, pure=False), FutureKind.TURN)
    fut.result(timeout=30)
    with loop.condition:
        assert loop.condition.wait_for(lambda: loop._done, timeout=30)
    real_gather = client.gather

    def gather_after_the_loss(futures, **kwargs):
        client.sync(worker.close)
        deadline = time.monotonic() + 30
        while fut.status == "finished" and time.monotonic() < deadline:
            time.sleep(0.01)  # Dask tells the client the result is lost
        return real_gather(futures, **kwargs)

    monkeypatch.setattr(client, "gather", gather_after_the_loss)
    t0 = time.monotonic()
    [event] = loop.next_batch(wake=lambda: False)
    assert time.monotonic() - t0 < events.GATHER_TIMEOUT_S / 2
    assert (event.kind, event.result) == (FutureKind.TURN, None)
    assert event.future.status == "lost"
    client.cancel([fut])
