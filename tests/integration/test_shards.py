"""Rollout sharded over several Dask schedulers (cluster.shards): the shard choice, and tiny
runs of flows/train.py on two local schedulers."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
from distributed import Client, LocalCluster, Worker

from flows.api import Session, run_training
from flows.config import ConfigError, load_config
from flows.monitoring.metrics import read_metrics
from flows.training.events import EventLoop, FutureKind, cancel, next_batch_of
from flows.training.lifecycle import DropReason
from flows.training.orchestration import pick_shard
from resources.placement import placement_snapshot
from resources.pools import Tag
from tests import ROOT

TRAIN = str(ROOT / "flows" / "train.py")
# in-process workers: two clusters start in seconds; each still has a scheduler of its own
SHARDED = ["trainer.max_steps=2", "trainer.groups_per_step=2", "metrics.progress=false",
           "cluster.dashboard_port=0", "cluster.processes=false", "cluster.shards=2",
           "reward.backend=local", "metrics.curves=false", "metrics.performance_report=false",
           "metrics.dashboard=false"]
TURN_STAGES = ("prefill", "decode", "env_step")


def test_a_group_goes_to_the_shard_with_the_most_free_room():
    assert pick_shard([0], [64]) == 0
    assert pick_shard([10, 3], [64, 64]) == 1
    assert pick_shard([8, 8, 8], [64, 64, 64]) == 0  # ties: the lowest index
    assert pick_shard([16, 8], [64, 32]) == 0  # room, not load: 48 free against 24
    assert pick_shard([40, 70], [32, 64]) == 1  # both over-full: the least over wins
    with pytest.raises(ValueError):
        pick_shard([1, 2], [64])
    with pytest.raises(ValueError):
        pick_shard([], [])


_RELEASE = threading.Event()


def _blocked() -> None:  # on an in-process worker: until the test releases it
    _RELEASE.wait(30)


@pytest.mark.integration
def test_one_wait_serves_the_event_loops_of_two_schedulers():
    """A result on shard 1 comes back while shard 0's task still runs; cancelling goes
    through each future's own client."""
    kw = {"n_workers": 1, "processes": False, "dashboard_address": ":0"}
    with LocalCluster(**kw) as c0, LocalCluster(**kw) as c1, Client(c0) as a, Client(c1) as b:
        loop0 = EventLoop(a)
        loop1 = EventLoop(b, shard=1, condition=loop0.condition)
        slow = loop0.track(a.submit(_blocked, pure=False), FutureKind.TURN)
        loop1.track(b.submit(sum, [1, 2], pure=False), FutureKind.TURN)
        events = next_batch_of([loop0, loop1])
        assert [(ev.shard, ev.result) for ev in events] == [(1, 3)]
        assert not slow.done()
        cancel([slow])
        _RELEASE.set()
        events = next_batch_of([loop0, loop1], wake=lambda: False)
        assert [(ev.shard, ev.future.status, ev.result) for ev in events] == [
            (0, "cancelled", None)]
        assert loop0.empty() and loop1.empty()


