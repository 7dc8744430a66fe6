"""A lower bound on the time of a run's training on its hardware, whatever the schedule.

The work is the run's own (:mod:`flows.benchmarks.work`): every turn of every trained
trajectory (tokens prefilled after their cached context, tokens decoded from their context),
the trajectories of each train step, and on every engine the weight loads the trained data
needed (all but the last ``max_staleness + 1`` steps' versions). It is priced
through :class:`resources.device_model.DeviceModel`'s public methods only, each kind of work at
its pool's best rate:

- **prefill**: the turns' prefills packed into full engine steps of ``chunk_tokens`` tokens;
- **decode**: in as few engine steps as memory allows, each as full as it can be: a step holds at
  most ``max_seqs`` sequences, at most ``chunk_tokens`` tokens, and sequences whose reserved KV
  (context and response, as the engine reserves it) fits in ``kv_capacity_tokens``; the decoded
  tokens and their contexts spread evenly over those steps (for a step time convex in its
  contents, the even spread is the cheapest);
- **generation**, over the inference pools: each pool's engines share its work perfectly, any
  pool may take any share of either kind, and a pool's time is at least the longer of its
  prefill and its decode share (a mixed step is never shorter than either part alone) plus its
  weight loads; the bound is the least time by which the pools can finish both;
- **training**: each step's ``train_step_time`` over its trajectories' lengths, the head's
  logits at their responses' tokens (with the trainer's ``ppo_epochs`` and ``minibatches`` where
  the device model takes them); on
  time-shared (monolithic) GPUs generation and training **add**;
- **reward**: on a dedicated reward-model pool, every trained trajectory's prefill, packed;
- **the chain**: each trained trajectory's own dependency chain at zero queueing (its
  environment reset, then per turn the fastest prefill at batch 1 with the KV hand-off if it
  decodes elsewhere, the decode at batch 1, the environment's latency; then its reward model's
  prefill), after which its train step and every later one still have to run, one at a time.

The bound is the largest of these terms: no schedule of the same work on the same pools
finishes sooner. A run's wall time over it (``x bound``) measures the schedule.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any

from flows.benchmarks.work import RunWork, TrajectoryWork, Turn
from flows.config import TrainConfig
from flows.config.choices import Placement, RewardBackend
from flows.config.derived import effective_pools, trainer_gpus, trainer_hparams
from resources.catalog import get_profile
from resources.device_model import DeviceModel, model_spec
from resources.emulated import device_of
from resources.emulated_engine import EmulatedEngine
from resources.pools import Role

# a dedicated reward-model engine's step (EmulatedEngine's defaults)
_JUDGE_ENGINE = inspect.signature(EmulatedEngine).parameters
JUDGE_CHUNK_TOKENS = _JUDGE_ENGINE["chunk_tokens"].default


@dataclass(frozen=True)
class Pool:
    """``engines`` engines of one device model, stepping at most ``chunk_tokens`` tokens and
    ``max_seqs`` sequences at a time."""

    name: str
    device: DeviceModel
    engines: int
    chunk_tokens: int
    max_seqs: int


@dataclass(frozen=True)
class Hardware:
    """What a system's work runs on."""

    inference: list[Pool]
    trainer: DeviceModel
    time_shared: bool  # monolithic: generation and training take turns on the same GPUs
    train_options: dict  # ppo_epochs / minibatches, where train_step_time takes them
    judge: DeviceModel | None = None  # a reward model's engine
    judge_dedicated: bool = False  # one dedicated engine, else serverless instances
    max_staleness: int = 0  # rollout.max_staleness: how far behind the trained data may be


def hardware(cfg: TrainConfig) -> Hardware:
    """The devices of ``cfg``'s effective pools (its placement's), its trainer and judge."""
    dev = cfg.engine.device
    inference = []
    for p in effective_pools(cfg):
        if p.role in (Role.INFERENCE, Role.ALL):
            hw = get_profile(p.profile, cfg.affinity.profiles)
            inference.append(Pool(p.name, device_of(hw, p.gpus, dev), p.workers,
                                  dev.chunk_tokens, dev.max_seqs))
    train_pool = next(p for p in effective_pools(cfg) if p.role in (Role.TRAIN, Role.ALL))
    trainer = device_of(get_profile(train_pool.profile, cfg.affinity.profiles),
                        trainer_gpus(cfg), dev)
    hp = trainer_hparams(cfg)
    takes = inspect.signature(trainer.train_step_time).parameters
    options = {k: getattr(hp, k) for k in ("ppo_epochs", "minibatches") if k in takes}
    judge = cfg.reward.judge
    judge_device = None if judge is None else DeviceModel(
        model_spec(judge.model), get_profile(judge.profile, cfg.affinity.profiles), judge.gpus)
    return Hardware(inference, trainer, cfg.placement == Placement.MONOLITHIC, options,
                    judge_device, cfg.reward.backend == RewardBackend.LOCAL,
                    cfg.rollout.max_staleness)


# -- one engine's best rates ---------------------------------------------------------------------


def prefill_seconds(device: DeviceModel, prefills: list[tuple[int, int]],
                    chunk_tokens: int) -> float:
    """One engine reading these ``(new, cached)`` prefills in full steps of ``chunk_tokens``
    (a prefill that spans two steps goes on after what the first read)."""
    total, step, room = 0.0, [], chunk_tokens
    for n, cached in prefills:
        while n > 0:
            piece = min(n, room)
            step.append((piece, cached))
            n, cached, room = n - piece, cached + piece, room - piece
            if room == 0:
                total += device.mixed_batch_time(step, 0, 0)
                step, room = [], chunk_tokens
    if step:
        total += device.mixed_batch_time(step, 0, 0)
    return total


