"""Reward scoring throughput against concurrency: the same trajectories at 1, 4 and 16 concurrent
Lambda invocations, through boto3 and the local Lambda emulation, side by side in one run.

Two settings:

- ``model``: the model-based reward (sentence embeddings, ``rollarc-reward-model``) as it is.
  CPU-bound: each sandbox gets one thread (one vCPU, as a 1,769 MB function), so on a machine
  with N cores concurrency can gain at most about N-fold (on AWS every sandbox brings its own).
- ``latency``: the rule-based reward (``rollarc-reward``) behind a per-call latency standing in for
  a remote service; the caller waits and burns no core, so concurrency should gain nearly
  linearly.

Each (setting, concurrency) gets a fresh emulation with that many sandboxes and a client with that
concurrency. The sandboxes are warmed first, so the timed pass measures steady-state throughput;
the cold starts (Init Duration) are reported beside it. Batches are fixed (``--batch``) so only
the concurrency changes.

    python -m flows.benchmarks.reward                        # both settings, 1/4/16, 256 trajectories
    python -m flows.benchmarks.reward --settings latency --latency-s 0.2 --concurrency 1 8 32
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.table import Table

from resources.lambda_client import LambdaRewardClient
from resources.lambda_emulator import LambdaEmulator
from tasks.envs.word_answer import QUESTIONS
from tasks.records import ScoreRequest

ANSWERS = [a for _, a in QUESTIONS] + ["puppy", "kitten", "seven", "moon", "warm", "banana"]
SETTINGS = {"model": ("rollarc-reward-model", "tasks.reward_models.answer_similarity"),
            "latency": ("rollarc-reward", "tasks.rewards.guess_number_verifier")}


def trajectories(setting: str, n: int, tag: str, seed: int = 0) -> list[ScoreRequest]:
    """A fixed set of finished trajectories (the same for every concurrency)."""
    rng = random.Random(seed)
    fn = SETTINGS[setting][1]
    out = []
    for i in range(n):
        if setting == "model":
            _, ref = rng.choice(QUESTIONS)
            responses = [f"i think it is {rng.choice(ANSWERS)}"]
            info = {"reference": ref}
        else:
            secret = rng.randint(1, 8)
            responses = [str(rng.randint(1, 8)) for _ in range(rng.randint(1, 4))]
            info = {"secret": secret, "low": 1, "high": 8, "format_penalty": 0.1,
                    "success": str(secret) in responses}
        out.append(ScoreRequest(id=str(i), idempotency_key=f"bench/{tag}/{i}", reward_fn=fn,
                                env_name=setting, env_rewards=[0.0], responses=responses,
                                info=info))
    return out


def run_one(setting: str, concurrency: int, n: int, batch: int, latency_s: float) -> dict:
    function, _ = SETTINGS[setting]
    em = LambdaEmulator.from_template(concurrency=concurrency,
                                      latency_s=latency_s if setting == "latency" else 0.0)
    # one vCPU per sandbox: the emulation otherwise derives threads from the memory size
    em.functions[function].env["OMP_NUM_THREADS"] = "1"
    with em:
        client = LambdaRewardClient(function, endpoint_url=em.url, dummy_credentials=True,
                                    concurrency=concurrency, batch_max=batch, min_batch=batch,
                                    throttle_retries=50)
        # warm every sandbox: as many concurrent one-item calls as there are sandboxes
        t = time.perf_counter()
        warm = trajectories(setting, concurrency, f"warm-{setting}-{concurrency}", seed=1)
        with ThreadPoolExecutor(concurrency) as pool:
            warmed = list(pool.map(lambda r: client.score([r]), warm))
        warm_s = time.perf_counter() - t
        inits = [rec.init_ms for b in warmed for rec in b.invocations if rec.init_ms]
        reqs = trajectories(setting, n, f"{setting}-{concurrency}")
        t = time.perf_counter()
        scored = client.score(reqs)
        elapsed = time.perf_counter() - t
        client.close()
        lost = sum(r.score is None for r in scored.results)
        if lost:
            raise RuntimeError(f"{setting} x{concurrency}: {lost} trajectories not scored: "
                               f"{next(r.error for r in scored.results if r.score is None)}")
        calls = scored.invocations
        return {
            "setting": setting, "concurrency": concurrency, "trajectories": n,
            "elapsed_s": elapsed, "trajectories_per_s": n / elapsed,
            "invocations": len(calls),
            "mean_batch": statistics.mean(r.batch_size for r in calls),
            "latency_ms_p50": statistics.median(r.latency_s * 1000 for r in calls),
            "throttles": sum(r.throttles for r in calls),
            "max_concurrent": em.stats().get("max_concurrent", 0),
            "warm_s": warm_s, "cold_starts": len(inits),
            "init_ms_mean": statistics.mean(inits) if inits else 0.0,
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16])
    p.add_argument("--trajectories", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="trajectories per invocation")
    p.add_argument("--latency-s", type=float, default=0.1, help="per call, latency setting")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    console = Console(width=140)
    rows = []
    for setting in args.settings:
        for c in args.concurrency:
            console.print(f"{setting}: concurrency {c} ...")
            rows.append(run_one(setting, c, args.trajectories, args.batch, args.latency_s))
    table = Table(title=f"{args.trajectories} trajectories, {args.batch} per invocation; "
                        "ratio = throughput / throughput at the lowest concurrency")
    for col in ("setting", "concurrency", "traj/s", "ratio", "elapsed s", "calls", "p50 ms",
                "throttles", "cold starts", "init ms"):
        table.add_column(col, justify="right")
    for setting in args.settings:
        mine = [r for r in rows if r["setting"] == setting]
        base = mine[0]["trajectories_per_s"]
        for r in mine:
            r["ratio"] = r["trajectories_per_s"] / base
            table.add_row(setting, str(r["concurrency"]), f"{r['trajectories_per_s']:.1f}",
                          f"{r['ratio']:.2f}x", f"{r['elapsed_s']:.2f}", str(r["invocations"]),
                          f"{r['latency_ms_p50']:.0f}", str(r["throttles"]),
                          str(r["cold_starts"]), f"{r['init_ms_mean']:.0f}")
    console.print(table)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
