"""The run on the dashboard and in the Python API, on one shared local cluster: the RollArc page
and ``/metrics`` over HTTP from the scheduler, spans, sinks, pictures, runs trained in chunks,
an interrupt that leaves the cluster usable, and the page installed on a running scheduler."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request

import pytest
from distributed import Client, LocalCluster

from flows.api import RunStatus, Session, swap
from flows.config import ConfigError, load_config
from flows.monitoring.metrics import check_sinks, read_metrics
from flows.monitoring.monitor import install_monitor, page_url
from flows.monitoring.prometheus import metric_name
from flows.monitoring.scheduler_plugin import DATA_PATH, PAGE
from flows.training.lifecycle import DropReason
from tests import ROOT, SMALL

pytestmark = pytest.mark.integration



def fetch(base: str, path: str) -> str:
    with urllib.request.urlopen(base + path, timeout=30) as r:
        assert r.status == 200, path
        return r.read().decode()


def prometheus_value(text: str, name: str, **labels) -> float:
    """The value of one series of a Prometheus text exposition."""
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name}{labels} not in /metrics")


@pytest.fixture(scope="module")
def session():
    s = Session.start(overrides=[*SMALL, "cluster.dashboard_port=0", "cluster.processes=false"])
    yield s
    s.close()


@pytest.fixture(scope="module")
def finished_run(session, tmp_path_factory):
    """Two steps trained in two calls, every sink on, two trajectories dumped per step."""
    run_dir = tmp_path_factory.mktemp("runs") / "chunks"
    run = session.run(overrides=[*SMALL, "trainer.max_steps=2", "eval.every_steps=2",
                                 "eval.episodes=4", "metrics.dump_trajectories=2",
                                 "metrics.sinks=[jsonl,tensorboard,wandb]",
                                 "rollout.cohort_per_env_task=true"],
                      run_dir=run_dir)
    first = run.train(1)
    paused = run.status
    base = session.dashboard_link.rsplit("/status", 1)[0]
    live = {p: fetch(base, p) for p in (PAGE, DATA_PATH, "/metrics", "/individual-plots.json")}
    second = run.train(1)
    summary = run.close()
    return {"run": run, "first": first, "paused": paused, "second": second, "live": live,
            "summary": summary, "base": base}


def test_page_and_metrics_carry_the_run_while_it_trains(session, finished_run):
    live = finished_run["live"]
    assert session.page_link == page_url(session.dashboard_link)
    assert session.page_link.endswith(PAGE)
    assert "bokeh" in live[PAGE].lower() and "RollArc" in live[PAGE]
    assert PAGE in json.loads(live["/individual-plots.json"]).values()
    data = json.loads(live[DATA_PATH])
    row = data["train"][-1]
    assert data["run_id"] == "chunks" and row["train/step"] == 1
    assert set(data["env_tasks"]) == {"frozenlake", "guess_number"}
    assert data["live"]["worker_versions"] and data["live"]["states"]
    text = live["/metrics"]
    assert "dask_scheduler_workers" in text  # beside Dask's own
    assert prometheus_value(text, "rollarc_reward_mean", run="chunks") == pytest.approx(
        row["reward/mean"])
    in_batch = [k.split("/")[1] for k in row if k.startswith("env/") and k.endswith("/success")]
    assert in_batch
    for env_task in in_batch:
        assert prometheus_value(text, "rollarc_env_success", run="chunks", env_task=env_task
                                ) == pytest.approx(row[f"env/{env_task}/success"])
    assert prometheus_value(text, "rollarc_train_step", run="chunks") == 1
    for pool in ("compute", "bandwidth", "env"):
        assert 0 <= prometheus_value(text, "rollarc_pool_busy_fraction", pool=pool) <= 1
    # milestones on the dashboard's /events page (topic "all", with an action)
    actions = [e["action"] for _, e in session.client.get_events("all") if "action" in e]
    assert "rollarc-run-start" in actions and "rollarc-run-end" in actions


def test_each_step_says_why_it_took_as_long_as_it_did(finished_run):
    """The critical path of every trained step in summary.json, and the latest on the page's
    data while the run trains (from the driver's timings: this run records no task stream)."""
    steps = finished_run["summary"]["critical_path"]["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    pools = set(finished_run["run"].session.cluster.worker_pool.values())
    for s in steps:
        assert s["source"] == "driver" and s["seconds"] > 0
        assert sum(s["categories"].values()) == pytest.approx(s["seconds"], rel=1e-3)
        assert s["bottleneck"] in pools | {"driver"}
        assert s["categories"]["train"] > 0
        assert s["gating_trajectory"] is not None and s["gating_turns"] >= 1
    live = json.loads(finished_run["live"][DATA_PATH])["live"]["critical_path"]
    assert live["step"] == 1 and live["gating_trajectory"] == steps[0]["gating_trajectory"]


def test_page_renders_its_plots_in_a_browser(finished_run, chromium):
    """Headless Chromium driven by Playwright: the plots arrive over the page's websocket after
    it loads, so wait for them; the screenshot is kept as a test artefact."""
    from playwright.sync_api import sync_playwright

    from tests.conftest import ARTIFACTS

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "rollarc-page.png"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1200})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(finished_run["base"] + PAGE, wait_until="load", timeout=60_000)
            # 8 figures, each drawn on a canvas once its document arrived (Playwright's
            # selectors pierce Bokeh's shadow roots)
            page.locator("canvas").nth(7).wait_for(state="attached", timeout=60_000)
            page.get_by_text("RollArc run chunks").wait_for(timeout=60_000)
            page.wait_for_timeout(1500)  # the first periodic update
            page.screenshot(path=str(shot), full_page=True)
            assert page.locator("canvas").count() >= 8
            assert not errors, errors
            assert page.get_by_text("Reward service").count() == 1
            assert page.get_by_text("trajectories per call").count() == 1
            assert page.title() == "RollArc"
        finally:
            browser.close()
    assert shot.stat().st_size > 20_000


