"""Hardware-affinity routing: a roofline cost model picks the pool for prefill and for decode.

Prefill reads a whole prompt in one pass: its time is bound by FLOPs. Decode emits one token per
pass for a batch of sequences and re-reads the weights and the KV cache each time: its time is
bound by memory bandwidth (arXiv 2512.22560, Sec. 3.1). For each candidate pool the device model
(:mod:`resources.device_model`, a roofline) gives the time of a representative unit of work, and
the router chooses the pool with the lowest time, or the lowest time x price (``objective: cost``).
With a single kind of device every stage lands on it: that is colocation, and the monolithic
placement is exactly this case.

Hardware affinity per trajectory (arXiv 2512.22560v2 Sec. 4.1: each env task's trajectories go
to the GPU type that suits them, e.g. multi-turn games with growing contexts to H800, long
chains of thought to H20): :func:`trajectory_affinity` prices a trajectory of a given shape on
three homes (every turn on a compute-pool engine, every turn on a bandwidth-pool engine, or each
turn split: prefill on compute, decode on bandwidth, the KV moving both ways) and picks the one
that finishes it soonest per dollar (:class:`HomeEstimate`).
"""

from __future__ import annotations

from dataclasses import dataclass
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


# -- hardware affinity per trajectory ----------------------------------------------------------
@dataclass(frozen=True)
class TrajectoryShape:
    """A trajectory's lengths in tokens (means): its first prompt, each later turn's new tokens
    (an observation, a tool's output), each turn's response, and its number of turns."""

    prompt_tokens: float
    turn_tokens: float
    response_tokens: float
    turns: float

    def turn_work(self) -> list[tuple[int, int, int]]:
        """``(new, cached, response)`` tokens of each turn: the context grows by each turn's
        new tokens and response (a conversation sends its whole history)."""
        out, cached = [], 0
        response = max(1, round(self.response_tokens))
        for i in range(max(1, round(self.turns))):
            new = max(1, round(self.prompt_tokens if i == 0 else self.turn_tokens))
            out.append((new, cached, response))
            cached += new + response
        return out


class Home(StrEnum):
    """Where a trajectory's turns run."""

    COMPUTE = "compute"  # prefill and decode on one compute-pool engine
    BANDWIDTH = "bandwidth"  # prefill and decode on one bandwidth-pool engine
    SPLIT = "split"  # prefill on the compute pool, decode (and the KV) on the bandwidth pool


