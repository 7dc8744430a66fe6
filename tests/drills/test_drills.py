"""Fault drills on an external cluster (``dask scheduler`` + ``dask worker --resources`` per pool,
Nanny on, as the README starts one): a worker SIGKILLed at a seeded random moment or exactly
while a train step, a weight load or a checkpoint runs, two kills in a row, a kill while the run
recovers. Every run reaches its final step, with ``started == trained + dropped`` and no live
environment instance at the end.

Two representative drills run in the default suite; the rest are marked ``long``. A failing
drill names its seed: ``ROLLARC_DRILL_SEED=N pytest tests/drills/test_drills.py -k NAME`` replays it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import pytest

from flows.api import Session
from flows.config.derived import with_env_faults
from resources.worker import plain, with_envs, with_registry, worker_report
from tasks.env_steps import env_close, env_reset, env_step
from tasks.generation import load_weights
from tasks.records import TurnSample
from tasks.stages import Stages
from tasks.trainer import save_checkpoint, train_step
from tests import NO_PICTURES, SMALL
from tests.external_cluster import (
    ROOT,
    ExternalCluster,
    KillOnce,
    Moment,
    drill_seed,
    random_moment,
)

pytestmark = pytest.mark.integration

DRILL = [*SMALL, *NO_PICTURES]
STEPS = 5


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with ExternalCluster(tmp_path_factory.mktemp("external-cluster")) as c:
        yield c


@pytest.fixture(scope="module")
def session(cluster):
    s = Session.connect(cluster.address, overrides=DRILL)
    yield s
    s.close()


@pytest.fixture
def fresh(cluster):
    """Every pool has its worker before a drill (the previous one's Nanny restarts done)."""
    cluster.wait_for_pools()
    return cluster


def _finished(summary: dict, steps: int, what: str) -> dict:
    # shown by pytest -rA: the drill's recovery times and drops
    print(f"{what}: recovery_s {summary['faults']['recovery_s']}, restarted "
          f"{summary['faults']['restarted']}, dropped {summary['trajectories']['dropped']}")
    t = summary["trajectories"]
    assert summary["policy_version"] == steps, what
    assert t["started"] == t["trained"] + sum(t["dropped"].values()), what
    assert summary["live_env_instances_at_end"] == 0, what
    return t


def _steps(run) -> list[int]:
    return [int(r["train/step"]) for r in run.rows.train]


def _kill_at(run, cluster: ExternalCluster, tags: list[str], step: int, delay: float,
             steps: int, gap: float = 1.0) -> list[dict]:
    """SIGKILL the workers of ``tags`` (``gap`` s apart) ``delay`` s after the batch of
    ``step`` is cut. The cut of the last step (``steps``) waits for the kills: a step can
    take under a second, and a kill must fall while the run trains, not after its end (or in
    the next drill)."""
    killed: list[dict] = []
    timers: list[threading.Timer] = []

    def kill_all() -> None:
        for i, tag in enumerate(tags):
            if i:
                time.sleep(gap)
            killed.append(cluster.kill(tag))

    def on_cut(train_step: int, _trajectories) -> None:
        if train_step == step and not timers:
            timers.append(threading.Timer(delay, kill_all))
            timers[0].start()
        elif train_step == steps and timers:
            timers[0].join(timeout=60)

    run.on_batch(on_cut)
    return killed


def _drill(session, cluster, tmp_path, tags: list[str], seed: int, steps: int = STEPS,
           gap: float = 1.0, overrides: tuple[str, ...] = ()) -> tuple[dict, object, list]:
    step, delay = random_moment(seed, steps)
    what = f"drill {tags} at the cut of step {step} + {delay} s (ROLLARC_DRILL_SEED={seed})"
    run = session.run(overrides=[*DRILL, f"trainer.max_steps={steps}", *overrides],
                      run_dir=tmp_path / "run")
    killed = _kill_at(run, cluster, tags, step, delay, steps, gap)
    run.train()
    summary = run.close()
    assert len(killed) == len(tags), f"{what}: the kills did not all happen"
    _finished(summary, steps, what)
    assert _steps(run) == list(range(1, steps + 1)), what
    left = {c["worker"] for c in summary["faults"]["worker_changes"] if c["change"] == "left"}
    assert {k["worker"] for k in killed} <= left, what
    return summary, run, killed


def test_train_py_on_an_external_cluster_survives_a_killed_decode_worker(fresh, tmp_path):
    """The user's path: ``flows/train.py --scheduler``; the decode pool's worker SIGKILLed at a
    seeded moment after the first step. The run trains every step, accounts for every
    trajectory and exits 0, and Dask logs no error or traceback."""
    seed = drill_seed(21)
    delay = random_moment(seed, STEPS)[1] * 2
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "flows/train.py", "--scheduler", fresh.address, "--run-dir",
         str(run_dir), f"trainer.max_steps={STEPS}", *DRILL],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as at a terminal
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.is_file() and metrics.read_text().strip()) and proc.poll() is None:
        assert time.monotonic() < deadline, "no train step within 240 s"
        time.sleep(0.2)
    time.sleep(delay)
    fresh.kill("GPU_BANDWIDTH")
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # a stop at the event loop's next pass
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)  # again: at once, wherever the driver is
            out, err = proc.communicate(timeout=60)
        pytest.fail(f"the run did not end (seed {seed}): {err[-3000:]}")
    what = f"seed {seed}: {out[-1500:]}{err[-3000:]}"
    assert proc.returncode == 0, what
    summary = json.loads((run_dir / "summary.json").read_text())
    _finished(summary, STEPS, what)
    assert any(c["change"] == "left" for c in summary["faults"]["worker_changes"]), what
    assert "Traceback" not in err and " ERROR " not in err, what


