"""The embedded default's training, done by Hugging Face TRL instead, and the two side by side.

TRL's ``GRPOTrainer`` (the ``trl`` extra) trains the very policy ``flows/train.py`` trains by
default, on the same work: the tiny Qwen2 of ``policy`` (``tasks.policy.load_policy``: same
architecture, init seed and tokenizer), the env tasks of the mix with their weights, group size,
environments and reward functions, 64 trajectories per step in ``trainer.minibatches``
optimiser steps, the learning rate and its linear decay, gradient clipping, PPO clip, entropy
bonus, sampling temperature and ``max_new_tokens``. Its multi-turn ``rollout_func`` (TRL's hook
for custom generation, https://huggingface.co/docs/trl/grpo_trainer) plays every trajectory of
a generation batch turn by turn, the live ones batched into one ``model.generate`` call per
turn, and encodes turns with the project's own functions (``tasks.env_steps.env_reset`` /
``env_step``: ``encode_first_turn``, ``encode_next_turn``), so a trajectory is token for token
what RollArc trains: the first turn's prompt is TRL's prompt, the rest its completion, with the
environment's tokens masked out (``env_mask``). Rewards go through the reward service's own
core (``tasks.reward_service.handle``), as the Lambda functions score them.

Departures, TRL's by design: one process, one batch barrier per step (generate, score, train),
no KV cache kept between turns (each turn re-reads the conversation), TRL's GRPO loss (token
mean per minibatch, ``loss_type=bnpo``: RollArc's normalisation; the behaviour and proximal
policies coincide, so RollArc's TIS weight would be 1) and no evaluation rounds.

    # one TRL run (CPU), figures in runs/trl_baseline/seed0/trl_baseline.json
    python -m flows.benchmarks.trl_baseline --steps 80 --seed 0
    # RollArc's default and TRL back to back, seeds interleaved, and the table
    python -m flows.benchmarks.trl_baseline --compare --steps 80 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from pathlib import Path

import torch

from flows.benchmarks.trl_compare import FROZEN_LR, compare, pool, run_figures
from flows.config import TrainConfig, load_config, reward_callables
from flows.config.derived import batch_trajectories, reward_name
from flows.monitoring.metrics import by_env, token_metrics
from flows.training.episode import RolloutRecord, sampling_params, score_requests, turn_ends
from flows.training.orchestration import GroupDraw
from resources.heap import keep_freed_memory
from tasks.env_steps import EnvRegistry, env_reset, env_step
from tasks.policy import load_policy, stop_token_ids
from tasks.records import SamplingParams, TurnSample
from tasks.reward_service import SCHEMA_VERSION, handle

logger = logging.getLogger(__name__)


# -- what TRL is given --------------------------------------------------------------------------


def uniform_sampling(cfg: TrainConfig) -> SamplingParams:
    """The one sampling setting of every env task (TRL recomputes log-probs at one
    temperature); a mix whose tasks sample differently is refused."""
    params = list(sampling_params(cfg).values())
    if any(p != params[0] for p in params):
        raise ValueError(f"the TRL baseline needs one sampling setting for every env task: {params}")
    return params[0]


def group_prompts(cfg: TrainConfig, steps: int) -> list[str]:
    """One dataset row per group, in the order RollArc draws them (``GroupDraw``, seeded by
    ``cfg.seed``): its env task and environment seed, as JSON (TRL hands ``rollout_func`` only
    the prompts, each repeated ``group_size`` times)."""
    sizes = {t.group_size for t in cfg.env_tasks}
    if len(sizes) != 1:
        raise ValueError(f"TRL's num_generations is one group size for all env tasks: {sizes}")
    draw, size = GroupDraw(cfg.env_tasks, random.Random(cfg.seed)), sizes.pop()
    return [json.dumps({"group_id": gid, "env_task": env_task.name, "seed": seed})
            for _ in range(steps * cfg.trainer.groups_per_step)
            for gid, env_task, seed in draw.take(size)]


def lr_factor(cfg: TrainConfig):
    """RollArc's lr schedule by optimiser step: linear by policy version (one version per
    ``minibatches`` optimiser steps) down to ``lr_final_ratio`` at ``trainer.max_steps``."""
    hp, steps = cfg.trainer.hparams, cfg.trainer.max_steps

    def factor(opt_step: int) -> float:
        version = opt_step // hp.minibatches
        return 1.0 - (1.0 - hp.lr_final_ratio) * min(version / steps, 1.0)

    return factor


def grpo_config(cfg: TrainConfig, out_dir: Path):
    """TRL's settings for the same step: ``minibatches`` optimiser steps of one generation
    batch of ``batch_trajectories`` trajectories, on the CPU in float32."""
    from trl import GRPOConfig

    hp, sampling = cfg.trainer.hparams, uniform_sampling(cfg)
    batch = batch_trajectories(cfg)
    if batch % hp.minibatches or hp.ppo_epochs != 1:
        raise ValueError("the TRL baseline needs minibatches dividing the batch and ppo_epochs 1")
    return GRPOConfig(
        output_dir=str(out_dir / "trainer"), seed=cfg.seed, use_cpu=True, bf16=False,
        num_generations=cfg.env_tasks[0].group_size,
        per_device_train_batch_size=batch // hp.minibatches, gradient_accumulation_steps=1,
        steps_per_generation=hp.minibatches, num_iterations=1,
        max_steps=cfg.trainer.max_steps * hp.minibatches,
        learning_rate=hp.lr, weight_decay=hp.weight_decay, max_grad_norm=hp.max_grad_norm,
        epsilon=hp.clip_eps, beta=0.0, loss_type="bnpo", scale_rewards="group",
        entropy_coef=hp.entropy_coef, temperature=sampling.temperature,
        max_completion_length=cfg.policy.max_context,
        shuffle_dataset=False,  # the groups in RollArc's draw order
        report_to="none", save_strategy="no", logging_steps=10 * hp.minibatches, disable_tqdm=True,
        dataloader_num_workers=0,
    )


# -- the multi-turn rollout ----------------------------------------------------------------------


class MultiTurnRollout:
    """TRL's ``rollout_func``: plays one generation batch's trajectories to the end, every live
    trajectory's turn in one ``generate`` call, with the project's environments and turn
    encoding. ``last_batch`` keeps the batch's trajectories for the step log."""

    def __init__(self, cfg: TrainConfig, tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.sampling = uniform_sampling(cfg)
        self.stop_ids = stop_token_ids(tokenizer)
        self.env_tasks = {t.name: t for t in cfg.env_tasks}
        self.reward_fns = {t.name: reward_name(t) for t in cfg.env_tasks}
        self.envs = EnvRegistry("trl")
        self.next_id = 0
        self.last_batch: list = []

    def __call__(self, prompts: list[str], trainer) -> dict[str, list]:
        model = trainer.accelerator.unwrap_model(trainer.model)
        recs, obs = [], []
        for prompt in prompts:
            group = json.loads(prompt)
            rec = RolloutRecord(self.next_id, group["group_id"],
                                self.env_tasks[group["env_task"]], int(group["seed"]))
            self.next_id += 1
            recs.append(rec)
            obs.append(env_reset(self.envs, self.tokenizer, rec.env_task.env, rec.seed,
                                 f"trl.{rec.traj_id}", self.cfg.policy.system_prompt))
        trajs: list = [None] * len(recs)
        live = list(range(len(recs)))
        while live:
            samples = self.generate(model, [recs[i].tokens + obs[i].input_ids for i in live])
            still = []
            for i, sample in zip(live, samples, strict=True):
                nxt = env_step(self.envs, self.tokenizer, obs[i], sample)
                recs[i].record_turn(nxt)
                over, context_limited = turn_ends(recs[i], nxt, self.sampling.max_new_tokens,
                                                  self.cfg.policy.max_context)
                if over:
                    if context_limited and not nxt.done:
                        self.envs.close(nxt.handle.instance_id)
                    trajs[i] = recs[i].to_trajectory(nxt, context_limited)
                else:
                    obs[i] = nxt
                    still.append(i)
            live = still
        self.last_batch = trajs
        return self.outputs(trajs)

    def generate(self, model, contexts: list[list[int]]) -> list[TurnSample]:
        """One turn of every context (token ids so far, ending with the generation prompt):
        sampled at the temperature over the whole vocabulary, up to ``max_new_tokens`` or a stop
        token, with each token's log-prob at that temperature (what the trainer recomputes)."""
        pad = self.tokenizer.pad_token_id
        width = max(map(len, contexts))
        ids = torch.tensor([[pad] * (width - len(c)) + c for c in contexts])
        attn = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids.to(model.device), attention_mask=attn.to(model.device),
                do_sample=True, temperature=self.sampling.temperature, top_k=0, top_p=1.0,
                max_new_tokens=self.sampling.max_new_tokens, eos_token_id=self.stop_ids,
                pad_token_id=pad, return_dict_in_generate=True, output_logits=True)
        new = out.sequences[:, width:].cpu()
        logp = torch.stack(out.logits, 1).float().cpu() / self.sampling.temperature
        logp = torch.log_softmax(logp, -1).gather(2, new[..., None]).squeeze(-1)
        samples = []
        for row, lps in zip(new.tolist(), logp.tolist(), strict=True):
            n = next((k + 1 for k, t in enumerate(row) if t in self.stop_ids), len(row))
            tokens, stopped = row[:n], row[n - 1] in self.stop_ids
            text_ids = tokens[:-1] if stopped else tokens
            samples.append(TurnSample(
                token_ids=tokens, logprobs=lps[:n], versions=[0] * n,
                text=self.tokenizer.decode(text_ids, skip_special_tokens=True), stopped=stopped,
                context_full=False, decode_tokens_processed=n))
        return samples

    def outputs(self, trajs: list) -> dict[str, list]:
        """TRL's rollout fields: the first turn's prompt, the rest as the completion with the
        environment's tokens masked out, the sampler's log-probs, and the score request."""
        out: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "logprobs": [],
                                "env_mask": [], "score_request": []}
        requests = score_requests(trajs, self.reward_fns, "trl")
        for t, request in zip(trajs, requests, strict=True):
            first = int(t.loss_mask.argmax())  # the first sampled token
            out["prompt_ids"].append(t.token_ids[:first].tolist())
            out["completion_ids"].append(t.token_ids[first:].tolist())
            out["logprobs"].append(t.behaviour_logprobs[first:].tolist())
            out["env_mask"].append(t.loss_mask[first:].astype(int).tolist())
            out["score_request"].append(request.to_json())
        return out