def decode_seconds(device: DeviceModel, turns: list[Turn], chunk_tokens: int,
                   max_seqs: int) -> float:
    """One engine decoding every turn's response in as few, as full, steps as its limits allow
    (module docstring)."""
    tokens = sum(t.response for t in turns)
    if tokens == 0:
        return 0.0
    capacity = device.kv_capacity_tokens
    if capacity <= 0:
        return math.inf
    # the contexts the decoded tokens read, and the KV each holds reserved while it decodes
    contexts = sum(t.response * t.context + t.response * (t.response - 1) / 2 for t in turns)
    reserved = sum(t.response * (t.context + t.response) for t in turns)
    steps = max(tokens / max_seqs, tokens / chunk_tokens, reserved / capacity,
                max(t.response for t in turns))
    return steps * device.decode_batch_time(tokens / steps, contexts / steps)


def train_seconds(hw: Hardware, step: list[TrajectoryWork]) -> float:
    lengths = [t.tokens for t in step if t.tokens > 0]
    if not lengths:
        return 0.0
    responses = sum(u.response for t in step for u in t.turns)
    return hw.trainer.train_step_time(lengths, loss_tokens=responses, **hw.train_options)


# -- the pools together --------------------------------------------------------------------------


def fill_time(rates: list[float], delays: list[float]) -> float:
    """The least ``T`` with ``sum(rate * max(0, T - delay)) >= 1``: pools doing shares of one
    job at these rates (jobs per second), each starting after its delay."""
    order = sorted((d, r) for r, d in zip(rates, delays, strict=True) if r > 0)
    if not order:
        return math.inf
    rate = weighted = 0.0
    for i, (d, r) in enumerate(order):
        rate, weighted = rate + r, weighted + r * d
        t = (1.0 + weighted) / rate
        if i + 1 == len(order) or t <= order[i + 1][0]:
            return t
    return math.inf  # unreachable: the last pool always ends the search


def _rate(seconds: float) -> float:
    """Shares of a job per second for a pool that needs ``seconds`` for all of it."""
    return 0.0 if math.isinf(seconds) else 1.0 / seconds


def generation_seconds(hw: Hardware, turns: list[Turn], weight_loads: int) -> float:
    """The inference pools' prefill and decode of these turns (module docstring)."""
    prefills = [(t.prompt, t.cached) for t in turns if t.prompt]
    decodes = [t for t in turns if t.response]
    pre_rates, dec_rates, delays = [], [], []
    for p in hw.inference:
        delays.append(weight_loads * p.device.weight_broadcast_time())
        if prefills:
            pre_rates.append(_rate(prefill_seconds(p.device, prefills, p.chunk_tokens)
                                   / p.engines))
        if decodes:
            dec_rates.append(_rate(decode_seconds(p.device, decodes, p.chunk_tokens,
                                                  p.max_seqs) / p.engines))
    return max(fill_time(pre_rates, delays) if prefills else 0.0,
               fill_time(dec_rates, delays) if decodes else 0.0)


def turn_chain_seconds(hw: Hardware, turn: Turn) -> float:
    """One turn at zero queueing: the fastest prefill then decode at batch 1, with the KV of the
    new tokens handed over when they run on different pools; then the environment."""
    best = math.inf
    for p in hw.inference:
        prefill = p.device.prefill_time(turn.prompt, turn.cached) if turn.prompt else 0.0
        for d in hw.inference:
            decode = turn.response * d.device.decode_batch_time(
                1, turn.context + (turn.response - 1) / 2) if turn.response else 0.0
            handoff = d.device.kv_transfer_time(turn.prompt) if d is not p else 0.0
            best = min(best, prefill + handoff + decode)
    return best + turn.env_latency_s


def chain_seconds(hw: Hardware, traj: TrajectoryWork) -> float:
    """A trajectory's own dependency chain at zero queueing, its reward included."""
    reward = hw.judge.prefill_time(traj.tokens) if hw.judge is not None and traj.tokens else 0.0
    return traj.reset_s + sum(turn_chain_seconds(hw, t) for t in traj.turns) + reward


def bound_terms(work: RunWork, hw: Hardware) -> dict[str, float]:
    """Each term of the bound, emulated seconds (the bound is the largest)."""
    trained = work.trained
    turns = [t for traj in trained for t in traj.turns]
    train = [train_seconds(hw, step) for step in work.steps] if work.complete else []
    # the weights the last step's data needed were published at most max_staleness steps
    # before it: every engine loaded at least the versions up to those
    generation = generation_seconds(hw, turns, max(0, len(train) - 1 - hw.max_staleness))
    terms: dict[str, float] = {}
    if hw.time_shared:
        terms["generation + training"] = generation + sum(train)
    else:
        terms["generation"] = generation
        if train:
            terms["training"] = sum(train)
    if hw.judge is not None and hw.judge_dedicated:
        terms["reward pool"] = prefill_seconds(hw.judge, [(t.tokens, 0) for t in trained],
                                               JUDGE_CHUNK_TOKENS)
    chains = [max((chain_seconds(hw, t) for t in step), default=0.0) for step in work.steps]
    later = [sum(train[k:]) for k in range(len(train))] if train else [0.0] * len(chains)
    terms["chain"] = max((c + r for c, r in zip(chains, later, strict=True)), default=0.0)
    return terms


def lower_bound(work: RunWork, cfg: TrainConfig) -> dict[str, Any]:
    """The bound of a run of ``cfg`` that did ``work``: its terms, the largest, its binding
    term's name, and whether the trained batches were known."""
    terms = bound_terms(work, hardware(cfg))
    name = max(terms, key=terms.get)
    return {"terms_s": terms, "bound_s": terms[name], "binding": name,
            "complete": work.complete}
