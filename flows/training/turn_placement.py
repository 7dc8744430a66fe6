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

``env_task`` maps each env task's trajectories to the home that finishes them soonest per
dollar (arXiv 2512.22560v2 Sec. 4.1; :func:`resources.affinity.trajectory_affinity`): every turn
on a compute-pool engine, every turn on a bandwidth-pool engine, or each turn split. It prices
the env task's *trajectory* as its trajectories have shown it so far (:class:`LengthEstimates`:
running means of its first prompt, later turns' new tokens, responses and turns, starting from
the config's ``shape`` and the environment's ``max_turns``), on the engines the turn would get
and their turns in flight. A trajectory whose KV already lives on a pool stays there: on a
compute engine it keeps its whole turns there, on a bandwidth engine it chooses per turn between
a whole turn and the split. :meth:`EnvTaskAffinity.mapping` reports each env task's home at
idle pools with its estimate; it is logged once the env task has finished enough trajectories
to settle it, and again when it changes.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flows.config.choices import TurnPlacement
from flows.training.lengths import LengthEstimates
from resources.affinity import (
    AffinityDecision,
    Home,
    PoolEngine,
    TrajectoryShape,
    trajectory_affinity,
)
from resources.device_model import DeviceModel
from resources.pools import Tag

if TYPE_CHECKING:
    from flows.config import TrainConfig
    from flows.training.orchestration import PoolWorkers
    from tasks.records import EnvObservation, TurnShape

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TurnPlan:
    prefill_worker: str
    decode_worker: str
    prefill_tag: Tag  # the resource slot each task takes on its worker
    decode_tag: Tag
    estimate_s: float | None = None  # the device model's time for the turn (None: not asked)


# finished trajectories after which an env task's mapping counts as settled (and is logged)
SETTLE_TRAJECTORIES = 8
MEMO_MAX = 4096  # decisions kept per driver (by env task, engines and their loads)


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


@dataclass
class EnvTaskMapping:
    """What :class:`EnvTaskAffinity` knows of one env task: its home at idle pools (None until
    priced), whether that is settled, and the turns it placed on each home."""

    home: Home | None = None
    settled: bool = False
    decision: AffinityDecision | None = None
    shape: TrajectoryShape | None = None
    version: int = -1
    placed: Counter = field(default_factory=Counter)


class EnvTaskAffinity:
    """``rollout.turn_placement=env_task``: each turn of an env task's trajectory on the home
    its estimate prices best (module docstring). ``devices``: each inference worker's engine;
    ``lengths``: the running estimates the driver records into."""

    def __init__(self, devices: dict[str, DeviceModel], lengths: LengthEstimates,
                 max_seqs: int = 256):
        self.devices, self.lengths, self.max_seqs = devices, lengths, max_seqs
        self.tasks: dict[str, EnvTaskMapping] = {}
        self._memo: dict[tuple, AffinityDecision] = {}
        self._memo_version: dict[str, int] = {}

    def decide(self, env_task: str, compute: str, bandwidth: str, load: Counter
               ) -> AffinityDecision | None:
        """The env task's homes priced on these two workers at their turns in flight (None
        while nothing is known of its lengths)."""
        est = self.lengths.of(env_task)
        shape = est.shape()
        if shape is None:
            return None
        if self._memo_version.get(env_task) != est.version:  # a new estimate: price anew
            self._memo = {k: v for k, v in self._memo.items() if k[0] != env_task}
            self._memo_version[env_task] = est.version
        c, b = self.devices[compute], self.devices[bandwidth]
        key = (env_task, c.hw.name, c.gpus, b.hw.name, b.gpus, load[compute], load[bandwidth])
        if key not in self._memo:
            if len(self._memo) > MEMO_MAX:
                self._memo.clear()
            self._memo[key] = trajectory_affinity(
                shape, PoolEngine(c, load[compute], self.max_seqs),
                PoolEngine(b, load[bandwidth], self.max_seqs))
        self._observe(env_task, est.version, est.trajectories, shape, c, b)
        return self._memo[key]

    def _observe(self, env_task: str, version: int, trajectories: int, shape: TrajectoryShape,
                 compute: DeviceModel, bandwidth: DeviceModel) -> None:
        """Re-price the env task's home at idle pools for a new estimate; log it once settled
        and whenever it changes after that."""
        m = self.tasks.setdefault(env_task, EnvTaskMapping())
        settled = trajectories >= SETTLE_TRAJECTORIES
        if m.version == version and m.settled == settled:
            return
        if m.version != version:
            m.version, m.shape = version, shape
            m.decision = trajectory_affinity(shape, PoolEngine(compute, 0, self.max_seqs),
                                             PoolEngine(bandwidth, 0, self.max_seqs))
        home, was = m.decision.best.home, m.home
        m.home = home
        if settled and (not m.settled or home is not was):
            logger.info("affinity: env task %s -> %s (%s)", env_task, home,
                        describe(m.shape, m.decision))
        m.settled = settled

    def plan(self, workers: PoolWorkers, env_task: str, sticky: str | None,
             kv_at: str | None) -> TurnPlan | None:
        """The turn's placement (None: no estimate yet, or one worker serves both pools)."""
        compute = workers.workers_by_tag.get(str(Tag.GPU_COMPUTE)) or []
        bandwidth = workers.workers_by_tag.get(str(Tag.GPU_BANDWIDTH)) or []
        if not compute or not bandwidth:
            return None
        load = workers.load
        pre = kv_at if kv_at in compute else least_loaded(compute, load)
        dec = (kv_at if kv_at in bandwidth else sticky if sticky in bandwidth
               else least_loaded(bandwidth, load))
        if pre == dec:
            return None
        decision = self.decide(env_task, pre, dec, load)
        if decision is None:
            return None
        # a trajectory's KV stays where it lives: on a compute engine its turns stay whole there
        homes = ((Home.COMPUTE,) if kv_at == pre else (Home.BANDWIDTH, Home.SPLIT)
                 if kv_at == dec else tuple(Home))
        choice = decision.choose(homes)
        self.tasks[env_task].placed[choice.home] += 1
        if choice.home is Home.COMPUTE:
            return TurnPlan(pre, pre, Tag.GPU_COMPUTE, Tag.GPU_COMPUTE, choice.seconds)
        if choice.home is Home.BANDWIDTH:
            return TurnPlan(dec, dec, Tag.GPU_BANDWIDTH, Tag.GPU_BANDWIDTH, choice.seconds)
        return TurnPlan(pre, dec, Tag.GPU_COMPUTE, Tag.GPU_BANDWIDTH, choice.seconds)

    def mapping(self) -> dict[str, dict]:
        """Each env task's home at idle pools, with its estimate and every home's price, and
        the turns placed on each home (a run's summary can report it)."""
        out = {}
        for name, m in sorted(self.tasks.items()):
            if m.decision is None or m.shape is None:
                continue
            out[name] = {
                "home": str(m.home), "settled": m.settled,
                "trajectories_seen": self.lengths.of(name).trajectories,
                "estimate": {k: round(v, 1) for k, v in vars(m.shape).items()},
                "dollars_per_trajectory": {str(o.home): round(o.dollars, 6)
                                           for o in m.decision.options},
                "seconds_alone": {str(o.home): round(o.seconds, 3) for o in m.decision.options},
                "turns_placed": {str(h): n for h, n in sorted(m.placed.items())}}
        return out


