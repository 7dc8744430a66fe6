"""The run's small parts that hold state without Dask: the training clock, the evaluation
rounds and the interrupt's deferral."""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest

from flows.config import load_config
from flows.training.evaluation import Evaluator
from flows.training.events import RunClock
from flows.training.stopping import interrupts_between_batches
from tasks.records import Trajectory


def test_the_training_clock_leaves_out_the_pauses_and_adds_the_time_resumed_from(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    clock = RunClock()
    assert clock.elapsed_s == 0.0  # not started
    clock.before_s = 100.0  # a resumed run's time so far
    clock.start()
    now[0] += 5  # training
    clock.pause()
    now[0] += 60  # between train() calls: not training time
    assert clock.elapsed_s == 105.0  # stands still while paused
    clock.start()
    now[0] += 2
    assert clock.elapsed_s == 107.0


def _episode(tid: int, env: str, success: bool, version: int) -> Trajectory:
    return Trajectory(
        traj_id=str(tid), group_id="eval0", env_name=env, seed=0, token_ids=np.arange(3),
        loss_mask=np.array([False, True, True]), behaviour_logprobs=np.zeros(3, np.float32),
        versions=np.array([-1, version, version]), env_rewards=[float(success)], responses=[],
        info={"success": success}, num_turns=1, truncated=False, context_truncated=False)


def test_an_evaluation_round_reports_once_all_its_episodes_ended_failed_ones_counted():
    tasks = load_config().env_tasks
    ev = Evaluator(tasks, every_steps=5, episodes=2, max_steps=12)
    assert [v for v in range(1, 13) if ev.due(v)] == [5, 10, 12]  # and after the last step
    specs = ev.start(5)
    assert len(specs) == 2 * len(tasks) and len({s.seed for s in specs}) == 2
    assert {s.round_id for s in specs} == {0}
    *first, last = specs
    assert all(ev.on_episode(0, None if i == 0 else _episode(i, s.env_task.name, True, 4))
               is None for i, s in enumerate(first))
    metrics = ev.on_episode(0, _episode(99, last.env_task.name, False, 5))
    assert metrics["eval/step"] == 5 and metrics["eval/failed"] == 1
    assert metrics["eval/policy_version_oldest"] == 4  # episodes ran on older weights
    assert ev.last is metrics and ev.start(10)[0].round_id == 1


def test_an_interrupt_while_training_waits_for_the_loop_and_a_second_one_does_not():
    asked = []
    before = signal.getsignal(signal.SIGINT)
    term = signal.getsignal(signal.SIGTERM)
    with interrupts_between_batches(lambda: asked.append(1)):
        signal.raise_signal(signal.SIGINT)  # Ctrl-C: the loop is asked, nothing raised here
        assert asked == [1]
        if not callable(term):  # a SIGTERM left to the OS (or ignored) stays so
            assert signal.getsignal(signal.SIGTERM) == term
        with pytest.raises(KeyboardInterrupt):  # Ctrl-C again: at once, as Python does
            signal.raise_signal(signal.SIGINT)
    assert asked == [1]
    assert signal.getsignal(signal.SIGINT) is before and signal.getsignal(signal.SIGTERM) == term
    # a notebook that trains from another thread: signals are the main thread's, left alone
    seen = []

    def train_in_a_thread():
        with interrupts_between_batches(lambda: None):
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=train_in_a_thread)
    thread.start()
    thread.join()
    assert seen == [before]
