"""The deployment specs under config/deploy/, checked offline: the Kubernetes one against the
dask-kubernetes operator's own CRD schemas and spec builders, the SLURM one by building real
dask-jobqueue job scripts; every worker command line is parsed by ``dask worker``'s own CLI and
its advertised hardware routed by the cost model, as the driver does on connect."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml
from distributed.cli.dask_worker import main as dask_worker_cli

from flows.config import load_config
from flows.training.launch import pool_router
from resources.hardware import dask_setup, group_pools, make_advert
from resources.pools import Tag
from tests import ROOT

DEPLOY = ROOT / "config" / "deploy"

# What the cost model of the default config must make of the example pools.
EXPECTED_TAGS = {
    "H800-inference": [Tag.GPU_COMPUTE],
    "H20-inference": [Tag.GPU_BANDWIDTH],
    "H800-train": [Tag.TRAINER],
    "CPU-env": [Tag.CPU_ENV],
    "CPU-serverless": [Tag.SERVERLESS],
}


def _route(workers: list[tuple[list[str], int]]) -> dict[str, list[Tag]]:
    """Parse each worker's ``dask worker`` arguments with the real CLI (which validates the
    preload's options), build its advertisement and route the pools; ``workers`` is
    (argv after 'dask worker', how many such workers)."""
    adverts, nthreads = {}, {}
    for i, (argv, count) in enumerate(workers):
        params = dask_worker_cli.make_context("worker", list(argv)).params
        # Without the address as the first argument click would take the preload's first
        # option for it (`dask worker --preload resources.hardware --hardware H800` fails).
        assert params["scheduler"] and not params["scheduler"].startswith("-"), argv
        assert params["preload"] == ("resources.hardware",)
        preload = dask_setup.make_context("dask_setup", list(params["preload_argv"])).params
        assert preload["hardware"], f"{argv}: declare --hardware, a deployment must not guess"
        for j in range(count):
            adverts[f"w{i}-{j}"] = make_advert(**preload)
            nthreads[f"w{i}-{j}"] = params["nthreads"] or 1
    pools, _, _ = group_pools(adverts, nthreads)
    return pool_router(load_config())(pools)


# ---- Kubernetes: the dask-kubernetes operator's DaskCluster and DaskWorkerGroup -------------


def _crd_schema(kind: str) -> tuple[str, dict]:
    import dask_kubernetes

    crds = Path(dask_kubernetes.__file__).parent / "operator/deployment/helm"
    path = crds / "dask-kubernetes-operator/crds" / f"dask{kind.removeprefix('Dask').lower()}.yaml"
    crd = yaml.safe_load(path.read_text())
    assert crd["spec"]["names"]["kind"] == kind
    (version,) = (v for v in crd["spec"]["versions"] if v["served"])
    return f"{crd['spec']['group']}/{version['name']}", version["schema"]["openAPIV3Schema"]


def _undeclared(obj: object, schema: dict, path: str = "") -> list[str]:
    """Keys the structural schema does not declare: the API server would silently prune them,
    so a misspelt field would vanish instead of failing."""
    if isinstance(obj, dict) and schema.get("properties") is not None:
        if schema.get("x-kubernetes-preserve-unknown-fields") or "additionalProperties" in schema:
            return []
        out = []
        for k, v in obj.items():
            if k not in schema["properties"]:
                out.append(f"{path}.{k}")
            else:
                out += _undeclared(v, schema["properties"][k], f"{path}.{k}")
        return out
    if isinstance(obj, list) and "items" in schema:
        return [
            e
            for i, item in enumerate(obj)
            for e in _undeclared(item, schema["items"], f"{path}[{i}]")
        ]
    return []


def test_kubernetes_spec_matches_the_operator_crds_and_routes_by_hardware():
    pytest.importorskip("dask_kubernetes")
    jsonschema = pytest.importorskip("jsonschema")
    from dask_kubernetes.operator import make_cluster_spec, make_worker_spec

    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes.yaml").read_text()))
    assert [d["kind"] for d in docs].count("DaskCluster") == 1
    cluster = next(d for d in docs if d["kind"] == "DaskCluster")
    reference = make_cluster_spec(name=cluster["metadata"]["name"])
    reference_worker = make_worker_spec()
    workers = []
    for doc in docs:
        api_version, schema = _crd_schema(doc["kind"])
        assert doc["apiVersion"] == api_version
        jsonschema.Draft7Validator(schema).validate(doc)
        assert _undeclared({"spec": doc["spec"]}, schema) == [], doc["metadata"]["name"]
        if doc["kind"] == "DaskWorkerGroup":
            assert doc["spec"]["cluster"] == cluster["metadata"]["name"]
        worker = doc["spec"]["worker"]
        # the operator's own builder makes the same shape
        assert set(worker) <= set(reference_worker)
        (container,) = worker["spec"]["containers"]
        assert container["name"] == reference_worker["spec"]["containers"][0]["name"]
        assert container["args"][:3] == ["dask", "worker", "$(DASK_SCHEDULER_ADDRESS)"]
        assert "--resources" not in container["args"]  # set by the driver on connect
        workers.append((container["args"][2:], worker["replicas"]))
    assert set(cluster["spec"]) <= set(reference["spec"])
    assert set(cluster["spec"]["scheduler"]) <= set(reference["spec"]["scheduler"])
    assert _route(workers) == EXPECTED_TAGS


# ---- SLURM: dask-jobqueue job scripts -------------------------------------------------------


def _slurm_spec() -> dict:
    return yaml.safe_load((DEPLOY / "slurm.yaml").read_text())


def _worker_argv(script: str) -> list[str]:
    """The arguments of the ``dask worker`` line of a job script (after its scheduler)."""
    (line,) = (ln for ln in script.splitlines() if "distributed.cli.dask_worker" in ln)
    argv = shlex.split(line)
    return argv[argv.index("distributed.cli.dask_worker") + 1 :]


def test_slurm_jobs_carry_the_hardware_flags_and_route_by_hardware():
    pytest.importorskip("dask_jobqueue")
    from dask_jobqueue.slurm import SLURMJob

    spec = _slurm_spec()
    workers = []
    for pool, options in spec["pools"].items():
        kwargs = {**spec["common"], **{k: v for k, v in options.items() if k != "jobs"}}
        script = SLURMJob(
            scheduler=spec["scheduler"], name=f"{pool}-$SLURM_JOB_ID", **kwargs
        ).job_script()
        assert f"#SBATCH -p {options['queue']}" in script
        assert f"--name {pool}-$SLURM_JOB_ID " in script  # worker names must be unique
        for directive in options.get("job_extra_directives", []):
            assert f"#SBATCH {directive}" in script
        argv = _worker_argv(script)
        assert argv[0] == spec["scheduler"]
        assert " ".join(options["worker_extra_args"]) in " ".join(argv)
        workers.append((argv, options["jobs"]))
    assert _route(workers) == EXPECTED_TAGS


def test_a_slurm_cluster_object_builds_the_job_script_without_submitting():
    pytest.importorskip("dask_jobqueue")
    from dask_jobqueue import SLURMCluster

    spec = _slurm_spec()
    pool = {k: v for k, v in spec["pools"]["H20-inference"].items() if k != "jobs"}
    scheduler = {"host": "127.0.0.1", "dashboard_address": ":0"}
    with SLURMCluster(**spec["common"], **pool, scheduler_options=scheduler) as cluster:
        script = cluster.job_script()
    assert "#SBATCH --gres=gpu:h20:8" in script
    assert "--preload resources.hardware --hardware H20 --gpus 8 --role inference" in script