def test_a_run_trains_in_chunks_and_leaves_its_pictures(finished_run):
    run, summary = finished_run["run"], finished_run["summary"]
    assert finished_run["paused"] is RunStatus.PAUSED
    assert list(finished_run["first"]["train/step"]) == [1]
    assert list(finished_run["second"]["train/step"]) == [1, 2]
    assert summary["status"] == "finished" and summary["policy_version"] == 2
    t = summary["trajectories"]
    assert t["started"] == t["trained"] + sum(t["dropped"].values())
    assert summary["live_env_instances_at_end"] == 0
    d = run.run_dir
    assert [r["train/step"] for r in read_metrics(d)] == [1, 2]
    assert (d / "curves.png").stat().st_size > 10_000
    assert "<html" in (d / "dask-report.html").read_text()[:2000].lower()
    evals = run.metrics("eval")
    assert list(evals["eval/step"]) == [2] and "perf/elapsed_s" in evals
    blocks = (d / "trajectories.txt").read_text().split("== step ")[1:]
    assert [b.split(" ", 1)[0] for b in blocks] == ["1", "1", "2", "2"]
    assert "turn 1: action" in blocks[0] and "policy version 0" in blocks[0]


def test_tensorboard_and_wandb_sinks_write_readable_files(finished_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    d = finished_run["run"].run_dir
    acc = EventAccumulator(str(d / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward/mean")] == [1, 2]
    assert [e.step for e in acc.Scalars("eval/frozenlake/success")] == [2]
    assert list((d / "wandb").glob("offline-run-*/run-*.wandb"))


def test_spans_split_the_run_by_env_task_and_stage(finished_run):
    times = finished_run["run"].time_by_stage()
    for env_task in ("frozenlake", "guess_number"):
        for stage in ("prefill", "decode", "env_step"):
            assert times.loc[f"{env_task}/{stage}", "compute"] > 0
    assert times.loc["trainer/train_step", "compute"] > 0
    assert times.loc["reward/rollarc-reward", "compute"] > 0


def test_plot_cli_redraws_and_overlays(finished_run, tmp_path):
    d = finished_run["run"].run_dir
    out = tmp_path / "overlay.png"
    proc = subprocess.run([sys.executable, "-m", "flows.monitoring.plot", str(d), str(d), "--out",
                           str(out)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_size > 10_000
    proc = subprocess.run([sys.executable, "-m", "flows.monitoring.plot", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "no metrics.jsonl" in proc.stderr


def test_an_interrupt_cancels_the_run_and_leaves_the_cluster_usable(session, tmp_path):
    seen = {"n": 0}

    def interrupt_midway(transition, ledger):  # a notebook's KeyboardInterrupt, mid-run
        seen["n"] += 1
        if seen["n"] == 150:
            raise KeyboardInterrupt

    run = session.run(overrides=[*SMALL, "trainer.max_steps=3"], run_dir=tmp_path / "cut",
                      on_transition=interrupt_midway)
    with pytest.raises(KeyboardInterrupt):
        run.train()
    s = run.summary
    assert run.status is RunStatus.INTERRUPTED and s["status"] == "interrupted"
    t = s["trajectories"]
    assert t["dropped"].get(str(DropReason.INTERRUPTED), 0) > 0
    assert t["started"] == t["trained"] + sum(t["dropped"].values())
    assert s["live_env_instances_at_end"] == 0
    with pytest.raises(RuntimeError, match="interrupted"):
        run.train(1)
    # cohorts mixing env tasks (the default) carry the span "mixed"
    env_tasks = {i.split("/")[0] for i in run.time_by_stage().index}
    assert env_tasks <= {"frozenlake", "guess_number", "mixed", "reward", "trainer"}
    # the same cluster trains the next run
    again = session.run(overrides=[*SMALL, "trainer.max_steps=1"], run_dir=tmp_path / "again")
    again.train()
    assert again.close()["policy_version"] == 1


def test_an_interrupt_whose_clean_up_fails_once_still_ends_interrupted(session, tmp_path,
                                                                        monkeypatch):
    """The clean-up after an interrupt raises (logged); leaving the ``with`` block stops the run
    again, and the summary keeps the status ``interrupted``, every trajectory counted."""
    seen = {"n": 0}

    def interrupt_midway(transition, ledger):
        seen["n"] += 1
        if seen["n"] == 40:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        with session.run(overrides=[*SMALL, "trainer.max_steps=2"], run_dir=tmp_path / "cut",
                         on_transition=interrupt_midway) as run:
            abort = run._run.abort
            calls = []

            def abort_failing_once(reason):
                calls.append(reason)
                if len(calls) == 1:
                    raise RuntimeError("clean-up failed")
                abort(reason)

            monkeypatch.setattr(run._run, "abort", abort_failing_once)
            run.train()
    assert len(calls) == 2
    s = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert s["status"] == "interrupted" and run.status is RunStatus.INTERRUPTED
    t = s["trajectories"]
    assert t["started"] == t["trained"] + sum(t["dropped"].values())


def test_swap_replaces_one_env_tasks_parts_and_validates():
    def shaped(traj):
        return 1.0

    cfg = load_config(overrides=["reward.backend=local"])
    out = swap(cfg, "frozenlake", reward_fn=shaped, group_size=4)
    t = {e.name: e for e in out.env_tasks}
    assert t["frozenlake"].reward_fn is shaped and t["frozenlake"].group_size == 4
    assert t["guess_number"].reward_fn == cfg.env_tasks[1].reward_fn
    with pytest.raises(KeyError, match="no env task"):
        swap(cfg, "sokoban", group_size=4)
    with pytest.raises(ConfigError, match="group_size"):
        swap(cfg, "frozenlake", group_size=1)


def test_missing_sink_package_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    cfg = load_config(overrides=["metrics.sinks=[jsonl,wandb]"])
    with pytest.raises(ConfigError, match=r"metrics.sinks: wandb .*rollarc\[wandb\]"):
        check_sinks(cfg.metrics)
    with pytest.raises(ConfigError, match="metrics.sinks"):
        load_config(overrides=["metrics.sinks=[jsonl,csv]"])


def test_metric_names_put_env_tasks_in_labels():
    assert metric_name("env/frozenlake/success") == ("rollarc_env_success",
                                                     {"env_task": "frozenlake"})
    assert metric_name("eval/guess_number/success") == ("rollarc_eval_success",
                                                        {"env_task": "guess_number"})
    assert metric_name("reward/latency_ms_p50") == ("rollarc_reward_latency_ms_p50", {})


def test_page_is_installed_on_a_running_scheduler(monkeypatch):
    """The undocumented hook: a scheduler started without the page gets it at run time, in
    its Bokeh server's table (so /individual-plots.json lists it) and serving."""
    from distributed.dashboard.scheduler import applications

    monkeypatch.delitem(applications, PAGE, raising=False)  # a scheduler started elsewhere
    with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as lc, \
            Client(lc) as client:
        base = client.dashboard_link.rsplit("/status", 1)[0]
        assert "individual-rollarc" not in fetch(base, "/individual-plots.json")
        install_monitor(client)
        install_monitor(client)  # idempotent
        assert "individual-rollarc" in fetch(base, "/individual-plots.json")
        page = fetch(base, PAGE)
        assert "bokeh" in page.lower()
        assert json.loads(fetch(base, DATA_PATH))["run_id"] is None
