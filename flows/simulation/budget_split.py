"""Each system at its own best shape of one hourly budget.

The disaggregated systems (``rollarc``, ``sync-disaggregated``) split the budget between the
prefill (compute) engines and the trainer, the decode (bandwidth) engines taking what they and
the environment workers (the config's) leave; the monolithic ones choose how many GPUs an engine spans,
and the budget buys as many such engines as it can (environments run on the same workers).
Every candidate is simulated for ``steps`` steps; the ``confirm`` best are simulated again on
another seed for twice the steps, and the best of those is the system's shape. The figure
reported for it is that held-out run, not the search's: the best of many noisy points is biased
low, and each system, baselines included, is compared at its own best.
"""

from __future__ import annotations

import logging
import math

from flows.benchmarks.report import markdown_table
from flows.config import TrainConfig, with_overrides
from flows.config.choices import Placement
from flows.config.derived import device_model
from flows.simulation.settings import SimSettings
from flows.simulation.simulator import simulate
from flows.simulation.systems import SYSTEMS, system_overrides
from resources.catalog import get_profile
from resources.device_model import DeviceModel
from resources.pools import Role

logger = logging.getLogger(__name__)

# the budget shares of prefill and the trainer searched for the disaggregated systems (decode
# takes what they and the environment workers leave); shapes that round to the same pools are
# simulated once
TRAIN_SHARES = (0.1, 0.15, 0.25)
PREFILL_SHARES = (0.05, 0.1, 0.2, 0.35)
ENGINE_GPUS = (1, 2, 4, 8, 16, 32)  # GPUs per monolithic engine searched
# a monolithic engine must hold at least this many tokens of KV beside its weights: contexts of
# agentic trajectories grow toward 32K (arXiv 2512.22560 Sec. 7)
MIN_KV_TOKENS = 32_768
MONOLITHIC = ("async-monolithic", "sync-monolithic")


def _price(cfg: TrainConfig, profile: str) -> float:
    return get_profile(profile, cfg.affinity.profiles).price_per_hour


def budget_of(cfg: TrainConfig) -> float:
    """USD/hour of the config's GPU pools and environment workers (serverless is billed per
    call, not per hour)."""
    cost = 0.0
    for p in cfg.cluster.pools:
        if p.role in (Role.INFERENCE, Role.TRAIN):
            cost += p.workers * p.gpus * _price(cfg, p.profile)
        elif p.role is Role.ENV:
            cost += p.workers * _price(cfg, p.profile)
    return cost


def disaggregated_shapes(cfg: TrainConfig, budget: float, train_shares=TRAIN_SHARES,
                         prefill_shares=PREFILL_SHARES) -> list[tuple[dict, list[str]]]:
    """(shares, overrides) of every split of ``budget`` searched."""
    pools = cfg.cluster.pools
    inf = [i for i, p in enumerate(pools) if p.role is Role.INFERENCE]
    role = {p.role: i for i, p in enumerate(pools) if p.role is not Role.INFERENCE}
    t, e = role[Role.TRAIN], role[Role.ENV]
    # the pool whose profile the affinity router sends prefill to comes first
    prefill_i, decode_i = sorted(inf, key=lambda i: -get_profile(
        pools[i].profile, cfg.affinity.profiles).peak_flops)[:2]
    env_cost = pools[e].workers * _price(cfg, pools[e].profile)
    engine_price = {i: _price(cfg, pools[i].profile) * pools[i].gpus for i in (prefill_i,
                                                                               decode_i)}
    out, seen = [], set()
    for train_share in train_shares:
        for prefill_share in prefill_shares:
            prefill = max(1, math.floor(budget * prefill_share / engine_price[prefill_i]))
            gpus = max(1, math.floor(budget * train_share / _price(cfg, pools[t].profile)))
            # decode takes what the others leave, to the last engine it buys
            left = (budget - env_cost - prefill * engine_price[prefill_i]
                    - gpus * _price(cfg, pools[t].profile))
            decode = math.floor(left / engine_price[decode_i])
            if decode < 1 or (prefill, decode, gpus) in seen:
                continue
            seen.add((prefill, decode, gpus))
            out.append(({"prefill": prefill * engine_price[prefill_i] / budget,
                         "decode": decode * engine_price[decode_i] / budget,
                         "train": gpus * _price(cfg, pools[t].profile) / budget,
                         "env": env_cost / budget},
                        [f"cluster.pools.{prefill_i}.workers={prefill}",
                         f"cluster.pools.{decode_i}.workers={decode}",
                         f"cluster.pools.{t}.gpus={gpus}"]))
    return out


def monolithic_shapes(cfg: TrainConfig, budget: float, engine_gpus=ENGINE_GPUS
                      ) -> list[tuple[dict, list[str]]]:
    """(engine size, overrides) of every monolithic shape ``budget`` buys whose engines hold
    the model and ``MIN_KV_TOKENS`` of KV."""
    profile = get_profile(cfg.cluster.monolithic_profile, cfg.affinity.profiles)
    model = device_model(cfg)
    dev = cfg.engine.device
    out = []
    for gpus in engine_gpus:
        engines = math.floor(budget / (profile.price_per_hour * gpus))
        kv = DeviceModel(model, profile, gpus, dev.mfu, dev.mbu,
                         dev.memory_utilization).kv_capacity_tokens
        if engines >= 1 and kv >= MIN_KV_TOKENS:
            out.append(({"engine_gpus": gpus}, [f"cluster.monolithic_workers={engines}",
                                                f"cluster.monolithic_gpus={gpus}"]))
    return out


