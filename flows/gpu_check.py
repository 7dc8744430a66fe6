"""The GPU check: a few train steps of the embedded default mix in one process, with the trainer
and the inference backend on the GPU, and the figures that say whether that works and how fast.

For each inference backend asked for (``hf``; ``vllm`` through ``resources.vllm_backend`` and
``config/vllm.yaml`` when vLLM is installed) it runs :func:`flows.reference.run_reference`, the
whole recipe without Dask, with its stage functions timed, and reports:

- generation speed: sampled tokens per second over the time spent in prefill and decode (the
  reference loop rolls out one trajectory at a time, so this is the single-stream rate, not the
  batched throughput of the Dask flow), and the time per train step and per whole step;
- log-prob parity: before each train step, the trainer's log-probs of the batch's tokens on the
  very weights that sampled them, set against the behaviour log-probs the backend recorded (max
  and mean absolute difference over the response tokens, and the mean of the TIS ratio
  exp(trainer - behaviour), 1 when the two agree). In bfloat16 differences of about 1e-2 are
  the expected rounding; far larger ones mean the sampler and the trainer disagree.

vLLM is optional: without it (or without config/vllm.yaml) that part is skipped
with the reason printed, and the exit status is that of the rest. The figures go to ``--out`` as
JSON. It runs on a CPU-only machine too (``policy.device: auto`` resolves to the CPU there).

    python flows/gpu_check.py
    python flows/gpu_check.py --steps 3 --backend both --out runs/gpu_check.json
    python flows/gpu_check.py --backend hf policy.dtype=float32
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from flows.config import ConfigError, TrainConfig, load_config
from flows.reference import run_reference
from tasks.policy import torch_device, torch_dtype
from tasks.records import TrainBatch
from tasks.stages import Stages

ROOT = Path(__file__).resolve().parents[1]
VLLM_CONFIG = ROOT / "config" / "vllm.yaml"


@dataclass
class Probe:
    """Stage functions that time the real ones and measure log-prob parity before each step."""

    base: Stages = field(default_factory=Stages)
    generation_s: float = 0.0
    sampled_tokens: int = 0
    train_step_s: list[float] = field(default_factory=list)
    deltas: list[np.ndarray] = field(default_factory=list)  # trainer - behaviour, per step

    def stages(self) -> Stages:
        return replace(self.base, prefill=self.prefill, decode=self.decode,
                       train_step=self.train_step)

    def prefill(self, backend, past, observation, shape=None):
        t0 = time.perf_counter()
        out = self.base.prefill(backend, past, observation, shape=shape)
        self.generation_s += time.perf_counter() - t0
        return out

    def decode(self, backend, prefilled, past, params, seed, shape=None):
        t0 = time.perf_counter()
        out = self.base.decode(backend, prefilled, past, params, seed, shape=shape)
        self.generation_s += time.perf_counter() - t0
        self.sampled_tokens += len(out.sample.token_ids)
        return out

    def train_step(self, trainer, batch: TrainBatch):
        if hasattr(trainer, "logprobs"):
            recomputed = trainer.logprobs(batch)
            self.deltas.append(np.concatenate([
                (lp - np.asarray(s.behaviour_logprobs, dtype=np.float32))[
                    np.asarray(s.loss_mask, dtype=bool)]
                for s, lp in zip(batch.samples, recomputed, strict=True)]))
        t0 = time.perf_counter()
        stats = self.base.train_step(trainer, batch)
        self.train_step_s.append(time.perf_counter() - t0)
        return stats


def environment() -> dict:
    """torch, CUDA and the GPU, and what ``policy.device``/``policy.dtype: auto`` resolve to."""
    cfg = load_config(None, [])
    env = {"torch": torch.__version__, "cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available(),
           "device": str(torch_device(cfg.policy)),
           "dtype": str(torch_dtype(cfg.policy)).removeprefix("torch.")}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["bf16_supported"] = torch.cuda.is_bf16_supported()
    return env


def parity(deltas: list[np.ndarray]) -> dict:
    d = np.concatenate(deltas) if deltas else np.zeros(0, dtype=np.float32)
    if not d.size:
        return {"tokens": 0}
    return {"tokens": int(d.size), "max_abs": float(np.abs(d).max()),
            "mean_abs": float(np.abs(d).mean()), "tis_mean": float(np.exp(d).mean())}


def run_backend(cfg: TrainConfig) -> dict:
    """Train ``cfg.trainer.max_steps`` steps through the reference loop; its figures."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    probe = Probe()
    t0 = time.perf_counter()
    rows = run_reference(cfg, probe.stages())
    wall = time.perf_counter() - t0
    elapsed = [0.0] + [r["perf/elapsed_s"] for r in rows]
    out = {
        "steps": len(rows),
        "wall_s": wall,
        "sampled_tokens": probe.sampled_tokens,
        "generation_s": probe.generation_s,
        "tokens_per_s": probe.sampled_tokens / probe.generation_s if probe.generation_s else 0.0,
        "train_step_s": float(np.mean(probe.train_step_s)),
        "step_s": float(np.mean(np.diff(elapsed))),
        "loss": [r["train/loss"] for r in rows],
        "grad_norm": [r["train/grad_norm"] for r in rows],
        "reward_mean": [r["reward/mean"] for r in rows],
        "parity": parity(probe.deltas),
    }
    if torch.cuda.is_available():
        out["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def vllm_missing() -> str | None:
    """Why the vLLM part cannot run here, or None."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # an absent package or a broken install: either way, skip
        return f"import vllm failed: {exc.__class__.__name__}: {exc}"
    if not VLLM_CONFIG.exists():
        return f"{VLLM_CONFIG.relative_to(ROOT)} is missing"
    return None


def report(name: str, fig: dict) -> None:
    p = fig["parity"]
    print(f"[{name}] {fig['steps']} steps in {fig['wall_s']:.1f} s: "
          f"{fig['tokens_per_s']:.1f} sampled tokens/s ({fig['sampled_tokens']} tokens in "
          f"{fig['generation_s']:.2f} s of prefill and decode), train step {fig['train_step_s']:.3f} s, "
          f"whole step {fig['step_s']:.2f} s", flush=True)
    print(f"[{name}] loss {[round(x, 4) for x in fig['loss']]}, "
          f"grad norm {[round(x, 4) for x in fig['grad_norm']]}, "
          f"reward {[round(x, 3) for x in fig['reward_mean']]}", flush=True)
    if p["tokens"]:
        print(f"[{name}] log-prob parity over {p['tokens']} response tokens: max |d| "
              f"{p['max_abs']:.2e}, mean |d| {p['mean_abs']:.2e}, mean TIS ratio "
              f"exp(trainer - behaviour) {p['tis_mean']:.4f}", flush=True)
    if "gpu_peak_gib" in fig:
        print(f"[{name}] peak GPU memory {fig['gpu_peak_gib']:.2f} GiB", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3, help="train steps per backend (default 3)")
    p.add_argument("--backend", choices=("hf", "vllm", "both"), default="both",
                   help="inference backends to check (default both)")
    p.add_argument("--out", default="runs/gpu_check.json", help="JSON of the figures")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides of both configs")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = [f"trainer.max_steps={args.steps}", "reward.backend=local", *args.overrides]
    env = environment()
    print(f"torch {env['torch']}, CUDA {env['cuda']}, GPU {env.get('gpu', 'none')}; policy on "
          f"{env['device']} in {env['dtype']}", flush=True)
    figures: dict = {"environment": env, "steps": args.steps, "backends": {}}
    status = 0
    for name in ("hf", "vllm") if args.backend == "both" else (args.backend,):
        reason = vllm_missing() if name == "vllm" else None
        if reason:
            print(f"[{name}] skipped: {reason}", flush=True)
            figures["backends"][name] = {"skipped": reason}
            continue
        try:
            cfg = load_config(str(VLLM_CONFIG) if name == "vllm" else None, overrides)
            figures["backends"][name] = fig = run_backend(cfg)
        except ConfigError as exc:
            print(f"config error: {exc}", file=sys.stderr)
            return 2
        except Exception as exc:  # report it, still write the other backend's figures
            traceback.print_exc()
            print(f"[{name}] failed: {exc.__class__.__name__}: {exc}", flush=True)
            figures["backends"][name] = {"error": f"{exc.__class__.__name__}: {exc}"}
            status = 1
            continue
        report(name, fig)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=2) + "\n")
    print(f"figures: {out}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
