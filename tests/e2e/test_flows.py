"""End-to-end runs of flows/train.py as a user runs them (tiny budgets), on real Dask processes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from flows.config import load_config
from flows.monitoring.metrics import NullSink, ProgressLine, read_metrics
from flows.training.launch import make_cluster
from flows.training.run import TrainingRun
from tasks.policy import load_policy
from tasks.specs import PolicySpec
from tests import ROOT

pytestmark = pytest.mark.integration

TRAIN = str(ROOT / "flows" / "train.py")
SHORT = ["trainer.max_steps=2", "trainer.groups_per_step=2", "metrics.progress=false",
         "cluster.dashboard_port=0"]
# in-process workers, for the runs whose checks do not depend on worker processes (a third of
# the time of a run with five of them, each importing torch); the default flow's smoke run, the
# CLI scheduler's and the interrupted Ctrl-C run keep real processes
IN_PROCESS = "cluster.processes=false"
STAGE_POOL = {"prefill": "compute", "decode": "bandwidth",
              "env_reset": "env", "env_step": "env", "score": "reward", "train_step": "trainer",
              "publish_weights": "trainer", "save_checkpoint": "trainer"}


class ListSink(NullSink):
    def __init__(self):
        self.rows = []

    def log(self, metrics):
        self.rows.append(metrics)


def _train(args, run_dir, timeout=600, env=None):
    proc = subprocess.run([sys.executable, TRAIN, "--run-dir", str(run_dir), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _check_accounting(summary):
    t = summary["trajectories"]
    assert t["started"] == t["trained"] + sum(t["dropped"].values()), t
    assert t["trained"] > 0
    assert summary["live_env_instances_at_end"] == 0


def _noise(proc) -> list[str]:
    """What a successful run must not print: a traceback, an error, a warning from Dask."""
    return [ln for ln in (proc.stdout + proc.stderr).splitlines()
            if "Traceback" in ln or " ERROR " in ln or "Error:" in ln
            or re.search(r"distributed\.[\w.]+ - (WARNING|ERROR|CRITICAL)", ln)]


@pytest.mark.long
@pytest.mark.timeout(900)  # ten runs: about 30 s each here, more on a slower machine
def test_ten_default_runs_in_a_row_end_quietly(tmp_path):
    """The intermittent case (a heartbeat racing the scheduler's exit logged an error after
    the run's ``done:`` line in about one run of several): ten short default runs, each
    quiet."""
    noisy = {}
    for i in range(10):
        proc = _train(SHORT + ["metrics.curves=false", "metrics.performance_report=false"],
                      tmp_path / f"run{i}")
        if _noise(proc):
            noisy[i] = _noise(proc)[:5]
    assert not noisy, noisy


def test_default_flow_smoke_leaves_a_complete_run_dir(tmp_path):
    run = tmp_path / "run"
    proc = _train(SHORT, run)
    assert "Dask dashboard: http://" in proc.stdout
    assert "RollArc page:   http://" in proc.stdout and "/individual-rollarc" in proc.stdout
    # the run's pictures: curves and Dask's performance report
    assert (run / "curves.png").stat().st_size > 10_000
    assert (run / "dask-report.html").stat().st_size > 10_000
    # a successful run ends quietly: no traceback, no error logged while the cluster closes
    assert not _noise(proc), _noise(proc)
    assert (run / "config.yaml").read_text().startswith("seed:")
    # a short header says what the run is; the full config stays in config.yaml
    assert f"run {run} (full config: {run / 'config.yaml'})" in proc.stderr
    assert "env tasks: frozenlake x0.8, guess_number x0.2" in proc.stderr
    assert "max_new_tokens" not in proc.stdout + proc.stderr
    lines = read_metrics(run)
    assert [m["train/step"] for m in lines] == [1, 2]
    for key in ("reward/mean", "env/frozenlake/success", "rollout/staleness_mean",
                "perf/trajectories_per_s", "train/loss"):
        assert key in lines[-1] or any(key in m for m in lines), key
    summary = json.loads((run / "summary.json").read_text())
    _check_accounting(summary)
    # every stage ran only on its pool, as the scheduler recorded it
    placement = summary["tasks_per_stage_per_pool"]
    for stage, pool in STAGE_POOL.items():
        assert set(placement[stage]) == {pool}, (stage, placement[stage])
    assert set(placement["load_weights"]) == {"compute", "bandwidth"}
    # every trajectory was scored through boto3 and the Lambda emulation, none lost
    r = summary["reward"]
    assert r["backend"] == "lambda" and r["endpoint"].startswith("http://127.0.0.1:")
    assert r["invocations"] >= 1 and r["mean_batch"] >= 1 and r["lost"] == {}
    assert r["trajectories_sent"] == summary["trajectories"]["finished"]
    assert r["statuses"] == {"ok": r["invocations"]}
    # the final policy loads with the ordinary loader, and the checkpoint resumes
    model, tok = load_policy(PolicySpec(path=str(run / "policy")))
    assert model.config.vocab_size == len(tok)
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)  # no pickle from disk
    assert ckpt["version"] == 2 and {"model", "optimizer", "torch_rng"} <= set(ckpt)

    resumed = tmp_path / "resumed"
    _train(SHORT[1:] + ["trainer.max_steps=3", f"trainer.resume_from={run / 'checkpoint.pt'}",
                        IN_PROCESS], resumed)
    steps = [m["train/step"] for m in read_metrics(resumed)]
    assert steps == [3]


SWAPPED = ["cluster.pools.0.profile=H20", "cluster.pools.1.profile=H800"]


@pytest.mark.parametrize("switches", [
    pytest.param(["mode=sync", "policy.max_context=48", *SWAPPED], id="sync"),
    # the bench's systems (long) run monolithic placement too
    pytest.param(["placement=monolithic"], id="monolithic", marks=pytest.mark.long)])
def test_baselines_run_through_the_same_flow(switches, tmp_path):
    _train(SHORT + switches + [IN_PROCESS], tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    _check_accounting(summary)
    placement = summary["tasks_per_stage_per_pool"]
    if "mode=sync" in switches:
        assert max(m["rollout/staleness_max"] for m in read_metrics(tmp_path / "run")) == 0
        # the short context ends FrozenLake episodes early: truncated, and counted as such
        assert summary["trajectories"]["truncated"]["context"] > 0
        # swapped profiles: the cost model now sends prefill to the pool named "bandwidth"
        assert set(placement["prefill"]) == {"bandwidth"}
        assert set(placement["decode"]) == {"compute"}
    else:
        # everything on the one pool, but reward bursts, which has its own (as in disaggregated)
        assert all(set(v) == {"monolithic"} for k, v in placement.items() if k != "score")
        assert set(placement["score"]) == {"reward"}


def test_async_rollouts_overlap_training_and_staleness_is_bounded(tmp_path):
    from distributed import get_task_stream

    # the in-process reward backend here; the other flow tests score through the emulation
    cfg = load_config(overrides=["trainer.max_steps=4", "trainer.groups_per_step=2",
                                 "cluster.dashboard_port=0", "rollout.max_staleness=2",
                                 "reward.backend=local", IN_PROCESS])
    cluster = make_cluster(cfg, None)
    try:
        # the dashboard answers
        with urllib.request.urlopen(cluster.dashboard_link, timeout=30) as resp:
            assert resp.status == 200
        sink = ListSink()
        run = TrainingRun(cfg, cluster, tmp_path, sink)
        run.setup()
        with get_task_stream(cluster.client) as ts, ProgressLine(4, enabled=False) as progress:
            run.train(progress)
        summary = run.summary()
    finally:
        cluster.close()
    _check_accounting(summary)
    assert summary["reward"]["backend"] == "local" and summary["reward"]["lost"] == {}
    spans = {}
    for rec in ts.data:
        for ss in rec["startstops"]:
            if ss["action"] == "compute":
                spans.setdefault(rec["key"].split("-")[0], []).append((ss["start"], ss["stop"]))
    trains = spans["train_step"]
    rollout = spans["prefill"] + spans["decode"] + spans["env_step"]
    overlapping = [t for t in trains if any(a < t[1] and b > t[0] for a, b in rollout)]
    assert overlapping, "rollouts should run while the trainer trains"
    train_rows = [m for m in sink.rows if "train/step" in m]
    assert [m["train/step"] for m in train_rows] == [1, 2, 3, 4]
    assert all(m["rollout/staleness_max"] <= 2 for m in train_rows)


def test_scheduler_option_runs_on_dask_cli_processes(tmp_path):
    sched_file = tmp_path / "scheduler.json"
    env = {**os.environ, "DASK_LOGGING__DISTRIBUTED": "warning"}
    procs = [subprocess.Popen(["dask", "scheduler", "--host", "127.0.0.1", "--port", "0",
                               "--dashboard-address", ":0", "--scheduler-file", str(sched_file)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        deadline = time.time() + 60
        while not sched_file.exists() and time.time() < deadline:
            time.sleep(0.2)
        address = json.loads(sched_file.read_text())["address"]
        for name, res, threads in [("compute-0", "GPU_COMPUTE=16", 16),
                                   ("bandwidth-0", "GPU_BANDWIDTH=16", 16),
                                   ("cpu-0", "CPU_ENV=16,TRAINER=2,SERVERLESS=2", 20)]:
            procs.append(subprocess.Popen(
                ["dask", "worker", address, "--name", name, "--nthreads", str(threads),
                 "--resources", res, "--host", "127.0.0.1", "--no-dashboard"],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        from distributed import Client

        with Client(address, timeout=60) as c:
            c.wait_for_workers(3, timeout=120)
        # the reward functions run in the local Lambda emulation, reached from the cpu worker
        proc = _train(["--scheduler", address] + SHORT, tmp_path / "run")
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        _check_accounting(summary)
        # the run installed the RollArc page and its series on the running scheduler
        page = next(ln.split()[-1] for ln in proc.stdout.splitlines()
                    if ln.startswith("RollArc page:"))
        base = page.rsplit("/", 1)[0]
        with urllib.request.urlopen(page, timeout=30) as r:
            assert r.status == 200 and b"bokeh" in r.read().lower()
        with urllib.request.urlopen(base + "/rollarc/data.json", timeout=30) as r:
            data = json.loads(r.read())
        assert data["run_id"] == "run" and data["ended"]
        last = data["train"][-1]
        assert last["train/step"] == 2
        with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
            metrics = r.read().decode()
        value = re.search(r'^rollarc_reward_mean\{run="run"\} (\S+)$', metrics, re.M)
        assert value and float(value.group(1)) == pytest.approx(last["reward/mean"])
        assert re.search(r'rollarc_env_success\{env_task="(frozenlake|guess_number)",run="run"\}',
                         metrics)
        placement = summary["tasks_per_stage_per_pool"]
        assert set(placement["prefill"]) == {"GPU_COMPUTE"}
        assert set(placement["decode"]) == {"GPU_BANDWIDTH"}
        assert set(placement["env_step"]) == {"CPU_ENV+SERVERLESS+TRAINER"}
        assert set(placement["train_step"]) == {"CPU_ENV+SERVERLESS+TRAINER"}
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            p.wait(timeout=30)


@pytest.mark.long  # a minute: run by .ci/run after the default suite
def test_bench_compares_systems_on_emulated_devices(tmp_path):
    """The bench end to end with a tiny budget: two systems, their figures, table and
    timelines (figures are measured, never asserted as performance); without --steps, the
    workload's trainer.max_steps (here overridden to 1)."""
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, str(ROOT / "flows" / "bench.py"), "--workload",
                           "long_tail", "--repeats", "1", "--only",
                           "sync-monolithic",
                           "spare groups 0",
                           "--out", str(out), "engine.time_scale=0.005",
                           "trainer.groups_per_step=2", "trainer.max_steps=1"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "bench.json").read_text())
    results = report["results"]
    assert set(results) == {"rollarc", "sync-monolithic", "spare groups 0"}
    for r in results.values():
        assert r["steps"] == 1 and r["step_s_median"] > 0 and r["trajectories_per_s"] > 0
        assert r["bound_s"] > 0 and 0 < r["overhead"]["emulated_fraction"] < 1
        assert r["busy_fraction"] and r["generated_tokens_per_s"] > 0
    assert "8 H800" in results["sync-monolithic"]["hardware"]
    assert "H20" in results["rollarc"]["hardware"]
    report = (out / "bench.md").read_text()
    assert "x vs rollarc" in report and "| redundancy | spare groups 0 |" in report
    for png in ("timeline.png", "timeline-rollarc.png", "timeline-sync-monolithic.png"):
        assert (out / png).stat().st_size > 10_000


