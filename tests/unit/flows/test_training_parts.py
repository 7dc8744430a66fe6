"""The run's small parts that hold state without Dask: the training clock and the evaluation
rounds."""

from __future__ import annotations

import time

import numpy as np

from flows.config import load_config
from flows.training.evaluation import Evaluator
from flows.training.events import RunClock
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