def _run(cfg: TrainConfig, sim: SimSettings, system: str, over: list[str], steps: int,
         seed: int) -> dict:
    c = with_overrides(cfg, [*over, f"trainer.max_steps={steps}", f"seed={seed}"])
    r = simulate(c, sim.model_copy(update={"hours": None}), system)
    return {"gpus": r.gpus, "cost_per_hour": r.cost_per_hour + env_cost(c),
            "step_s": r.steady_step_s, "busy": r.busy, "trainer_busy": r.trainer_busy,
            "pools": {p.name: (p.workers, p.gpus) for p in c.cluster.pools}
            if system not in MONOLITHIC else
            {"monolithic": (c.cluster.monolithic_workers, c.cluster.monolithic_gpus)}}


def env_cost(cfg: TrainConfig) -> float:
    """USD/hour of a disaggregated config's environment workers (the simulated cluster's cost
    counts GPUs only)."""
    if cfg.placement is Placement.MONOLITHIC:
        return 0.0
    return sum(p.workers * _price(cfg, p.profile) for p in cfg.cluster.pools
               if p.role is Role.ENV)


def split_search(cfg: TrainConfig, sim: SimSettings, systems=SYSTEMS,
                 budget: float | None = None, steps: int = 4, confirm: int = 3,
                 grids: dict | None = None) -> dict[str, list[dict]]:
    """Per system, its candidate shapes of ``budget`` (default: what the config's pools cost),
    best first: the confirmed ones by their held-out ``heldout_step_s``, then the rest by the
    search's ``step_s``. ``grids``: ``train_shares``, ``prefill_shares`` and ``engine_gpus``
    other than the defaults."""
    budget = budget or budget_of(cfg)
    grids = grids or {}
    out = {}
    for system in systems:
        base = system_overrides(cfg, system)
        shapes = (monolithic_shapes(cfg, budget, grids.get("engine_gpus", ENGINE_GPUS))
                  if system in MONOLITHIC else disaggregated_shapes(
                      cfg, budget, grids.get("train_shares", TRAIN_SHARES),
                      grids.get("prefill_shares", PREFILL_SHARES)))
        ranked = []
        for shares, over in shapes:
            try:
                rec = _run(cfg, sim, system, [*base, *over], steps, cfg.seed)
            except ValueError as exc:  # a request that never fits this shape's engines
                logger.info("%s %s skipped: %s", system, shares, exc)
                continue
            ranked.append({"system": system, "shares": shares, "overrides": over} | rec)
        ranked.sort(key=lambda r: r["step_s"])
        for rec in ranked[:confirm]:
            held = _run(cfg, sim, system, [*base, *rec["overrides"]], 2 * steps, cfg.seed + 1)
            rec["heldout_step_s"] = held["step_s"]
        ranked[:confirm] = sorted(ranked[:confirm], key=lambda r: r["heldout_step_s"])
        out[system] = ranked
        if ranked:
            logger.info("%s: best %s, %.1f s/step held out", system, ranked[0]["shares"],
                        ranked[0]["heldout_step_s"])
    return out


def _usd(x: float) -> str:
    return f"${x:,.0f}" if x >= 100 else f"${x:.1f}"


def _shape(r: dict) -> str:
    s = r["shares"]
    if "engine_gpus" in s:
        return f"engines of {s['engine_gpus']} GPUs"
    return (f"{s['prefill']:.0%} / {s['decode']:.0%} / {s['train']:.0%} / {s['env']:.1%}"
            " (prefill / decode / trainer / env $)")


def best_table(results: dict[str, list[dict]]) -> str:
    """Markdown: each system at its best shape, its held-out step time and the ratio to
    ``rollarc``'s."""
    ref = results.get("rollarc", [{}])[0].get("heldout_step_s")
    rows = []
    for system, ranked in results.items():
        if not ranked:
            continue
        r = ranked[0]
        rows.append([system, _shape(r), ", ".join(f"{k} {w}x{g}" for k, (w, g) in
                                                   r["pools"].items()),
                     f"{r['gpus']:,}", _usd(r["cost_per_hour"]), f"{r['step_s']:.1f}",
                     f"{r['heldout_step_s']:.1f}",
                     f"{r['heldout_step_s'] / ref:.2f}" if ref else "-",
                     ", ".join(f"{k} {v:.0%}" for k, v in r["busy"].items()),
                     f"{r['trainer_busy']:.0%}", len(ranked)])
    return markdown_table(["system", "best shape", "pools (workers x GPUs)", "GPUs", "$/h",
                           "search s/step", "held-out s/step", "x vs rollarc (held out)",
                           "busy", "trainer busy", "shapes tried"], rows)


def split_table(ranked: list[dict], best: int = 6, worst: int = 2) -> str:
    """Markdown: one system's ``best`` shapes and its ``worst``."""
    rows = [[_shape(r), ", ".join(f"{k} {w}x{g}" for k, (w, g) in r["pools"].items()),
             f"{r['gpus']:,}", _usd(r["cost_per_hour"]), f"{r['step_s']:.1f}",
             f"{r['heldout_step_s']:.1f}" if "heldout_step_s" in r else "-",
             ", ".join(f"{k} {v:.0%}" for k, v in r["busy"].items()),
             f"{r['trainer_busy']:.0%}"]
            for r in (ranked if len(ranked) <= best + worst else ranked[:best] + ranked[-worst:])]
    return markdown_table(["shape", "pools (workers x GPUs)", "GPUs", "$/h", "search s/step",
                           "held-out s/step", "busy", "trainer busy"], rows)