def describe(shape: TrajectoryShape, decision: AffinityDecision) -> str:
    """One line: the estimate, and each home's dollars and seconds per trajectory."""
    homes = ", ".join(f"{o.home} ${o.dollars * 1e3:.3f}m/{o.seconds:.1f}s"
                      for o in decision.options)
    return (f"prompt {shape.prompt_tokens:.0f}, turn {shape.turn_tokens:.0f}, response "
            f"{shape.response_tokens:.0f} tokens, {shape.turns:.1f} turns; per trajectory: "
            f"{homes}")


def place_turn(workers, devices: dict[str, DeviceModel] | None, decode_worker: str | None,
               kv_at: str | None, prompt: int, context: int,
               expected: float | None, *, affinity: EnvTaskAffinity | None = None,
               env_task: str | None = None) -> TurnPlan:
    """Where a turn's prefill and decode run, on ``workers``
    (:class:`flows.training.orchestration.PoolWorkers`: each pool's workers and their load).
    Without device models (``split``), decode stays on the worker holding the cache and prefill
    joins it when that worker can prefill too (colocation), else goes to the least-loaded
    compute worker; with ``affinity`` (``env_task``), :meth:`EnvTaskAffinity.plan` decides for
    ``env_task``'s trajectory; with device models only (``length_aware``, and ``env_task`` before
    its first estimate), :func:`plan_turn` decides."""
    if affinity is not None and env_task is not None:
        plan = affinity.plan(workers, env_task, decode_worker, kv_at)
        if plan is not None:
            return plan
    if devices is None:
        dec = workers.choose(Tag.GPU_BANDWIDTH, prefer=decode_worker)
        pre = workers.choose(Tag.GPU_COMPUTE, prefer=dec)
        return TurnPlan(pre, dec, Tag.GPU_COMPUTE, Tag.GPU_BANDWIDTH)
    return plan_turn(devices, workers.load, workers.workers_by_tag[str(Tag.GPU_COMPUTE)],
                     workers.workers_by_tag[str(Tag.GPU_BANDWIDTH)], kv_at, decode_worker,
                     prompt, context, expected)


class TurnPlacer:
    """Where a run's turns go, as the rollout driver and the simulator both decide it: each
    env task's running length estimates, each inference worker's device model (None:
    ``split``) and, with ``rollout.turn_placement=env_task``, each env task's home."""

    def __init__(self, cfg: TrainConfig, devices: dict[str, DeviceModel] | None):
        self.devices = devices
        self.lengths = LengthEstimates.from_env_tasks(cfg.env_tasks)
        self.affinity = (EnvTaskAffinity(devices, self.lengths, cfg.engine.device.max_seqs)
                         if devices is not None
                         and cfg.rollout.turn_placement is TurnPlacement.ENV_TASK else None)

    def place(self, workers: PoolWorkers, env_task: str, decode_worker: str | None,
              kv_at: str | None, prompt: int | None, context: int) -> TurnPlan:
        """:func:`place_turn` of a turn of ``env_task`` (``prompt`` None: not known, the
        turn splits)."""
        return place_turn(workers, self.devices, decode_worker, kv_at, prompt or 0, context,
                          self.lengths.expected(env_task) if prompt else None,
                          affinity=self.affinity, env_task=env_task)

    def turn_done(self, env_task: str, obs: EnvObservation, shape: TurnShape | None,
                  first: bool) -> None:
        """A turn of ``env_task`` came back with ``obs``: its response and prompt lengths
        (``shape``'s virtual ones on emulated devices) go into the estimates."""
        if shape is None:
            self.lengths.record(env_task, len(obs.sample.token_ids), len(obs.consumed_ids),
                                first=first)
        else:
            self.lengths.record(env_task, obs.sample.virtual_tokens - shape.prompt_tokens,
                                shape.prompt_tokens, first=first)
