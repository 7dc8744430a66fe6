"""Workers advertising their hardware: the GPU-name mapping and pool grouping (no processes),
then a real scheduler and ``dask worker`` processes started with the ``resources.hardware``
preload, tagged at connect time by the same cost model as the embedded cluster."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import click
import pytest
from distributed import Client, get_worker

from flows.config import load_config
from flows.training.launch import make_cluster, pool_router
from resources import hardware
from resources.affinity import route
from resources.hardware import (
    ADVERT_KEY,
    FALLBACK_GPU_PROFILE,
    Advert,
    dask_setup,
    group_pools,
    profile_for_gpu_name,
    read_adverts,
    worker_resources,
)
from resources.pools import Role, Stage, Tag
from tests import CHECKOUT_PYTHONPATH

# ---- GPU name -> profile, detection, the preload's options -------------------------------


@pytest.mark.parametrize(
    "name, profile",
    [
        ("NVIDIA H800", "H800"),
        ("NVIDIA H20", "H20"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA H200 NVL", "H200"),
        ("NVIDIA H20-3e", "H20"),
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA GeForce RTX 4090", None),
        ("Tesla V100-SXM2-16GB", None),
        ("AMD EPYC CPU", None),  # the CPU profile is not a GPU's
    ],
)
def test_gpu_name_maps_onto_a_catalog_profile(name, profile):
    assert profile_for_gpu_name(name) == profile


def _fake_cuda(monkeypatch, name: str | None, count: int = 1) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: name is not None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: name)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_detection_reads_the_cuda_device_or_falls_back(monkeypatch, caplog):
    _fake_cuda(monkeypatch, "NVIDIA H20", 8)
    assert hardware.detect() == ("H20", 8, "detected")
    _fake_cuda(monkeypatch, "NVIDIA GeForce RTX 4090", 2)
    with caplog.at_level(logging.WARNING, logger="resources.hardware"):
        assert hardware.detect() == (FALLBACK_GPU_PROFILE, 2, "fallback")
    assert "matches no catalog profile" in caplog.text and "--hardware" in caplog.text
    _fake_cuda(monkeypatch, None)
    assert hardware.detect() == ("CPU", 1, "detected")


def test_the_preload_parses_its_options_and_advertises_them(monkeypatch):
    _fake_cuda(monkeypatch, None)
    worker = SimpleNamespace(startup_information={})

    def setup(*argv: str) -> dict:
        ctx = dask_setup.make_context("dask_setup", list(argv), allow_extra_args=False)
        dask_setup.callback(worker, *ctx.args, **ctx.params)
        return worker.startup_information[ADVERT_KEY](worker)

    assert setup("--hardware", "H800", "--gpus", "8", "--role", "inference", "--slots", "16") == {
        "profile": "H800",
        "gpus": 8,
        "role": "inference",
        "slots": 16,
        "source": "declared",
    }
    # defaults: a GPU profile is an inference worker, the detected CPU an env one
    assert setup("--hardware", "H20")["role"] == "inference"
    assert setup() == {
        "profile": "CPU",
        "gpus": 1,
        "role": "env",
        "slots": None,
        "source": "detected",
    }
    with pytest.raises(click.BadParameter):
        setup("--role", "decode")
    with pytest.raises(click.UsageError):  # a nanny has no startup information
        dask_setup.callback(SimpleNamespace(), None, None, None, None)


def test_dask_worker_hands_its_unknown_options_to_the_preload():
    from distributed.cli.dask_worker import main as dask_worker_cli

    argv = ["tcp://h:8786", "--nthreads", "2", "--preload", "resources.hardware"]
    params = dask_worker_cli.make_context("worker", [*argv, "--hardware", "H800"]).params
    assert params["preload_argv"] == ("--hardware", "H800")
    with pytest.raises(click.UsageError):  # validated by the preload's own options
        dask_worker_cli.make_context("worker", [*argv, "--hardwar", "H800"])
    with pytest.raises(click.UsageError):  # no address: click takes --hardware for it
        dask_worker_cli.make_context("worker", argv[1:] + ["--hardware", "H800"])


# ---- pools from advertisements -----------------------------------------------------------


def _adverts(**by_addr: tuple[str, int, str]) -> dict[str, Advert]:
    return {a: Advert(profile=p, gpus=g, role=Role(r)) for a, (p, g, r) in by_addr.items()}


def test_workers_group_into_pools_by_profile_gpus_and_role():
    adverts = _adverts(
        a=("H800", 8, "inference"),
        b=("H800", 8, "inference"),
        c=("H20", 8, "inference"),
        d=("H800", 8, "train"),
        e=("CPU", 1, "env"),
    )
    adverts["e"] = adverts["e"].model_copy(update={"slots": 64})
    pools, worker_pool, slots = group_pools(adverts, {"a": 4, "b": 6, "c": 2, "d": 1, "e": 2})
    assert {p.name: (p.profile, p.gpus, p.role, p.workers, p.slots) for p in pools} == {
        "H800-inference": ("H800", 8, Role.INFERENCE, 2, 6),
        "H20-inference": ("H20", 8, Role.INFERENCE, 1, 2),
        "H800-train": ("H800", 8, Role.TRAIN, 1, 1),
        "CPU-env": ("CPU", 1, Role.ENV, 1, 64),
    }
    assert worker_pool == {
        "a": "H800-inference",
        "b": "H800-inference",
        "c": "H20-inference",
        "d": "H800-train",
        "e": "CPU-env",
    }
    assert slots == {"a": 4, "b": 6, "c": 2, "d": 1, "e": 64}  # nthreads unless --slots

    # the same router as the embedded cluster's: prefill on H800, decode on H20
    tags = pool_router(load_config())(pools)
    assert tags["H800-inference"] == [Tag.GPU_COMPUTE]
    assert tags["H20-inference"] == [Tag.GPU_BANDWIDTH]
    assert tags["H800-train"] == [Tag.TRAINER] and tags["CPU-env"] == [Tag.CPU_ENV]
    res = worker_resources(worker_pool, slots, tags, {"c": {"GPU_COMPUTE": 3, "CPU_ENV": 0}})
    assert res["a"] == {"GPU_COMPUTE": 4.0}
    assert res["c"] == {"GPU_COMPUTE": 0.0, "GPU_BANDWIDTH": 2.0}  # a stale tag is cleared


def test_pools_of_one_profile_and_role_are_named_apart_by_gpus():
    pools, worker_pool, _ = group_pools(
        _adverts(a=("H800", 8, "inference"), b=("H800", 4, "inference"), c=("H20", 1, "inference")),
        {},
    )
    assert worker_pool == {"a": "H800x8-inference", "b": "H800x4-inference", "c": "H20-inference"}


def test_malformed_or_absent_advertisements_are_skipped(caplog):
    workers = {
        "a": {ADVERT_KEY: {"profile": "H800", "gpus": 8, "role": "inference"}},
        "b": {ADVERT_KEY: {"profile": "H800", "role": "prefill"}},
        "c": {"resources": {"CPU_ENV": 4}},
    }
    with caplog.at_level(logging.WARNING, logger="resources.hardware"):
        assert set(read_adverts(workers)) == {"a"}
    assert "malformed" in caplog.text


# ---- a real scheduler and `dask worker` processes -------------------------------------------


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": CHECKOUT_PYTHONPATH,
            "DASK_LOGGING__DISTRIBUTED": "warning"}


class Processes:
    """Dask CLI processes, their output in files, stopped in reverse order."""

    def __init__(self, tmp: Path):
        self.tmp, self.procs = tmp, {}

    def start(self, name: str, *args: str) -> None:
        log = open(self.tmp / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        cmd = [sys.executable, "-m", "dask", *args]
        self.procs[name] = (subprocess.Popen(cmd, stdout=log, stderr=log, env=_env()), log)

    def stop(self, *names: str) -> None:
        for name in names or list(reversed(self.procs)):
            proc, log = self.procs.pop(name)
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


def _worker_args(address: str, name: str, *extra: str) -> list[str]:
    return ["worker", address, "--name", name, "--nworkers", "1", "--nthreads", "2"] + [
        "--no-dashboard",
        *extra,
    ]


def _wait_names(client: Client, names: set[str], timeout: float = 60) -> dict[str, str]:
    """Wait until the scheduler's workers are exactly ``names``; returns name -> address."""
    deadline = time.monotonic() + timeout
    while True:
        info = client.scheduler_info(n_workers=-1)["workers"]
        found = {str(w["name"]): a for a, w in info.items()}
        if set(found) == names:
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers {sorted(found)}, expected {sorted(names)}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def external(tmp_path_factory):
    """A scheduler, a CPU env worker advertising itself and a worker with static --resources
    tags and no advertisement; the GPU workers come and go per test."""
    tmp = tmp_path_factory.mktemp("hardware")
    procs = Processes(tmp)
    sched_file = tmp / "scheduler.json"
    procs.start(
        "scheduler",
        "scheduler",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--no-dashboard",
        "--scheduler-file",
        str(sched_file),
    )
    deadline = time.monotonic() + 30
    while not sched_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    address = json.loads(sched_file.read_text())["address"]
    procs.start(
        "cpu",
        *_worker_args(address, "cpu", "--preload", "resources.hardware", "--role", "env",
                      "--slots", "16"),
    )
    procs.start("static", *_worker_args(address, "static", "--resources", "SERVERLESS=3"))
    client = Client(address, timeout=30)
    try:
        yield procs, address, client
    finally:
        client.close()
        procs.stop()


