"""Hardware-affinity routing: a roofline cost model picks the pool for prefill and for decode.

Prefill reads a whole prompt in one pass: its time is bound by FLOPs. Decode emits one token per
pass for a batch of sequences and re-reads the weights and the KV cache each time: its time is
bound by memory bandwidth (arXiv 2512.22560, Sec. 3.1). For each candidate pool the device model
(:mod:`resources.device_model`, a roofline) gives the time of a representative unit of work, and
the router chooses the pool with the lowest time, or the lowest time x price (``objective: cost``).
With a single kind of device every stage lands on it: that is colocation, and the monolithic
placement is exactly this case.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from resources.catalog import HardwareProfile, get_profile
from resources.device_model import DeviceModel, ModelName, ModelSpec, model_spec
from resources.pools import PoolSpec, Role, Stage, Tag


class Objective(StrEnum):
    TIME = "time"
    COST = "cost"


class Workload(BaseModel):
    """The production model and request shape that the profiles stand for."""

    model_config = ConfigDict(extra="forbid")

    model: ModelName | None = Field(default=None, description="A device-model preset (dense-8b, "
                              "dense-32b, moe-30b-a3b) or a Hugging Face config.json; null: a "
                              "dense model of `params` with `kv_bytes_per_token`")
    gpus_per_engine: int = Field(default=1, ge=1, description="Devices one engine spans")
    params: float = Field(default=7e9, gt=0, description="Policy parameters")
    bytes_per_param: float = Field(default=2.0, gt=0, description="2 for bf16 weights")
    kv_bytes_per_token: float = Field(
        default=131072.0, gt=0, description="KV cache bytes per token (all layers, K and V)")
    prefill_tokens: int = Field(default=2048, ge=1, description="Tokens read by one prefill")
    decode_batch: int = Field(default=64, ge=1, description="Sequences decoded together")
    context_tokens: int = Field(default=4096, ge=1, description="Context length during decode")
    mfu: float = Field(default=0.5, gt=0, le=1, description="Fraction of peak FLOP/s reached")
    mbu: float = Field(default=0.8, gt=0, le=1, description="Fraction of peak bandwidth reached")


def workload_model(w: Workload) -> ModelSpec:
    if w.model is not None:
        return model_spec(w.model)
    return ModelSpec(name="workload", params_total=w.params, params_active=w.params,
                     kv_bytes_per_token=w.kv_bytes_per_token, bytes_per_param=w.bytes_per_param)


def stage_time(stage: Stage, hw: HardwareProfile, w: Workload) -> float:
    """Device-model time, in seconds, of one prefill or one decode step of a batch."""
    dm = DeviceModel(workload_model(w), hw, w.gpus_per_engine, w.mfu, w.mbu)
    if stage is Stage.PREFILL:
        return dm.prefill_time(w.prefill_tokens)
    if stage is Stage.DECODE:
        return dm.decode_step_time([w.context_tokens] * w.decode_batch)
    raise ValueError(f"the cost model routes prefill and decode, not {stage}")


def stage_score(stage: Stage, hw: HardwareProfile, w: Workload, objective: Objective) -> float:
    t = stage_time(stage, hw, w)
    return t if objective is Objective.TIME else t * hw.price_per_hour


ROUTED_STAGES: dict[Stage, Tag] = {Stage.PREFILL: Tag.GPU_COMPUTE, Stage.DECODE: Tag.GPU_BANDWIDTH}


def route(
    pools: list[PoolSpec],
    workload: Workload,
    objective: Objective = Objective.COST,
    profiles: dict[str, HardwareProfile] | None = None,
) -> dict[Stage, str]:
    """Choose a pool name for prefill and for decode among the pools able to run inference."""
    candidates = [p for p in pools if p.role in (Role.INFERENCE, Role.ALL)]
    if not candidates:
        raise ValueError("no pool with role 'inference' or 'all' to run prefill and decode")
    choice = {}
    for stage in ROUTED_STAGES:
        choice[stage] = min(
            candidates,
            key=lambda p: (stage_score(stage, get_profile(p.profile, profiles), workload, objective),
                           p.name),
        ).name
    return choice


def pool_tags(pools: list[PoolSpec], routing: dict[Stage, str]) -> dict[str, list[Tag]]:
    """The resource tags each pool's workers advertise, given the routing."""
    tags: dict[str, list[Tag]] = {p.name: [] for p in pools}
    for p in pools:
        if p.role is Role.ALL:
            tags[p.name] = [t for t in Tag if t is not Tag.SERVERLESS]
        elif p.role is Role.SERVERLESS:
            tags[p.name].append(Tag.SERVERLESS)
        elif p.role is Role.ENV:
            tags[p.name].append(Tag.CPU_ENV)
        elif p.role is Role.TRAIN:
            tags[p.name].append(Tag.TRAINER)
    for stage, tag in ROUTED_STAGES.items():
        if tag not in tags[routing[stage]]:
            tags[routing[stage]].append(tag)
    return tags
