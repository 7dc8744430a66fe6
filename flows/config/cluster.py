"""The cluster sections of a training config: the embedded cluster's pools, TLS, the elastic
environment pool and the affinity router's hardware."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from flows.config.fields import Section
from resources.affinity import Objective, Workload
from resources.catalog import HardwareProfile
from resources.pools import PoolSpec


def existing_file(v: str | None) -> str | None:
    if v is not None and not Path(v).is_file():
        raise ValueError("no such file" if not Path(v).exists() else "not a file")
    return v


TLSFile = Annotated[str | None, AfterValidator(existing_file)]


class TLSConfig(Section):
    """TLS for every Dask connection (Dask's ``Security``); all null: plain TCP."""

    ca_file: TLSFile = Field(default=None, description="CA certificate (PEM) that signed every "
                             "certificate of the cluster (dask --tls-ca-file)")
    cert_file: TLSFile = Field(default=None, description="Certificate (PEM) this run's client, "
                               "scheduler and workers present (dask --tls-cert)")
    key_file: TLSFile = Field(default=None, description="Private key (PEM) of cert_file (dask "
                              "--tls-key)")
    require_encryption: bool = Field(default=True, description="Refuse plain-TCP connections "
                                     "once TLS is set")

    @model_validator(mode="after")
    def _together(self) -> TLSConfig:
        given = {k: getattr(self, k) for k in ("ca_file", "cert_file", "key_file")}
        missing = [k for k, v in given.items() if v is None]
        if missing and len(missing) < len(given):  # Dask's TLS is mutual: all three or none
            raise ValueError(f"{missing[0]} is needed with "
                             f"{[k for k in given if k not in missing][0]} (TLS takes a CA, "
                             "a certificate and its key)")
        return self


class AdaptiveEnvConfig(Section):
    enabled: bool = Field(default=False, description="Scale the environment pool with demand "
                          "(embedded local cluster): add CPU_ENV workers when environment work "
                          "fills the pool, retire idle ones once their live instances are done")
    min_workers: int = Field(default=1, ge=1, description="Fewest environment workers")
    max_workers: int = Field(default=4, ge=1, description="Most environment workers")
    high: float = Field(default=0.7, gt=0, description="Add a worker above this share of the "
                        "pool's slots busy with environment steps (mean over window_s)")
    low: float = Field(default=0.25, ge=0, description="Retire a worker below this share")
    window_s: float = Field(default=5.0, gt=0, description="Window of the busy share")
    cooldown_s: float = Field(default=5.0, ge=0, description="Wait after a change")

    @model_validator(mode="after")
    def _order(self) -> AdaptiveEnvConfig:
        if self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        if self.min_workers > self.max_workers:
            raise ValueError(f"min_workers ({self.min_workers}) exceeds max_workers "
                             f"({self.max_workers})")
        return self


class ClusterConfig(Section):
    pools: list[PoolSpec] = Field(description="Pools of the embedded local cluster")
    monolithic_workers: int | None = Field(default=None, ge=1, description="Workers of the "
                                           "monolithic pool (null: as many as the pools have)")
    monolithic_gpus: int | None = Field(default=None, ge=1, description="Devices per monolithic "
                                        "worker (null: the most a pool has); the engine size "
                                        "flows/bench.py and flows/simulate.py give the "
                                        "monolithic baseline (null: RollArc's largest "
                                        "inference engine's)")
    monolithic_profile: str = Field(default="H800", description="Profile of the single pool "
                                    "that placement=monolithic uses")
    host: str = Field(default="127.0.0.1", description="Address the embedded scheduler, its "
                      "workers and dashboard bind (another than loopback is reachable from "
                      "other machines)")
    dashboard_port: int = Field(default=8787, ge=0, le=65535, description="Dashboard port")
    processes: bool = Field(default=True, description="Workers in separate processes (Nanny)")
    startup_timeout_s: float = Field(default=120, gt=0, description="Wait for workers")
    shards: int = Field(default=1, ge=1, description="Rollout shards: local Dask clusters, "
                        "each with its own scheduler and its own copy of the inference and "
                        "environment pools, over which whole groups are spread (1: one "
                        "cluster; the trainer and reward bursts stay on the first)")
    adaptive_env: AdaptiveEnvConfig = Field(default_factory=AdaptiveEnvConfig)
    pool_empty_timeout_s: float = Field(
        default=300, gt=0, description="A pool (resource tag) left without any worker this long "
        "stops the run with a checkpoint (when the trainer is alive) instead of waiting on")
    worker_ttl_s: float = Field(
        default=60, gt=0, description="The embedded scheduler restarts (through its Nanny) a "
        "worker that has sent no heartbeat this long: a stuck process, or a machine gone without "
        "closing its connections, whose tasks would otherwise be waited on (Dask's "
        "distributed.scheduler.worker-ttl, 5 minutes by default; an external scheduler's is its "
        "own)")
    stall_dump_s: float = Field(
        default=30, ge=0, description="A worker process whose event loop has not turned this "
        "long (no heartbeat: stuck in C code holding the GIL, a deadlock) writes every thread's "
        "stack to its stderr, and again each as long while it stays stuck, before "
        "cluster.worker_ttl_s restarts it (0: off; workers in the driver's process are not "
        "watched)")
    heap_keep_mb: float = Field(
        default=1024, ge=0, description="Worker processes keep up to this much freed memory "
        "in their heap and serve blocks up to this size from it (glibc mallopt "
        "M_MMAP_THRESHOLD and M_TRIM_THRESHOLD), instead of unmapping a step's large tensors "
        "when freed and page-faulting them in again the next step (0: the C library's "
        "defaults; workers in the driver's process are left as they are)")
    tls: Annotated[TLSConfig, BeforeValidator(lambda v: {} if v is None else v)] = Field(
        default_factory=TLSConfig, description="TLS of the Dask connections, the embedded "
        "cluster's and --scheduler's (null: plain TCP)")


class AffinityConfig(Section):
    objective: Objective = Field(default=Objective.COST, description="time | cost")
    workload: Workload = Field(default_factory=Workload)
    profiles: dict[str, HardwareProfile] = Field(default_factory=dict,
                                                 description="Extra or overriding profiles")
