"""Faults on a real local cluster: a worker of each pool is killed (SIGKILL) in the middle of a
run, its Nanny starts it again under a new address, and the run reaches its final step with
every trajectory trained or dropped with its reason; a worker joining mid-run loads the current
weights before it gets work. One shared cluster of worker processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections import Counter

import pytest

from flows.api import RunStatus, Session
from flows.training.lifecycle import DropReason, TrajState
from flows.training.run import PoolLost
from resources.cluster import WORKER_ENV
from resources.placement import placement_snapshot
from resources.pools import Tag
from tests import SMALL

pytestmark = pytest.mark.integration

STEPS = 4


@pytest.fixture(scope="module")
def session():
    # a stuck worker (no heartbeat) is restarted within 2 x 20 s
    s = Session.start(overrides=[*SMALL, "cluster.dashboard_port=0", "cluster.worker_ttl_s=20"])
    yield s
    s.close()


def _kill_at_cut(run, tag: Tag, step: int) -> dict:
    """SIGKILL the (first) worker advertising ``tag`` when the batch of ``step`` is cut: the
    middle of the run, with turns, scores and the train step in flight."""
    cluster = run.session.cluster
    worker = cluster.workers_with(tag)[0]
    pid = run.session.client.run(os.getpid, workers=[worker])[worker]
    killed = {}

    def kill(train_step: int, _trajectories) -> None:
        if train_step == step and not killed:
            os.kill(pid, signal.SIGKILL)
            killed.update(worker=worker, pid=pid)

    run.on_batch(kill)
    return killed


def _accounts_close(summary: dict, steps: int = STEPS) -> dict:
    t = summary["trajectories"]
    assert summary["policy_version"] == steps
    assert t["started"] == t["trained"] + sum(t["dropped"].values())  # nothing unaccounted
    assert summary["live_env_instances_at_end"] == 0
    return t


@pytest.mark.parametrize("tag", [Tag.GPU_COMPUTE, Tag.GPU_BANDWIDTH, Tag.CPU_ENV,
                                 Tag.SERVERLESS, Tag.TRAINER])
def test_a_killed_worker_of_any_pool_does_not_stop_the_run(session, tag, tmp_path):
    run = session.run(overrides=[*SMALL, f"trainer.max_steps={STEPS}",
                                 "trainer.checkpoint_every=1"],
                      run_dir=tmp_path / str(tag))
    killed = _kill_at_cut(run, tag, step=2)
    run.train()
    summary = run.close()
    assert killed, "the kill did not happen"
    t = _accounts_close(summary)
    faults = summary["faults"]
    changes = [(c["worker"], c["change"]) for c in faults["worker_changes"]]
    assert (killed["worker"], "left") in changes
    joined = [w for w, c in changes if c == "joined"]
    assert joined and killed["worker"] not in joined  # the Nanny's new process
    assert faults["recovery_s"] and faults["recovery_s"][0] > 0
    # what was lost is named: restarted or dropped with the loss as the reason
    lost = (faults["restarted"].get(str(DropReason.WORKER_LOST), 0)
            + t["dropped"].get(str(DropReason.WORKER_LOST), 0)
            + t["dropped"].get(str(DropReason.TRAINER_LOST), 0)
            + faults["score_tasks_resent"])
    if tag is Tag.TRAINER:
        restored = [c for c in faults["worker_changes"] if c["change"] == "restored the trainer"]
        assert restored and restored[0]["worker"] == joined[0]
        steps = [r["train/step"] for r in run.rows.train]
        assert steps == list(range(1, STEPS + 1))  # no version repeated or skipped
    elif tag in (Tag.GPU_COMPUTE, Tag.GPU_BANDWIDTH, Tag.CPU_ENV):
        assert lost > 0
    if tag in (Tag.GPU_COMPUTE, Tag.GPU_BANDWIDTH):
        serving = [c for c in faults["worker_changes"] if c["change"] == "serving"]
        assert serving and serving[0]["worker"] == joined[0]  # loaded before it got work


@pytest.mark.long  # waits out cluster.worker_ttl_s: a drill of a minute, run by .ci/run
def test_a_stuck_reward_worker_is_restarted_and_its_scores_sent_again(session, tmp_path):
    """A worker that stops answering without dying (SIGSTOP: its connections stay open, its
    heartbeats stop, its score tasks never end) once left a run waiting with no log line: the
    scheduler's ``worker-ttl`` restarts it through its Nanny, and its score tasks are sent
    again."""
    worker = session.cluster.workers_with(Tag.SERVERLESS)[0]
    pid = session.client.run(os.getpid, workers=[worker])[worker]
    run = session.run(overrides=[*SMALL, f"trainer.max_steps={STEPS}"],
                      run_dir=tmp_path / "stuck")
    stopped = []

    def stop(train_step: int, _trajectories) -> None:
        if train_step == 2 and not stopped:
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)

    run.on_batch(stop)
    try:
        run.train()
        summary = run.close()
    finally:
        if stopped:
            with contextlib.suppress(ProcessLookupError):  # restarted: killed by its Nanny
                os.kill(pid, signal.SIGCONT)
    assert stopped
    _accounts_close(summary)
    left = [c["worker"] for c in summary["faults"]["worker_changes"] if c["change"] == "left"]
    assert worker in left


def test_a_worker_added_mid_run_loads_the_weights_then_gets_work(session, tmp_path):
    """A second decode worker joins after the first step (``dask worker``, as a user adds
    one): it loads the current version first, then takes decode work."""
    run = session.run(overrides=[*SMALL, f"trainer.max_steps={STEPS}"],
                      run_dir=tmp_path / "grow")
    run.train(1)
    before = len(session.client.scheduler_info()["workers"])
    worker = subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_worker", session.client.scheduler.address,
         "--name", "bandwidth-1", "--nthreads", "8", "--no-dashboard",
         "--resources", f"{Tag.GPU_BANDWIDTH}=8"], env=os.environ | WORKER_ENV)
    try:
        session.client.wait_for_workers(before + 1, timeout=120)
        run.train()
        summary = run.close()
    finally:
        worker.terminate()
        worker.wait(30)
    _accounts_close(summary)
    changes = summary["faults"]["worker_changes"]
    joined = [c["worker"] for c in changes if c["change"] == "joined"]
    serving = [c for c in changes if c["change"] == "serving"]
    assert joined and serving and serving[0]["worker"] == joined[0]
    assert serving[0]["detail"].startswith("loaded v")
    assert summary["workers"][joined[0]]["pool"] == "bandwidth"
    placed = session.client.run_on_scheduler(placement_snapshot)
    assert placed["decode"].get(joined[0], 0) > 0  # it got work
    assert run.worker_versions[joined[0]] == STEPS


def _watch_scores(counts):
    """on_transition: how many times each trajectory was given a reward (-> in_group)."""
    def on_transition(t, _ledger) -> None:
        if t.new is TrajState.IN_GROUP:
            counts[t.traj_id] += 1
    return on_transition


@pytest.mark.long
def test_environment_crashes_hangs_and_a_straggling_pool_are_survived(session, tmp_path):
    """Crashing and hanging environments (the watchdog gives up on a silent turn and names
    it), straggling sandboxes, and a decode pool three times slower than it should be."""
    scored = Counter()
    run = session.run(overrides=[
        *SMALL, f"trainer.max_steps={STEPS}", "rollout.max_attempts=3",
        "faults.env.crash_rate=0.03", "faults.env.hang_rate=0.05", "faults.env.hang_s=20",
        "rollout.turn_timeout_s=3",
        "faults.env.step_latency={kind: heavy_tail, p50_s: 0.002, p99_over_p50: 100}",
        "faults.stragglers={bandwidth: 3}"],
        run_dir=tmp_path / "env", on_transition=_watch_scores(scored))
    run.train()
    summary = run.close()
    t = _accounts_close(summary)
    restarted = summary["faults"]["restarted"]
    assert restarted.get(str(DropReason.ROLLOUT_ERROR), 0) > 0  # crashes, restarted
    assert restarted.get(str(DropReason.TURN_TIMEOUT), 0) > 0  # hangs, given up on
    # a hang's details name the environment that stopped answering
    named = [d["detail"] for d in summary["drop_details"] if d["reason"] == "turn_timeout"]
    assert all("did not answer" in d for d in named)
    assert max(scored.values()) == 1 and sum(scored.values()) >= t["trained"]


def test_reward_service_faults_score_every_trajectory_once_or_drop_it(session, tmp_path):
    """Throttling, 5xx, function errors and function timeouts from the Lambda emulation: each
    finished trajectory is scored exactly once or dropped with the reason."""
    scored = Counter()
    run = session.run(overrides=[
        *SMALL, f"trainer.max_steps={STEPS}", "faults.reward.throttle_rate=0.15",
        "faults.reward.error_5xx_rate=0.1", "faults.reward.function_error_rate=0.1",
        "faults.reward.timeout_rate=0.05", "faults.reward.timeout_s=0.5",
        "faults.reward.seed=30"],  # its first 8 calls draw every kind of fault
        run_dir=tmp_path / "reward", on_transition=_watch_scores(scored))
    run.train()
    injected = run._own_service.stats()
    summary = run.close()
    t = _accounts_close(summary)
    assert all(injected.get(f"injected_{kind}", 0) > 0
               for kind in ("throttle", "error_5xx", "timeout", "function_error")), injected
    assert summary["reward"]["function_errors"] > 0
    assert max(scored.values()) == 1  # never scored twice
    dropped_in_scoring = sum(v for k, v in t["dropped"].items() if k.startswith("reward_"))
    assert t["finished"] >= sum(scored.values()) + dropped_in_scoring - t["dropped"].get(
        "reward_task_lost", 0)


def test_a_pool_left_empty_stops_the_run_with_a_checkpoint_instead_of_hanging(tmp_path):
    """The reward pool's only worker is retired for good: past cluster.pool_empty_timeout_s
    the run stops with one line naming the pool, and a checkpoint to resume from."""
    session = Session.start(overrides=[*SMALL, "cluster.dashboard_port=0",
                                       "cluster.processes=false"])
    try:
        run = session.run(overrides=[*SMALL, "trainer.max_steps=50",
                                     "cluster.pool_empty_timeout_s=2"], run_dir=tmp_path / "r")
        run.train(1)
        reward_worker = session.cluster.workers_with(Tag.SERVERLESS)[0]
        session.client.retire_workers(workers=[reward_worker], close_workers=True)
        with pytest.raises(PoolLost, match=f"no worker has advertised {Tag.SERVERLESS} for"):
            run.train()
        assert run.status is RunStatus.FAILED
        saved = sorted((tmp_path / "r" / "checkpoints").glob("step-*"))
        assert saved and (saved[-1] / "driver.json").is_file()
        t = run.summary["trajectories"]
        assert t["started"] == t["trained"] + sum(t["dropped"].values())
    finally:
        session.close()


@pytest.mark.long
def test_the_environment_pool_grows_with_demand_and_shrinks_without_losing_an_instance(
        tmp_path):
    """cluster.adaptive_env: environment steps get 0.4 s slower mid-run (a mix shifting to a
    slow sandbox), the pool grows; they get fast again, it drains a worker and retires it once
    its trajectories are done — no instance lost, no trajectory restarted."""
    small_env = ["cluster.pools.2.slots=8", "cluster.processes=false"]
    session = Session.start(overrides=[*SMALL, "cluster.dashboard_port=0", *small_env])
    try:
        run = session.run(overrides=[
            *SMALL, *small_env, "trainer.max_steps=14", "cluster.adaptive_env.enabled=true",
            "cluster.adaptive_env.max_workers=3", "cluster.adaptive_env.window_s=2",
            "cluster.adaptive_env.cooldown_s=2"], run_dir=tmp_path / "elastic")
        envs = {t.name: t.env for t in run.cfg.env_tasks}
        run.train(2)
        assert not run.env_pool_changes  # demand is low: one worker is enough
        for name, env in envs.items():
            run.update_env(name, {"_component_": "tasks.envs.latency.RemoteLatency",
                                  "env": env, "step_latency": 0.4})
        run.train(5)
        grown = [h for h in run.env_pool_changes if h["action"] == "grow"]
        assert grown and grown[0]["busy"] > 0.7, run.env_pool_changes
        for name, env in envs.items():
            run.update_env(name, env)
        run.train()
        summary = run.close()
    finally:
        session.close()
    _accounts_close(summary, steps=14)
    actions = [h["action"] for h in summary["env_pool"]]
    assert "drain" in actions and "retired" in actions, actions
    assert not summary["faults"]["restarted"]  # nothing was lost in the shrink
    changes = [c["change"] for c in summary["faults"]["worker_changes"]]
    assert "joined" in changes and "retired" in changes and "left" not in changes
