"""Per-turn dispatch across the inference pools, by the device model. Pure.

``split`` (the default) sends every turn's prefill to a compute-pool worker and its decode to
the trajectory's bandwidth-pool worker, whatever the turn looks like. ``length_aware`` asks the
device model (:mod:`resources.device_model`, the one the affinity router and the emulated engines use)
which of three placements finishes the turn first:

- split: prefill on the least-loaded compute worker, decode on the trajectory's decode worker
  (the KV goes there and back);
- keep the whole turn on the trajectory's decode worker (its prefill is slower there, but no KV
  moves);
- keep the whole turn on the least-loaded compute worker (a short response decodes on fast,
  otherwise idle compute GPUs).

Each estimate adds the KV transfers the placement needs, the prefill of the turn's prompt after
its context, and the response's decode steps at the batch the worker is running (its turns in
flight). The response length is *expected*: the mean of what the env task's earlier turns
produced (output-length-aware dispatch); until an env task has finished turns, the split is used.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum

from resources.device_model import DeviceModel
from resources.pools import Tag


class TurnPlacement(StrEnum):
    SPLIT = "split"
    LENGTH_AWARE = "length_aware"


@dataclass(frozen=True)
class TurnPlan:
    prefill_worker: str
    decode_worker: str
    prefill_tag: Tag  # the resource slot each task takes on its worker
    decode_tag: Tag
    estimate_s: float | None = None  # the device model's time for the turn (None: not asked)


@dataclass
class ResponseLengths:
    """Running mean of the response tokens each env task's turns produced."""

    total: Counter = field(default_factory=Counter)
    count: Counter = field(default_factory=Counter)

    def record(self, env_task: str, tokens: int) -> None:
        self.total[env_task] += tokens
        self.count[env_task] += 1

    def expected(self, env_task: str) -> float | None:
        n = self.count[env_task]
        return self.total[env_task] / n if n else None


def least_loaded(workers: list[str], load: Counter) -> str:
    """The worker with the fewest tasks in flight, ties to the first name (the pairs compare
    as ``(load, name)``; without a key function: this runs for every turn)."""
    return min(zip(map(load.__getitem__, workers), workers, strict=True))[1]


def turn_time(prefill: DeviceModel, decode: DeviceModel, prompt: int, context: int,
              response: float, decode_batch: int, moves_context_to_prefill: bool,
              moves_context_to_decode: bool, prefill_to_decode: bool) -> float:
    """Seconds one turn takes on these engines (transfers, prefill, then decode steps)."""
    t = prefill.kv_transfer_time(context) if moves_context_to_prefill else 0.0
    t += prefill.prefill_time(prompt, context)
    if prefill_to_decode:
        t += prefill.kv_transfer_time(prompt)
    if moves_context_to_decode:
        t += decode.kv_transfer_time(context)
    mid = context + prompt + int(response) // 2
    return t + response * decode.decode_step_time([mid] * max(decode_batch, 1))


def plan_turn(devices: dict[str, DeviceModel], load: Counter, compute: list[str],
              bandwidth: list[str], cache_at: str | None, sticky: str | None, prompt: int,
              context: int, expected_response: float | None) -> TurnPlan:
    """Where one turn runs (see the module docstring). ``devices`` maps each inference worker to
    its engine's device model, ``load`` counts its turns in flight, ``cache_at`` is the worker
    holding the trajectory's KV and ``sticky`` its decode worker so far."""
    pre = least_loaded(compute, load)
    dec = sticky if sticky in bandwidth else least_loaded(bandwidth, load)
    split = TurnPlan(pre, dec, Tag.GPU_COMPUTE, Tag.GPU_BANDWIDTH)
    if expected_response is None or pre == dec:
        return split
    options = []
    for p_w, d_w, p_tag, d_tag in ((pre, dec, Tag.GPU_COMPUTE, Tag.GPU_BANDWIDTH),
                                   (dec, dec, Tag.GPU_BANDWIDTH, Tag.GPU_BANDWIDTH),
                                   (pre, pre, Tag.GPU_COMPUTE, Tag.GPU_COMPUTE)):
        t = turn_time(devices[p_w], devices[d_w], prompt, context, expected_response,
                      load[d_w] + 1, cache_at is not None and cache_at != p_w,
                      cache_at is not None and cache_at != d_w and p_w != d_w, p_w != d_w)
        options.append(TurnPlan(p_w, d_w, p_tag, d_tag, t))
    return min(options, key=lambda o: o.estimate_s)


def place_turn(workers, devices: dict[str, DeviceModel] | None, decode_worker: str | None,
               kv_at: str | None, prompt: int, context: int,
               expected: float | None) -> TurnPlan:
    """Where a turn's prefill and decode run, on ``workers``
    (:class:`flows.training.orchestration.PoolWorkers`: each pool's workers and their load).
    Without device models (``split``), decode stays on the worker holding the cache and prefill
    joins it when that worker can prefill too (colocation), else goes to the least-loaded
    compute worker; with them (``length_aware``), :func:`plan_turn` decides."""
    if devices is None:
        dec = workers.choose(Tag.GPU_BANDWIDTH, prefer=decode_worker)
        pre = workers.choose(Tag.GPU_COMPUTE, prefer=dec)
        return TurnPlan(pre, dec, Tag.GPU_COMPUTE, Tag.GPU_BANDWIDTH)
    return plan_turn(devices, workers.load, workers.workers_by_tag[str(Tag.GPU_COMPUTE)],
                     workers.workers_by_tag[str(Tag.GPU_BANDWIDTH)], kv_at, decode_worker,
                     prompt, context, expected)