def test_dask_recomputing_a_lost_result_does_not_replay_an_environment(session, fresh,
                                                                       tmp_path):
    """Dask recomputes a result lost with its worker from the tasks it came from, running
    again those whose results were released, pinned ones on the workers still there. A decode
    worker's loss thus runs again the reset of a turn's environment (an instance already closed
    would come back with nothing to close it: live instances at the end of a drill) and its
    step (an action applied twice). The environment worker refuses both; the tasks that needed
    them fail instead, and no instance is left behind."""
    run = session.run(overrides=[*DRILL, "trainer.max_steps=1"], run_dir=tmp_path / "run")
    client = session.client
    workers = fresh.workers_by_tag()
    env_w, dec_w = workers["CPU_ENV"], workers["GPU_BANDWIDTH"]
    spec = with_env_faults(run.cfg.faults, run.cfg.env_tasks[0].env)  # as the run builds it
    sample = TurnSample([0], [0.0], [0], "no answer", stopped=True, context_full=False,
                        decode_tokens_processed=1)

    def on(worker, fn, *args):
        return client.submit(fn, *args, workers=[worker], allow_other_workers=False, pure=False)

    # a: reset, a result on the decode worker made from it, then closed (its trajectory over)
    reset_a = on(env_w, with_envs, env_reset, spec, 1, "drill.a.0")
    held_a = on(dec_w, plain, repr, reset_a)
    held_a.result()
    assert on(env_w, with_registry, env_close, reset_a.result().handle).result()
    # b: reset (kept), one step, a result on the decode worker made from the step
    reset_b = on(env_w, with_envs, env_reset, spec, 2, "drill.b.0")
    step_b = on(env_w, with_envs, env_step, reset_b, sample)
    held_b = on(dec_w, plain, repr, step_b)
    held_b.result()
    keys = [reset_a.key, step_b.key]
    del reset_a, step_b  # released: only their lineage remains, as with a turn's tasks
    time.sleep(0.5)
    fresh.kill("GPU_BANDWIDTH")  # held_a, held_b lost: Dask recomputes what they came from

    def states() -> dict:
        return client.run_on_scheduler(
            lambda dask_scheduler, keys=keys: {k: dask_scheduler.tasks[k].state
                                               for k in keys if k in dask_scheduler.tasks})

    deadline = time.monotonic() + 60
    while set(states().values()) - {"memory", "erred"}:
        assert time.monotonic() < deadline, f"not recomputed: {states()}"
        time.sleep(0.2)
    envs = client.run(worker_report, workers=[env_w])[env_w]["envs"]
    replayed = client.run_on_scheduler(
        lambda dask_scheduler, keys=keys: [dask_scheduler.tasks[k].exception_text
                                           for k in keys])
    del held_a, held_b
    assert envs["live"] == 1, envs  # b alone: a not created again
    assert envs.get("replays_refused") == 2, envs
    assert all("was run again" in (r or "") for r in replayed), replayed
    assert on(env_w, with_registry, env_close, reset_b.result().handle).result()
    run.close()