def _where(client: Client, tag: Tag) -> str:
    return client.submit(lambda: get_worker().name, resources={str(tag): 1}, pure=False).result(30)


@pytest.mark.integration
@pytest.mark.parametrize("a_hw, b_hw", [("H800", "H20"), ("H20", "H800")])
def test_prefill_and_decode_land_on_the_declared_hardware(external, a_hw, b_hw, caplog):
    procs, address, client = external
    for name, hw in (("gpu-a", a_hw), ("gpu-b", b_hw)):
        procs.start(
            name,
            *_worker_args(
                address,
                name,
                "--preload",
                "resources.hardware",
                "--hardware",
                hw,
                "--gpus",
                "8",
                "--role",
                "inference",
            ),
        )
    try:
        by_name = _wait_names(client, {"gpu-a", "gpu-b", "cpu", "static"})
        cfg = load_config(overrides=["cluster.startup_timeout_s=30"])
        with caplog.at_level(logging.INFO):
            handle = make_cluster(cfg, address)
        try:
            h800, h20 = ("gpu-a", "gpu-b") if a_hw == "H800" else ("gpu-b", "gpu-a")
            # the cost model of the config, on the pools the workers declared
            pools, _, _ = group_pools(
                read_adverts(client.scheduler_info(n_workers=-1)["workers"]), {}
            )
            routing = route(pools, cfg.affinity.workload, cfg.affinity.objective)
            assert routing == {Stage.PREFILL: "H800-inference", Stage.DECODE: "H20-inference"}
            assert "affinity routing (cost)" in caplog.text

            assert handle.workers_with(Tag.GPU_COMPUTE) == [by_name[h800]]
            assert handle.workers_with(Tag.GPU_BANDWIDTH) == [by_name[h20]]
            assert handle.workers_with(Tag.CPU_ENV) == [by_name["cpu"]]
            assert handle.worker_pool[by_name[h800]] == "H800-inference"
            assert handle.worker_pool[by_name[h20]] == "H20-inference"
            assert handle.worker_pool[by_name["cpu"]] == "CPU-env"
            # a worker without an advertisement keeps its --resources tags, as before
            assert handle.worker_pool[by_name["static"]] == "SERVERLESS"
            assert handle.worker_tags[by_name["static"]] == {"SERVERLESS": 3}
            assert handle.worker_tags[by_name[h800]] == {"GPU_COMPUTE": 2}  # slots = nthreads

            # the scheduler places tasks by these resources
            assert _where(handle.client, Tag.GPU_COMPUTE) == h800
            assert _where(handle.client, Tag.GPU_BANDWIDTH) == h20
        finally:
            handle.close()
    finally:
        procs.stop("gpu-b", "gpu-a")
        _wait_names(client, {"cpu", "static"})