@dataclass(frozen=True)
class PoolEngine:
    """The engine of a pool a trajectory would get: its device model (profile, devices, price)
    and the turns in flight on it now."""

    device: DeviceModel
    in_flight: int = 0
    max_seqs: int = 256  # sequences it runs at once at most (vLLM's max_num_seqs)

    @property
    def price_per_s(self) -> float:
        return self.device.hw.price_per_hour * self.device.gpus / 3600.0

    def slots(self, context: float) -> int:
        """Sequences of ``context`` tokens its KV memory holds at once (1 to ``max_seqs``)."""
        fit = int(self.device.kv_capacity_tokens // max(context, 1.0))
        return max(1, min(self.max_seqs, fit))


# a split must beat the best whole-turn home by this share of its score: each split turn also
# holds the context's KV on the prefill engine while it is read, queues on a second engine and
# takes one more hop, none of which the estimate prices; and a near-tie must not flip the mapping
SPLIT_MARGIN = 0.1


@dataclass(frozen=True)
class HomeEstimate:
    """One home's price for a trajectory.

    ``dollars``: what its work costs on engines running full at this shape (decode steps shared
    by a full batch, prefills alone; each engine charged for its busier resource, compute or
    the link its KV moves take): the inverse of the trajectories per dollar the home gets
    through. ``seconds``: the trajectory's own chain (KV moves, prefills, decode steps) on the
    home's engines as loaded now: its decode steps batched with the turns in flight there, each
    prefill queued behind theirs (taken as like its own), all of it stretched when their KV
    outgrows the engine's memory (the rest wait, or are evicted and recomputed). ``queue``: how
    much later the load makes it finish (``seconds`` over the same chain without the waits).
    ``score`` = dollars x queue: the lowest finishes the env task's trajectories soonest per
    dollar. Latency at the current batch is reported, not scored: an asynchronous run's step
    time is set by what the pools get through, and a loaded engine costs a trajectory more only
    where it makes it wait."""

    home: Home
    seconds: float
    dollars: float
    queue: float = 1.0

    @property
    def score(self) -> float:
        return self.dollars * self.queue


def home_estimate(shape: TrajectoryShape, home: Home, prefill: PoolEngine,
                  decode: PoolEngine) -> HomeEstimate:
    """The trajectory of ``shape`` with its prefills on ``prefill`` and its decodes (and KV) on
    ``decode`` (the same engine for a whole-turn home)."""
    work = shape.turn_work()
    split = prefill is not decode
    held = sum(new + cached + response for new, cached, response in work) / len(work)
    full = decode.slots(held)  # the batch of an engine full of trajectories like this one
    batch = min(decode.in_flight + 1, full)
    memory = max(1.0, (decode.in_flight + 1) / full)  # KV oversubscribed: turns wait
    ahead = prefill.in_flight  # prefills of the turns in flight there, each taken as this one's
    p_dev, d_dev = prefill.device, decode.device
    alone = waited = prefill_s = decode_s = link_s = 0.0
    for new, cached, response in work:
        moves = 0.0
        if split:  # the context to the prefill engine, the new tokens' KV back
            moves = (p_dev.kv_transfer_time(cached, peer=d_dev)
                     + p_dev.kv_transfer_time(new, peer=d_dev))
        pre = p_dev.prefill_time(new, cached)
        mid = cached + new + response / 2
        steps = response * d_dev.decode_batch_time(batch, batch * mid)
        alone += moves + pre + steps
        if split:
            waited += moves + (1 + ahead) * pre + memory * steps
        else:
            waited += memory * ((1 + ahead) * pre + steps)
        prefill_s += pre
        decode_s += response * d_dev.decode_batch_time(full, full * mid) / full
        link_s += moves
    if split:
        dollars = (prefill.price_per_s * max(prefill_s, link_s)
                   + decode.price_per_s * max(decode_s, link_s))
    else:
        dollars = decode.price_per_s * (prefill_s + decode_s)
    return HomeEstimate(home, waited, dollars, waited / alone)


@dataclass(frozen=True)
class AffinityDecision:
    """Every home's estimate for one trajectory shape."""

    options: tuple[HomeEstimate, ...]

    def option(self, home: Home) -> HomeEstimate:
        return next(o for o in self.options if o.home is home)

    @property
    def best(self) -> HomeEstimate:
        return self.choose(tuple(Home))

    def choose(self, homes: tuple[Home, ...]) -> HomeEstimate:
        """The best of ``homes``: the whole-turn home of the lowest score, unless the split is
        allowed and beats it by :data:`SPLIT_MARGIN`."""
        whole = [self.option(h) for h in homes if h is not Home.SPLIT]
        best = min(whole, key=lambda o: o.score) if whole else None
        if Home.SPLIT in homes:
            split = self.option(Home.SPLIT)
            if best is None or split.score < (1.0 - SPLIT_MARGIN) * best.score:
                return split
        if best is None:
            raise ValueError("no home to choose from")
        return best


def trajectory_affinity(shape: TrajectoryShape, compute: PoolEngine,
                        bandwidth: PoolEngine) -> AffinityDecision:
    """Where a trajectory of ``shape`` finishes soonest per dollar: every turn on ``compute``
    (prefill-heavy shapes: many turns, long contexts, short actions), every turn on
    ``bandwidth`` (decode-heavy: long responses), or each turn split between them (where the
    prefill it moves off the bandwidth engine saves more than its KV moves cost). Pure."""
    return AffinityDecision((
        home_estimate(shape, Home.COMPUTE, compute, compute),
        home_estimate(shape, Home.BANDWIDTH, bandwidth, bandwidth),
        home_estimate(shape, Home.SPLIT, compute, bandwidth)))