def test_the_trainer_killed_mid_step_with_the_default_config_resumes(session, fresh, tmp_path):
    """The default config keeps a periodic checkpoint (after the first step, then every
    trainer.checkpoint_every): the trainer's worker SIGKILLed while it trains step 3 is
    rebuilt from it on the Nanny's new worker; no step is repeated or missing."""
    stages = Stages(train_step=KillOnce(train_step, Moment.TRAIN_STEP,
                                        str(tmp_path / "killed"), version=2))
    run = session.run(overrides=[*DRILL, "trainer.max_steps=4"], run_dir=tmp_path / "run",
                      stages=stages)
    run.train()
    summary = run.close()
    assert (tmp_path / "killed").is_file(), "the kill did not happen"
    _finished(summary, 4, "trainer killed in step 3")
    assert _steps(run) == [1, 2, 3, 4]
    restored = [r.get("train/restored_from") for r in run.rows.train]
    assert restored == [None, None, 1, None]  # the step after the loss names the checkpoint
    changes = [c["change"] for c in summary["faults"]["worker_changes"]]
    assert "left" in changes and "restored the trainer" in changes
    assert summary["trajectories"]["dropped"].get("trainer_lost", 0) > 0


@pytest.mark.long
@pytest.mark.parametrize("tag", ["GPU_COMPUTE", "GPU_BANDWIDTH", "CPU_ENV", "TRAINER",
                                 "SERVERLESS"])
def test_a_worker_of_any_pool_killed_at_a_random_moment(session, fresh, tmp_path, tag):
    _drill(session, fresh, tmp_path, [tag], drill_seed(sum(map(ord, tag))))


@pytest.mark.long
def test_two_kills_in_a_row(session, fresh, tmp_path):
    """The decode pool's worker, then the environment pool's a second later."""
    _drill(session, fresh, tmp_path, ["GPU_BANDWIDTH", "CPU_ENV"], drill_seed(7))


@pytest.mark.long
@pytest.mark.parametrize("tag", ["GPU_COMPUTE", "GPU_BANDWIDTH"])
def test_an_inference_worker_killed_while_it_loads_weights(session, fresh, tmp_path, tag):
    stages = Stages(load_weights=KillOnce(load_weights, Moment.LOAD_WEIGHTS,
                                          str(tmp_path / "killed"), version=2, tag=tag))
    run = session.run(overrides=[*DRILL, f"trainer.max_steps={STEPS}"],
                      run_dir=tmp_path / "run", stages=stages)
    run.train()
    summary = run.close()
    assert (tmp_path / "killed").is_file(), "the kill did not happen"
    _finished(summary, STEPS, f"{tag} killed loading v2")
    assert _steps(run) == list(range(1, STEPS + 1))


@pytest.mark.long
def test_a_kill_while_the_run_recovers_from_the_previous_one(session, fresh, tmp_path):
    """The decode worker dies loading v2; the Nanny's new worker dies loading its first
    weights (before it serves); the third serves."""
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    inner = KillOnce(load_weights, Moment.LOAD_WEIGHTS, first, version=2, tag="GPU_BANDWIDTH")
    stages = Stages(load_weights=KillOnce(inner, Moment.LOAD_WEIGHTS, second,
                                          tag="GPU_BANDWIDTH", after=first))
    run = session.run(overrides=[*DRILL, f"trainer.max_steps={STEPS}"],
                      run_dir=tmp_path / "run", stages=stages)
    run.train()
    summary = run.close()
    assert (tmp_path / "first").is_file() and (tmp_path / "second").is_file()
    _finished(summary, STEPS, "two decode workers killed loading weights")
    changes = [(c["pool"], c["change"]) for c in summary["faults"]["worker_changes"]]
    assert changes.count(("GPU_BANDWIDTH", "left")) == 2
    assert ("GPU_BANDWIDTH", "serving") in changes


@pytest.mark.long
def test_the_trainer_killed_while_writing_a_checkpoint(session, fresh, tmp_path):
    """Killed after the checkpoint of v2 hit the disk, before the driver knew: the
    incomplete one (no driver state) is skipped, and the trainer restored from v1's."""
    stages = Stages(save_checkpoint=KillOnce(save_checkpoint, Moment.SAVE_CHECKPOINT,
                                             str(tmp_path / "killed"), version=2,
                                             finish_first=True))
    run = session.run(overrides=[*DRILL, f"trainer.max_steps={STEPS}",
                                 "trainer.checkpoint_every=2"],
                      run_dir=tmp_path / "run", stages=stages)
    run.train()
    summary = run.close()
    assert (tmp_path / "killed").is_file(), "the kill did not happen"
    _finished(summary, STEPS, "trainer killed writing the checkpoint of v2")
    assert _steps(run) == list(range(1, STEPS + 1))
    assert 1 in [r.get("train/restored_from") for r in run.rows.train]
