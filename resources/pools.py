"""Pools, stages and the Dask resource names. Every name used to place work is declared here.

A worker's resource total is its number of concurrent *slots*, not of devices: a worker that
advertises ``GPU_COMPUTE=32`` runs up to 32 prefill tasks at once and its engine batches them.
Each task takes one slot.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field


class Stage(StrEnum):
    """A kind of task the flows submit; its value is the Dask key prefix."""

    PREFILL = "prefill"
    DECODE = "decode"
    ENV_RESET = "env_reset"
    ENV_STEP = "env_step"
    ENV_CLOSE = "env_close"
    SCORE = "score"
    TRAIN_STEP = "train_step"
    PUBLISH_WEIGHTS = "publish_weights"
    LOAD_WEIGHTS = "load_weights"
    SAVE_CHECKPOINT = "save_checkpoint"


class Tag(StrEnum):
    """Dask resource names advertised by workers."""

    GPU_COMPUTE = "GPU_COMPUTE"
    GPU_BANDWIDTH = "GPU_BANDWIDTH"
    CPU_ENV = "CPU_ENV"
    TRAINER = "TRAINER"
    # Dispatches calls to serverless functions (reward scoring): I/O for the caller, so a pool
    # of threads of its own, never an inference or environment worker's slots.
    SERVERLESS = "SERVERLESS"


def tags_of(resources: dict | None) -> dict[str, float]:
    """The RollArc tags among a worker's Dask resources, with their slots (those above 0)."""
    names = {t.value for t in Tag}
    return {k: float(v) for k, v in (resources or {}).items() if k in names and v > 0}


class Role(StrEnum):
    """What a pool is for. ``all`` is the monolithic case: one pool carries every hardware tag
    (``SERVERLESS`` stays on its own pool: it dispatches calls, it runs nothing heavy)."""

    INFERENCE = "inference"
    ENV = "env"
    TRAIN = "train"
    SERVERLESS = "serverless"
    ALL = "all"


# The per-stage demand, declared once. Weight loading runs on the inference pool it loads into
# (see flows/training/trainer_handle.py).
STAGE_TAG: dict[Stage, Tag] = {
    Stage.PREFILL: Tag.GPU_COMPUTE,
    Stage.DECODE: Tag.GPU_BANDWIDTH,
    Stage.ENV_RESET: Tag.CPU_ENV,
    Stage.ENV_STEP: Tag.CPU_ENV,
    Stage.ENV_CLOSE: Tag.CPU_ENV,
    Stage.SCORE: Tag.SERVERLESS,
    Stage.TRAIN_STEP: Tag.TRAINER,
    Stage.PUBLISH_WEIGHTS: Tag.TRAINER,
    Stage.SAVE_CHECKPOINT: Tag.TRAINER,
}


def demand(stage: Stage, tag: Tag | None = None) -> dict[str, float]:
    """The Dask ``resources=`` annotation of one task of ``stage`` (one slot)."""
    return {str(tag or STAGE_TAG[stage]): 1}


def submit_on(client, worker: str, stage: Stage, fn, *args, key: str, tag: Tag | None = None,
              **kwargs):
    """One task of ``stage`` on ``worker`` and no other, taking one slot of its pool's resource
    (of ``tag`` when given), under its own ``key`` (never shared: ``pure=False``). Dask never
    moves it: a task pinned to a worker that left waits (its no-worker state) until the caller,
    told of the loss, cancels it."""
    return client.submit(fn, *args, key=key, workers=[worker], allow_other_workers=False,
                         resources=demand(stage, tag), pure=False, **kwargs)


class PoolSpec(BaseModel):
    """A group of workers with one hardware profile."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Pool name; worker names are '<pool>-<i>'")
    profile: str = Field(description="Hardware profile name from the catalog")
    role: Role = Field(description="inference | env | train | serverless | all")
    workers: int = Field(default=1, ge=1, description="Worker processes in the pool")
    slots: int = Field(default=32, ge=1, description="Concurrent tasks per worker (resource total)")
    torch_threads: int = Field(default=1, ge=1, description="torch intra-op threads per worker")
    gpus: int = Field(default=1, ge=1, description="Devices behind each worker (one engine's "
                      "tensor parallelism): what emulated devices and hourly cost count")
