"""The best split of an hourly budget between the prefill, decode, trainer and environment
pools: a small grid of shares, each point a few simulated steps of ``rollarc``, best first."""

from __future__ import annotations

import math

from flows.benchmarks.report import markdown_table
from flows.config import TrainConfig, with_overrides
from flows.simulation.settings import SimSettings
from flows.simulation.simulator import simulate
from resources.catalog import get_profile
from resources.pools import Role

# the grid of budget shares searched; decode takes what the others leave
TRAIN_SHARES = (0.1, 0.15, 0.25)
PREFILL_SHARES = (0.05, 0.1, 0.2, 0.35)
ENV_SHARES = (0.01, 0.025, 0.05)


def split_search(cfg: TrainConfig, sim: SimSettings, budget: float | None = None,
                 steps: int = 4) -> list[dict]:
    """The best split of an hourly budget between the prefill (H800), decode (H20), trainer
    (H800) and environment (CPU) pools: a small grid of shares, each point simulated for a few
    steps of ``rollarc``. The budget defaults to what the config's pools cost. Best first."""
    pools = cfg.cluster.pools
    price = [get_profile(p.profile, cfg.affinity.profiles).price_per_hour for p in pools]
    inf = [i for i, p in enumerate(pools) if p.role is Role.INFERENCE]
    role = {p.role: i for i, p in enumerate(pools) if p.role is not Role.INFERENCE}
    t, e = role[Role.TRAIN], role[Role.ENV]
    # the pool whose profile the affinity router sends prefill to comes first
    prefill_i, decode_i = sorted(inf, key=lambda i: -get_profile(
        pools[i].profile, cfg.affinity.profiles).peak_flops)[:2]
    cost = {i: pools[i].workers * pools[i].gpus * price[i] for i in (*inf, t)}
    cost[e] = pools[e].workers * price[e]
    budget = budget or sum(cost.values())
    out = []
    for train_share in TRAIN_SHARES:
        for prefill_share in PREFILL_SHARES:
            for env_share in ENV_SHARES:
                decode_share = 1 - train_share - prefill_share - env_share
                over = [f"trainer.max_steps={steps}"]
                for i, share in ((prefill_i, prefill_share), (decode_i, decode_share)):
                    engines = max(1, math.floor(budget * share / (price[i] * pools[i].gpus)))
                    over.append(f"cluster.pools.{i}.workers={engines}")
                over.append(f"cluster.pools.{t}.gpus="
                            f"{max(1, math.floor(budget * train_share / price[t]))}")
                over.append(f"cluster.pools.{e}.workers="
                            f"{max(1, math.floor(budget * env_share / price[e]))}")
                c = with_overrides(cfg, over)
                r = simulate(c, sim.model_copy(update={"hours": None}), "rollarc")
                out.append({"prefill_share": prefill_share, "decode_share": decode_share,
                            "train_share": train_share, "env_share": env_share,
                            "pools": {p.name: (p.workers, p.gpus) for p in c.cluster.pools},
                            "gpus": r.gpus, "cost_per_hour": r.cost_per_hour + c.cluster.pools[
                                e].workers * price[e],
                            "step_s": r.step_s, "busy": r.busy, "trainer_busy": r.trainer_busy})
    return sorted(out, key=lambda x: x["step_s"])


def split_table(ranked: list[dict], best: int = 8, worst: int = 2) -> str:
    """Markdown: the ``best`` splits of :func:`split_search` and the ``worst`` ones."""
    rows = [[f"{r['prefill_share']:.0%} / {r['decode_share']:.0%} / {r['train_share']:.0%}"
             f" / {r['env_share']:.1%}",
             ", ".join(f"{k} {w}x{g}" for k, (w, g) in r["pools"].items()),
             f"{r['gpus']:,}", f"${r['cost_per_hour']:,.0f}", f"{r['step_s']:.1f}",
             ", ".join(f"{k} {v:.0%}" for k, v in r["busy"].items()),
             f"{r['trainer_busy']:.0%}"] for r in ranked[:best] + ranked[-worst:]]
    return markdown_table(["prefill / decode / trainer / env $", "pools (workers x GPUs)",
                           "GPUs", "$/h", "s/step", "busy", "trainer busy"], rows)