def reward_scorer(cfg: TrainConfig):
    """TRL's reward function: each trajectory scored by the reward service's core, as the
    Lambda functions score it."""
    functions = reward_callables(cfg)

    def rollarc_reward(prompts, completions, score_request, **_) -> list[float | None]:
        res = handle({"schema_version": SCHEMA_VERSION, "items": list(score_request)}, functions)
        return [r["score"] for r in res["results"]]

    return rollarc_reward


# -- one TRL run ---------------------------------------------------------------------------------


def step_logger(rollout: MultiTurnRollout, minibatches: int, rows: list[dict]):
    """A TRL callback writing RollArc's metric row per train step (one generation batch):
    ``train/step``, ``perf/elapsed_s`` from the start of training, the batch's size and tokens
    (:func:`token_metrics`), ``env/<task>/success``."""
    from transformers import TrainerCallback

    class StepLog(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if state.global_step % minibatches:
                return
            row = {"train/step": state.global_step // minibatches,
                   "perf/elapsed_s": time.perf_counter() - self.t0,
                   **token_metrics(rollout.last_batch)}
            for name, ts in by_env(rollout.last_batch).items():
                row[f"env/{name}/success"] = sum(t.success for t in ts) / len(ts)
            rows.append(row)
            logger.info("step %d: %.2fs, %s", row["train/step"], row["perf/elapsed_s"],
                        {k: round(v, 3) for k, v in row.items() if k.endswith("success")})

    return StepLog()


def run_baseline(cfg: TrainConfig, out_dir: Path, threads: int = 1,
                 heap_keep_mb: float = 0) -> dict:
    """Train ``cfg.trainer.max_steps`` steps with TRL on ``threads`` torch threads; writes
    ``metrics.jsonl`` (RollArc's row shape) and ``trl_baseline.json`` (:func:`run_figures`,
    TRL's version) under ``out_dir``. ``heap_keep_mb``: the process keeps freed memory as
    RollArc's workers do (:mod:`resources.heap`; 0: the C library's defaults, as a TRL user
    runs it)."""
    import trl
    from datasets import Dataset
    from trl import GRPOTrainer

    if heap_keep_mb > 0 and not keep_freed_memory(int(heap_keep_mb * 2**20)):
        raise RuntimeError("--heap-keep-mb: this C library's allocator has no glibc mallopt")
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(threads)
    model, tokenizer = load_policy(cfg.policy, dtype=torch.float32)
    args = grpo_config(cfg, out_dir)
    rollout = MultiTurnRollout(cfg, tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.hparams.lr,
                                  weight_decay=cfg.trainer.hparams.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg))
    rows: list[dict] = []
    trainer = GRPOTrainer(
        model=model, processing_class=tokenizer, reward_funcs=[reward_scorer(cfg)], args=args,
        train_dataset=Dataset.from_dict({"prompt": group_prompts(cfg, cfg.trainer.max_steps)}),
        rollout_func=rollout, optimizers=(optimizer, scheduler),
        callbacks=[step_logger(rollout, cfg.trainer.hparams.minibatches, rows)])
    trainer.train()
    (out_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    figures = run_figures(rows) | {"system": "trl", "seed": cfg.seed, "threads": threads,
                                   "heap_keep_mb": heap_keep_mb,
                                   "trl_version": trl.__version__}
    (out_dir / "trl_baseline.json").write_text(json.dumps(figures, indent=2))
    return figures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=80, help="train steps (trainer.max_steps)")
    ap.add_argument("--seed", type=int, default=0, help="seed of one TRL run")
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--compare", action="store_true",
                      help="RollArc's default and TRL back to back over --seeds, interleaved")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    what.add_argument("--pool", nargs="+", metavar="DIR", default=None,
                      help="report the runs of earlier --compare outputs (DIR/compare.json) as "
                           "one, seeds paired as before; --out DIR keeps the pooled compare.json")
    ap.add_argument("--frozen", action="store_true",
                    help="both policies held at their initialisation (learning rate "
                         f"{FROZEN_LR:g}, every pass still run): every step the same work in "
                         "both systems, so s/step compares the systems alone")
    # RollArc's workers run one torch thread each (cluster.pools[].torch_threads); on tensors
    # this small a second OpenMP thread buys nothing and, on a loaded machine, spins
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the TRL process")
    ap.add_argument("--heap-keep-mb", type=float, default=0,
                    help="the TRL process keeps this much freed memory for reuse, as RollArc's "
                         "workers do (cluster.heap_keep_mb); 0: the C library's defaults, as a "
                         "TRL user runs it")
    ap.add_argument("--out", default=None, help="output directory (default: runs/trl_baseline/"
                                                "seed<seed>, or runs/trl_compare)")
    ap.add_argument("overrides", nargs="*", help="config overrides for every run (key=value)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = [*args.overrides, f"trainer.hparams.lr={FROZEN_LR}"] if args.frozen \
        else args.overrides
    if args.pool:
        if args.frozen or args.overrides:
            ap.error("--pool reports runs already made: --frozen and overrides do not apply")
        try:
            pool([Path(d) for d in args.pool], Path(args.out) if args.out else None)
        except (OSError, ValueError) as e:
            ap.error(str(e))
        return 0
    if args.compare:
        compare(args.seeds, args.steps, Path(args.out or "runs/trl_compare"), overrides,
                args.threads, args.heap_keep_mb)
        return 0
    cfg = load_config(None, [f"seed={args.seed}", f"trainer.max_steps={args.steps}",
                             "policy.device=cpu", *overrides])
    figures = run_baseline(cfg, Path(args.out or f"runs/trl_baseline/seed{args.seed}"),
                           args.threads, args.heap_keep_mb)
    logger.info("trl %s: %.2f s/step, target at step %s (%s s)", figures["trl_version"],
                figures["s_per_step"], figures["step_to_target"], figures["s_to_target"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