def _train(args, run_dir, timeout=300):
    proc = subprocess.run([sys.executable, TRAIN, "--run-dir", str(run_dir), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_two_shards_roll_out_on_two_schedulers_and_train_on_one(mode, tmp_path):
    summary = _train(SHARDED + [f"mode={mode}"], tmp_path / "run")
    assert summary["policy_version"] == 2
    t = summary["trajectories"]
    assert t["started"] == t["trained"] + sum(t["dropped"].values()), t
    assert t["trained"] > 0 and summary["live_env_instances_at_end"] == 0
    shards = summary["shards"]
    assert [s["shard"] for s in shards] == [0, 1]
    assert shards[0]["scheduler"] != shards[1]["scheduler"]
    # groups went to both shards, and both schedulers ran turn tasks
    for s in shards:
        assert s["groups"] > 0, s
        assert all(s["rollout_tasks_submitted"].get(st, 0) > 0 for st in TURN_STAGES), s
    placement = summary["tasks_per_stage_per_pool"]  # shard 0's scheduler
    assert all(sum(placement[st].values()) > 0 for st in TURN_STAGES), placement
    ran = shards[1]["tasks_per_stage"]  # shard 1's scheduler
    assert all(ran.get(st, 0) == shards[1]["rollout_tasks_submitted"][st] for st in TURN_STAGES)
    # training stays on shard 0: shard 1 holds no trainer or reward worker
    assert {w["pool"] for w in shards[1]["workers"].values()} == {"compute", "bandwidth", "env"}
    assert "train_step" not in ran and "score" not in ran
    # every inference worker of both shards loaded the final weights
    versions = [w["engine"]["version"] for w in summary["workers"].values() if "engine" in w]
    versions += [w["version"] for w in shards[1]["workers"].values()
                 if w["pool"] in ("compute", "bandwidth")]
    assert versions == [2] * 4, versions
    if mode == "sync":  # the barrier waits for every shard's weights: nothing stale
        assert max(m["rollout/staleness_max"] for m in read_metrics(tmp_path / "run")) == 0


def test_shards_with_a_running_scheduler_is_a_config_error(tmp_path):
    cfg = load_config(overrides=["cluster.shards=2", "reward.backend=local"])
    with pytest.raises(ConfigError, match=r"cluster\.shards=2: .*--scheduler"):
        run_training(cfg, tmp_path / "run", scheduler="tcp://127.0.0.1:9")
    with pytest.raises(ConfigError, match=r"cluster\.shards"):
        Session.connect("tcp://127.0.0.1:9", config=cfg)


@pytest.mark.integration
def test_a_further_shard_loses_a_worker_and_takes_on_a_new_one(tmp_path):
    """Shard 1's first environment worker is closed when the batch of step 2 is cut, and an
    environment and a prefill worker join: the lost one's trajectories restart or drop with
    the loss as the reason, nothing goes unaccounted, the new environment worker gets work,
    the new prefill worker once it loaded the weights."""
    session = Session.start(overrides=[*SHARDED, "cluster.pools.2.workers=2"])
    joined = []
    try:
        run = session.run(overrides=["trainer.max_steps=4"], run_dir=tmp_path / "run")
        shard = session.shards[0]
        cluster = shard.cluster
        victim = shard.workers_with(Tag.CPU_ENV)[0]
        worker = next(w for w in cluster.workers.values() if w.address == victim)
        closed = []

        async def new_worker(tag: Tag, name: str):
            return await Worker(shard.client.scheduler.address, nthreads=4,
                                resources={str(tag): 64}, name=name, host="127.0.0.1")

        def swap_at_cut(train_step: int, _trajectories) -> None:
            if train_step == 2 and not closed:
                cluster.sync(worker.close, executor_wait=False)
                closed.append(victim)
                joined.append(cluster.sync(new_worker, Tag.CPU_ENV, "env-9"))
                joined.append(cluster.sync(new_worker, Tag.GPU_COMPUTE, "compute-9"))

        run.on_batch(swap_at_cut)
        run.train()
        summary = run.close()
        ran = shard.client.run_on_scheduler(placement_snapshot)
    finally:
        for w in joined:
            cluster.sync(w.close)
        session.close()
    assert closed and joined
    assert summary["policy_version"] == 4
    t = summary["trajectories"]
    assert t["started"] == t["trained"] + sum(t["dropped"].values()), t
    assert summary["live_env_instances_at_end"] == 0
    faults = summary["faults"]
    changes = {(c["worker"], c["change"]): c for c in faults["worker_changes"]}
    assert changes[(victim, "left")]["detail"] == "rollout shard 1"
    assert changes[(joined[0].address, "joined")]["pool"] == "env"
    lost = (faults["restarted"].get(str(DropReason.WORKER_LOST), 0)
            + t["dropped"].get(str(DropReason.WORKER_LOST), 0))
    assert lost > 0, (faults, t)
    assert victim not in summary["shards"][1]["workers"]
    assert ran["env_step"].get(joined[0].address, 0) > 0, ran["env_step"]
    compute = joined[1].address
    assert changes[(compute, "serving")]["pool"] == "compute"
    assert summary["shards"][1]["workers"][compute]["version"] == 4
    assert ran["load_weights"].get(compute, 0) >= 1