@pytest.mark.integration
@pytest.mark.long
def test_a_worker_advertising_hardware_joins_a_running_run_as_its_pool(external, tmp_path):
    """A second H20 decode worker started mid-run with the preload gets the H20 pool's tags,
    loads the current weights, then decodes."""
    from flows.api import Session
    from resources.placement import placement_snapshot

    procs, address, client = external
    gpu = ["--preload", "resources.hardware", "--gpus", "8", "--slots", "16"]
    procs.start("h800", *_worker_args(address, "h800", *gpu, "--hardware", "H800",
                                      "--role", "inference"))
    procs.start("h20", *_worker_args(address, "h20", *gpu, "--hardware", "H20",
                                     "--role", "inference"))
    procs.start("train", *_worker_args(address, "train", *gpu, "--hardware", "H800",
                                       "--role", "train"))
    quiet = ["metrics.progress=false", "eval.every_steps=0", "trainer.groups_per_step=2",
             "metrics.dashboard=false"]
    try:
        _wait_names(client, {"h800", "h20", "train", "cpu", "static"})
        session = Session.connect(address, 30, overrides=quiet)
        try:
            run = session.run(overrides=[*quiet, "trainer.max_steps=3"], run_dir=tmp_path / "r")
            run.train(1)
            procs.start("h20-b", *_worker_args(address, "h20-b", *gpu, "--hardware", "H20",
                                               "--role", "inference"))
            joined = _wait_names(client, {"h800", "h20", "h20-b", "train", "cpu", "static"})
            run.train()
            summary = run.close()
            placed = session.client.run_on_scheduler(placement_snapshot)
        finally:
            session.close()
        new = joined["h20-b"]
        changes = [(c["worker"], c["change"]) for c in summary["faults"]["worker_changes"]]
        assert (new, "joined") in changes and (new, "serving") in changes
        assert summary["workers"][new]["pool"] == "H20-inference"
        assert placed["decode"].get(new, 0) > 0 and not placed.get("prefill", {}).get(new)
    finally:
        procs.stop(*[n for n in ("h20-b", "train", "h20", "h800") if n in procs.procs])
        _wait_names(client, {"cpu", "static"})
