"""The engine profile: does the device model's shape predict a real inference engine's step time?

Times one engine step over a grid (:class:`flows.benchmarks.engine_profile.Grid`): a decode step
of ``batch`` sequences at ``context`` tokens, and a prefill chunk of ``n`` tokens after ``context``
cached ones; each point is the median of ``--reps`` timed steps after ``--warmup`` untimed ones.
The device model's structure is then fitted on half of the grid and checked on the other half
(:mod:`flows.benchmarks.engine_profile`). On a CPU the fitted constants are the CPU's; what
matters is whether the model's form predicts the engine. Backends, all on the config's policy
(``config/vllm.yaml``'s tiny Qwen2 by default, so the figures compare):

- ``vllm``: a vLLM ``LLMEngine`` as the backend builds it (``build_llm_engine``), stepped by hand.
  A decode point adds ``batch`` requests of distinct random prompts (no prefix-cache hits),
  prefills them in one step and times the decode steps. A prefill point first runs a request
  whose prompt is the ``context``-token prefix (a multiple of the block size), so that each
  timed request, the prefix plus ``n`` fresh tokens, finds ``context`` tokens in the prefix cache
  and prefills ``n`` in one step. One engine serves every point (its token budget holds any of
  them whole); requests carry no seed (a CPU generator cannot rewind over a split prefill).
- ``hf``: :class:`resources.engine.InferenceEngine`'s batched forward pass (``_run``) on requests
  with a random past KV of ``context`` tokens and 1 (decode) or ``n`` (prefill) new tokens.
- ``emulated``: :class:`resources.emulated_engine.EmulatedEngine` running the policy's shape on
  an H800 (bf16, the default MFU/MBU), its real wall time per step divided by ``time_scale``
  (emulated seconds): a check that it realises its own device model, whose floor
  (:attr:`resources.device_model.DeviceModel.step_floor`) the fit should give back, any
  overhead of the emulation on top of it.

``--threads`` (default 1) runs the CPU engines on that many threads, unbound: a multi-threaded
engine on a small machine shared with other processes waits at every parallel region for a
thread the OS has descheduled, and its step times turn into scheduler noise (tens of ms, for
steps of 2 ms). ``--threads 0`` leaves the engines' own settings (vLLM binds one thread per core).

    python flows/bench_engine.py --backend hf --quick
    python flows/bench_engine.py --backend vllm --out runs/bench_engine/vllm.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from flows.benchmarks.engine_profile import (
    Grid,
    Point,
    featurize,
    fit_and_check,
    print_report,
    report_json,
    split,
)
from flows.config import load_config
from resources.catalog import get_profile
from resources.device_model import DeviceModel, ModelSpec
from tasks.specs import PolicySpec

BACKENDS = ("vllm", "hf", "emulated")
BLOCK_SIZE = 32
KV_CACHE_BYTES = 256 << 20
EMULATED_PROFILE = "H800"

# one timed step: a callable that runs it and returns its seconds
Step = Callable[[], float]


def _samples(step: Step, warmup: int, reps: int) -> list[float]:
    for _ in range(warmup):
        step()
    return [step() for _ in range(reps)]


def _points(grid: Grid, measure: Callable[[str, int, int], tuple[list[float], float]],
            console: Console) -> list[Point]:
    """Every decode then prefill point, ``measure(kind, size, context)`` giving the samples and
    the mean context of the timed steps."""
    points = []
    for kind, sizes in (("decode", grid.batches), ("prefill", grid.chunks)):
        for size in sizes:
            for context in grid.contexts:
                samples, kv_context = measure(kind, size, context)
                points.append(Point(kind, size, context, kv_context, samples))
                console.log(f"{kind} {size:>3} @ {context:>3}: "
                            f"{np.median(samples) * 1e3:.4g} ms")
    return points


# -- hf -------------------------------------------------------------------------------------------
def profile_hf(spec: PolicySpec, grid: Grid, warmup: int, reps: int, console: Console,
               threads: int) -> tuple[list[Point], ModelSpec, dict[str, Any]]:
    import torch

    from resources.engine import InferenceEngine, _Request
    from tasks.policy import load_policy

    if threads:
        torch.set_num_threads(threads)
    model, _ = load_policy(spec)
    engine = InferenceEngine(model, max_batch=max(grid.batches))
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def request(past: int, new: int) -> _Request:
        kv = torch.randn(engine.layers, 2, engine.kv_heads, past, engine.head_dim, generator=gen)
        return _Request(kv, torch.randint(0, vocab, (new,), generator=gen).tolist(), Future())

    def measure(kind: str, size: int, context: int) -> tuple[list[float], float]:
        batch = ([request(context, 1) for _ in range(size)] if kind == "decode"
                 else [request(context, size)])

        def step() -> float:
            t0 = time.perf_counter()
            engine._run(batch)
            return time.perf_counter() - t0

        return _samples(step, warmup, reps), float(context)

    try:
        points = _points(grid, measure, console)
    finally:
        engine.close()
    width = model.dtype.itemsize
    model_spec = ModelSpec.from_hf_config(model.config.to_dict(), width, width)
    return points, model_spec, {"engine": "resources.engine.InferenceEngine._run",
                                "dtype": str(model.dtype), "torch_threads": torch.get_num_threads()}


# -- vllm -----------------------------------------------------------------------------------------
def profile_vllm(spec: PolicySpec, grid: Grid, warmup: int, reps: int, console: Console,
                 max_model_len: int) -> tuple[list[Point], ModelSpec, dict[str, Any]]:
    from resources.vllm_engine import build_llm_engine, import_vllm, policy_dir, resolve_dtype

    vllm = import_vllm()
    model_dir, dtype = policy_dir(spec), resolve_dtype(spec)
    max_batch = max(grid.batches)
    budget = max(max_batch * max(grid.contexts), max(grid.contexts) + max(grid.chunks))
    if max(grid.contexts) + max(grid.chunks) + warmup + reps + 2 > max_model_len:
        raise ValueError(f"--max-model-len {max_model_len} is too short for the grid")
    if any(c % BLOCK_SIZE for c in grid.contexts):
        raise ValueError(f"contexts must be multiples of the block size {BLOCK_SIZE}")
    t0 = time.perf_counter()
    engine = build_llm_engine(model_dir, max_batch=max_batch, max_context=max_model_len,
                              dtype=dtype, block_size=BLOCK_SIZE, kv_cache_bytes=KV_CACHE_BYTES,
                              extra_args=dict(max_num_batched_tokens=budget))
    startup_s = time.perf_counter() - t0
    config = json.loads((Path(model_dir) / "config.json").read_text())
    vocab = int(config["vocab_size"])
    rng = np.random.default_rng(0)
    ids = iter(range(10**9))

    def prompt(n: int) -> list[int]:
        return rng.integers(0, vocab, n).tolist()

    def add(tokens: list[int], max_tokens: int) -> str:
        rid = f"r{next(ids)}"
        params = vllm.SamplingParams(max_tokens=max_tokens, temperature=1.0, detokenize=False,
                                     ignore_eos=True)
        engine.add_request(rid, vllm.TokensPrompt(prompt_token_ids=tokens), params)
        return rid

    def timed_step(expect: int) -> tuple[float, list]:
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        if len(outs) != expect:
            raise RuntimeError(f"a step served {len(outs)} requests, not {expect}")
        return dt, outs

    def drain() -> None:
        while engine.has_unfinished_requests():
            engine.step()

    def measure(kind: str, size: int, context: int) -> tuple[list[float], float]:
        if kind == "decode":
            rids = [add(prompt(context), warmup + reps + 2) for _ in range(size)]
            timed_step(size)  # the prompts' prefill (and first token), in one step
            samples = [timed_step(size)[0] for _ in range(warmup + reps)][warmup:]
            engine.abort_request(rids)
            drain()
            # the i-th decode step reads context + 1 + i tokens
            return samples, context + 1 + warmup + (reps - 1) / 2
        prefix = prompt(context)
        add(prefix, 1)
        drain()

        def step() -> float:
            add(prefix + prompt(size), 1)
            dt, outs = timed_step(1)
            if not outs[0].finished or outs[0].num_cached_tokens != context:
                raise RuntimeError(f"prefill of {size} after {context}: "
                                   f"{outs[0].num_cached_tokens} cached, "
                                   f"finished={outs[0].finished}")
            return dt

        return _samples(step, warmup, reps), float(context)

    points = _points(grid, measure, console)
    model_spec = ModelSpec.from_hf_config(config, 4 if dtype == "float32" else 2,
                                          4 if dtype == "float32" else 2)
    return points, model_spec, {"engine": "vllm.v1 LLMEngine (build_llm_engine)",
                                "vllm": vllm.__version__, "dtype": dtype,
                                "max_model_len": max_model_len, "block_size": BLOCK_SIZE,
                                "max_num_batched_tokens": budget, "startup_s": startup_s}


# -- emulated -------------------------------------------------------------------------------------
def profile_emulated(spec: PolicySpec, grid: Grid, warmup: int, reps: int, console: Console,
                     target_s: float) -> tuple[list[Point], ModelSpec, dict[str, Any]]:
    from resources.emulated import DeviceEmulation
    from resources.emulated_engine import EmulatedEngine
    from tasks.policy import load_policy

    model, _ = load_policy(spec)
    model_spec = ModelSpec.from_hf_config(model.config.to_dict())  # production: bf16
    emu = DeviceEmulation()
    device = DeviceModel(model_spec, get_profile(EMULATED_PROFILE), 1, emu.mfu, emu.mbu,
                         emu.memory_utilization)
    modelled = (sum(device.decode_step_time([c] * b) for b in grid.batches for c in grid.contexts)
                + sum(device.prefill_time(n, c) for n in grid.chunks for c in grid.contexts))
    time_scale = target_s / (modelled * (warmup + reps))
    engine = EmulatedEngine(device, time_scale, chunk_tokens=max(grid.chunks),
                            max_seqs=max(grid.batches))
    pool = ThreadPoolExecutor(max_workers=max(grid.batches) + 1)
    gather = [0.02]  # real seconds the engine is held while a batch's requests arrive

    def decode_step(batch: int, context: int) -> float:
        """``batch`` decodes admitted together: each joins while a pause holds the engine, and
        the step's time runs from the pause's end to the last one's return. A batch that did
        not make it into one step is run again with a longer hold."""
        stats = engine.stats
        for _ in range(6):
            loads, steps, tokens = stats.weight_loads, stats.decode_steps, stats.decode_tokens
            released = pool.submit(lambda: (engine.pause(gather[0] / time_scale),
                                            time.perf_counter())[1])
            while stats.weight_loads == loads:
                time.sleep(1e-4)
            done = [pool.submit(lambda: (engine.decode(context, 1), time.perf_counter())[1])
                    for _ in range(batch)]
            end = max(f.result() for f in done)
            if (stats.decode_steps - steps, stats.decode_tokens - tokens) == (1, batch):
                return end - released.result()
            gather[0] *= 2
        raise RuntimeError(f"{batch} decodes did not run as one step")

    def prefill_step(n: int, context: int) -> float:
        t = time.perf_counter()
        engine.prefill(n, context)
        return time.perf_counter() - t

    def measure(kind: str, size: int, context: int) -> tuple[list[float], float]:
        fn = decode_step if kind == "decode" else prefill_step
        samples = _samples(lambda: fn(size, context) / time_scale, warmup, reps)
        return samples, float(context)

    try:
        points = _points(grid, measure, console)
    finally:
        engine.close()
        pool.shutdown()
    return points, model_spec, {
        "engine": "resources.emulated_engine.EmulatedEngine", "profile": EMULATED_PROFILE,
        "time_scale": time_scale, "unit": "emulated seconds (real / time_scale)",
        "expected": {"floor_s": device.step_floor,
                     "flops_per_s": device.hw.peak_flops * device.mfu,
                     "bytes_per_s": device.hw.mem_bandwidth * device.mbu}}


# -- command line ---------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=BACKENDS, required=True)
    ap.add_argument("--out", type=Path, help="JSON report (default runs/bench_engine/<backend>.json)")
    ap.add_argument("--quick", action="store_true", help="about a quarter of the grid")
    ap.add_argument("--config", default="config/vllm.yaml", help="config whose policy is profiled")
    ap.add_argument("--policy-path", help="a Hugging Face model directory instead")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per point")
    ap.add_argument("--reps", type=int, default=5, help="timed steps per point (median)")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU threads of the hf and vllm engines, unbound (0: their defaults)")
    ap.add_argument("--max-model-len", type=int, default=512, help="vllm: max_model_len")
    ap.add_argument("--emulated-seconds", type=float, default=None,
                    help="emulated: real seconds the grid's modelled steps take (sets "
                         "time_scale; default 20, 5 with --quick)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.reps < 3:
        ap.error("--reps must be at least 3")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.threads:  # before torch starts its thread pool
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    logging.basicConfig(level=logging.WARNING)
    console = Console(width=140)
    spec = load_config(args.config).policy
    if args.policy_path:
        spec = spec.model_copy(update={"path": args.policy_path})
    grid = Grid.quick() if args.quick else Grid()
    if args.backend == "hf":
        points, model_spec, extra = profile_hf(spec, grid, args.warmup, args.reps, console,
                                                args.threads)
        hardware = "CPU"
    elif args.backend == "vllm":
        points, model_spec, extra = profile_vllm(spec, grid, args.warmup, args.reps, console,
                                                 args.max_model_len)
        hardware = "CPU"
    else:
        seconds = args.emulated_seconds or (5.0 if args.quick else 20.0)
        points, model_spec, extra = profile_emulated(spec, grid, args.warmup, args.reps,
                                                     console, seconds)
        hardware = EMULATED_PROFILE
    # features depend on the model and dtype only: the profile just gives DeviceModel a device
    featurize(points, DeviceModel(model_spec, get_profile(hardware)))
    split(points, grid)
    fits = fit_and_check(points)
    wall_s = time.perf_counter() - t0
    unit = "emulated s" if args.backend == "emulated" else "s"
    print_report(console, points, fits, unit, f"{args.backend} engine profile")
    console.print(f"wall time: {wall_s:.1f} s (config, model and engine start included)")
    report = report_json(points, fits, grid, dict(
        backend=args.backend, quick=args.quick, config=args.config, policy=spec.model_dump(),
        model_spec=model_spec.model_dump(), warmup=args.warmup, reps=args.reps, wall_s=wall_s,
        threads=args.threads or "engine default",
        **extra))
    out = args.out or Path("runs/bench_engine") / f"{args.backend}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    console.print(f"saved {out}")
    return report


if __name__ == "__main__":
    main()