def test_a_failing_reward_service_stops_the_run_loudly(tmp_path):
    # every item fails verification (each task gets the other's verifier): nothing is scored 0,
    # every trajectory is dropped with its reason, and the run ends with an error, not a spin
    proc = subprocess.run(
        [sys.executable, TRAIN, "--run-dir", str(tmp_path / "run"), *SHORT, IN_PROCESS,
         "env_tasks.0.reward_fn=tasks.rewards.guess_number_verifier",
         "env_tasks.1.reward_fn=tasks.rewards.frozenlake_verifier"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode != 0
    assert "reward scoring failed for the last" in proc.stderr
    assert "reward_item_error: KeyError" in proc.stderr


def test_unreachable_reward_endpoint_fails_before_the_cluster_starts(tmp_path):
    proc = subprocess.run(
        [sys.executable, TRAIN, "--run-dir", str(tmp_path / "run"), *SHORT,
         "reward.emulator.enabled=false", "reward.endpoint_url=http://127.0.0.1:9",
         "reward.sdk_max_attempts=1", "reward.connect_timeout_s=1"],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "reward service error: reward function 'rollarc-reward' is not invocable" in proc.stderr
    assert "Dask dashboard" not in proc.stdout


@pytest.mark.parametrize("config", [
    "mix.yaml", pytest.param("mix_sandbox.yaml", marks=pytest.mark.long)])
def test_task_mix_configs_run_with_per_task_metrics_and_evaluation(tmp_path, config):
    run = tmp_path / "run"
    _train(["--config", str(ROOT / "config" / config), *SHORT, "trainer.groups_per_step=4",
            "eval.every_steps=2", "eval.episodes=2", IN_PROCESS], run)
    summary = json.loads((run / "summary.json").read_text())
    _check_accounting(summary)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    names = {"frozenlake", "sokoban", "tool_use", "guess_number"}
    evals = [r for r in rows if "eval/step" in r]
    assert [r["eval/step"] for r in evals] == [2]
    assert {k.split("/")[1] for k in evals[0] if k.endswith("/success")} == names
    train_keys = {k for r in rows if "train/step" in r for k in r}
    for name in names & {k.split("/")[1] for k in train_keys if k.startswith("env/")}:
        for metric in ("success", "turns", "format_penalty", "env_step_s"):
            assert f"env/{name}/{metric}" in train_keys
    assert summary["evaluation"]["episodes_started"] == 2 * len(names)


def _signal_after_steps(run_dir, args, sig, steps: int):
    """Start train.py, send ``sig`` once ``steps`` train steps are in metrics.jsonl; the
    finished process and its output."""
    # SIGINT as at a terminal: a shell starting pytest in the background makes its children
    # ignore SIGINT, which Python then keeps ignoring
    proc = subprocess.Popen([sys.executable, TRAIN, "--run-dir", str(run_dir), *args,
                             "metrics.progress=false", "cluster.dashboard_port=0"], cwd=ROOT,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    metrics = run_dir / "metrics.jsonl"

    def trained() -> int:  # complete lines only: the run may be writing one
        lines = metrics.read_text().split("\n")[:-1] if metrics.exists() else []
        return sum('"train/step"' in line for line in lines)

    try:
        deadline = time.time() + 120
        while time.time() < deadline and trained() < steps:
            time.sleep(0.5)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, out, err


def test_sigterm_stops_the_run_cleanly_with_every_trajectory_accounted(tmp_path):
    """SIGTERM (a batch system's stop; the same as Ctrl-C) mid-run: the work in flight is
    cancelled, environments closed, the summary written with the interrupted trajectories
    counted, exit code 130, no hang."""
    run_dir = tmp_path / "run"
    proc, out, err = _signal_after_steps(run_dir, ["trainer.max_steps=500", IN_PROCESS],
                                         signal.SIGTERM, 1)
    assert proc.returncode == 130, out[-2000:] + err[-3000:]
    assert "interrupted" in err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    t = summary["trajectories"]
    assert t["dropped"].get("interrupted", 0) > 0
    assert t["started"] == t["trained"] + sum(t["dropped"].values())
    assert summary["live_env_instances_at_end"] == 0


def test_ctrl_c_checkpoints_and_resume_continues_the_same_run(tmp_path):
    """Ctrl-C (SIGINT) stops gracefully with a checkpoint of the last trained step; --resume
    RUN_DIR continues from it, and metrics.jsonl goes on without duplicated or missing
    steps."""
    run_dir = tmp_path / "run"
    proc, out, err = _signal_after_steps(
        run_dir, ["trainer.max_steps=500", "trainer.checkpoint_every=1000",
                  "trainer.groups_per_step=2", "eval.every_steps=0"], signal.SIGINT, 2)
    assert proc.returncode == 130, out[-2000:] + err[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted", \
        err[-3000:]
    # the periodic one of the first step, then the interrupt's, of the last trained step
    saved = sorted((run_dir / "checkpoints").glob("step-*"))
    assert [d.name for d in saved][0] == "step-000001" and len(saved) == 2
    assert (saved[-1] / "driver.json").is_file()
    version = json.loads((saved[-1] / "driver.json").read_text())["version"]
    assert version >= 2
    state = torch.load(saved[-1] / "checkpoint.pt", weights_only=True)
    assert state["version"] == version
    # the metrics end at the checkpoint's step: the trainer and the rows agree
    assert read_metrics(run_dir)[-1]["train/step"] == version

    proc = subprocess.run([sys.executable, TRAIN, "--resume", str(run_dir),
                           f"trainer.max_steps={version + 2}", "trainer.checkpoint_every=1",
                           "trainer.keep_checkpoints=1", IN_PROCESS],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"resuming {run_dir} at policy version {version}" in proc.stdout
    steps = [m["train/step"] for m in read_metrics(run_dir)]
    assert steps == list(range(1, version + 3))
    elapsed = [m["perf/elapsed_s"] for m in read_metrics(run_dir)]
    assert elapsed == sorted(elapsed)  # the training clock continues
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["policy_version"] == version + 2 and summary["status"] == "finished"
    # keep_checkpoints=1: only the newest periodic checkpoint is left
    assert [d.name for d in (run_dir / "checkpoints").glob("step-*")] == [
        f"step-{version + 1:06d}"]


def test_resume_without_a_checkpoint_is_a_config_error(tmp_path):
    (tmp_path / "config.yaml").write_text("seed: 0\n")
    for args, said in ((["--resume", str(tmp_path)], "no complete checkpoint"),
                       (["--resume", str(tmp_path / "nowhere")], "no config.yaml"),
                       (["--resume", str(tmp_path), "--config", "x.yaml"], "drop --config")):
        proc = subprocess.run([sys.executable, TRAIN, *args], capture_output=True, text=True,
                              timeout=120, cwd=ROOT)
        assert proc.returncode == 2 and said in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.long
def test_science_mix_trains_hc_pinn_and_verifies_it_on_its_own_lambda_function(tmp_path):
    """config/mix_science.yaml as a user runs it, hc_pinn weighted up so that every step holds
    its groups: kernels computed on the env worker, proposals trained on rollarc-reward-pinn."""
    run = tmp_path / "run"
    _train(["--config", str(ROOT / "config" / "mix_science.yaml"), *SHORT,
            "trainer.groups_per_step=3", "env_tasks.2.weight=20", "eval.every_steps=0"], run)
    rows = read_metrics(run)
    assert any(m.get("env/hc_pinn/trajectories", 0) > 0 for m in rows)
    summary = json.loads((run / "summary.json").read_text())
    _check_accounting(summary)
    pinn = summary["reward"]["per_function"]["rollarc-reward-pinn"]
    assert pinn["trajectories_sent"] > 0 and pinn["statuses"]["ok"] > 0
    # beyond the emulation's 4 sandboxes a call is throttled (429) and sent again, never lost
    assert set(pinn["statuses"]) <= {"ok", "TooManyRequestsException"}
    assert summary["reward"]["lost"] == {}
    assert set(summary["tasks_per_stage_per_pool"]["env_step"]) == {"env"}
