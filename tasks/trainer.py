"""The policy trainer: lives on the TRAINER worker, owns the weights and the optimiser.

The flows see it only through the :class:`Trainer` protocol; :func:`policy_trainer` builds the
shipped implementation from config.

The trainer keeps float32 master weights on ``policy.device`` and, when ``policy.dtype``
resolves to bfloat16 (the default on a GPU), runs its forward passes under bfloat16 autocast: the
optimiser updates stay in float32 while the matrix products run at bf16 speed; log-probs are
taken in float32 either way. float16 applies to the inference engine only (training in it would
need loss scaling). What leaves the trainer is device-independent: exported weights are float32 numpy
arrays and checkpoints hold CPU tensors.
"""

from __future__ import annotations

import os
import random
import threading
import time
import warnings
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from tasks.losses import LossFn, decoupled_ppo_loss
from tasks.policy import load_policy, save_policy, torch_dtype
from tasks.records import TrainBatch, TrainStats, WeightsSnapshot
from tasks.specs import PolicySpec, TrainerHParams

# Config keys of Hugging Face architectures whose logits are more than the output embedding's
# linear map of the last hidden state (Gemma 2's soft-capping, Cohere's and Granite's scaling):
# those models' log-probs are taken from their full forward.
HEAD_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


@runtime_checkable
class Trainer(Protocol):
    """What the flows need of a trainer on the TRAINER worker.

    - ``version`` counts completed train steps: 0 for fresh weights, +1 per ``train_step``.
    - ``train_step`` trains on a batch built for the current version (any other version is an
      error) and returns stats stamped with the version after the step.
    - ``export_weights`` may run on another thread during a train step; a snapshot never mixes
      parameters from before and after a step, and its version is that of its parameters.
    - ``save_checkpoint`` writes ``<run_dir>/policy/`` (a Hugging Face directory) and
      ``<run_dir>/checkpoint.pt`` and returns the latter's path.
    - ``load_checkpoint`` restores weights, optimiser, schedule, version and every RNG the
      trainer draws from, so the next step equals that of an uninterrupted run; returns the
      restored version.
    """

    version: int

    def train_step(self, batch: TrainBatch) -> TrainStats: ...

    def export_weights(self) -> WeightsSnapshot: ...

    def save_checkpoint(self, run_dir: str) -> str: ...

    def load_checkpoint(self, path: str) -> int: ...


class PolicyTrainer:
    """Decoupled PPO on a causal LM (implements :class:`Trainer`)."""

    def __init__(self, model, tokenizer, hp: TrainerHParams, seed: int = 0,
                 loss: LossFn | None = None, autocast: torch.dtype | None = None):
        """``model`` in float32 on its device; ``autocast``: the dtype its forward passes run
        in (bfloat16), or None for plain float32."""
        self.model, self.tokenizer, self.hp = model, tokenizer, hp
        self.device = next(model.parameters()).device
        self.autocast = autocast
        self.loss = loss or decoupled_ppo_loss
        # Eval mode throughout (gradients still flow): dropout would make the proximal and
        # current log-probs noisy, so the PPO ratio and the IS weight would be off even at
        # staleness 0, and the sampler's log-probs come from an eval-mode model too.
        self.model.eval()
        config = getattr(model, "config", None)
        self._plain_head = (model.get_output_embeddings() is not None
                            and model.base_model is not model
                            and all(getattr(config, k, None) in (None, 1, 1.0)
                                    for k in HEAD_TRANSFORMS))
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=hp.lr,
                                           weight_decay=hp.weight_decay)
        self.version = 0  # read by the lr schedule, so set before it
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        # train_step and export_weights may run on two threads of the trainer worker: a
        # snapshot must never mix parameters from before and after an optimiser step
        self._lock = threading.Lock()
        torch.manual_seed(seed)
        # The trainer's own stream: other code on the worker draws from the global ``random``,
        # which would make the minibatch order, hence the run, irreproducible.
        self._shuffle_rng = random.Random(seed)

    def _lr_factor(self, _: int) -> float:
        """Linear decay by policy version (so a resumed run continues the same schedule)."""
        if not self.hp.total_steps:
            return 1.0
        frac = min(self.version / self.hp.total_steps, 1.0)
        return 1.0 - (1.0 - self.hp.lr_final_ratio) * frac

    def _autocast(self) -> AbstractContextManager:
        if self.autocast is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def _logprobs(self, ids: torch.Tensor, mask: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-prob of each token given its prefix ([B, T], position 0 gets 0) and entropy.

        ``mask`` ([B, T] bool): only its positions are needed (the tokens the loss reads). The
        language-model head and the softmax over the vocabulary then run on those positions
        alone, the others get 0: in a multi-turn trajectory most tokens are prompt and
        environment observations, and at a real vocabulary the full ``[B, T, V]`` logits are the
        largest tensor of the step. Models whose head does more than a linear map
        (:data:`HEAD_TRANSFORMS`) and ``mask=None`` get every position.

        Rows are padded on the right, so the causal mask alone keeps every real token from
        attending to padding, and positions count from 0 as they do unpadded: no attention mask
        is passed, which lets SDPA take its causal kernel. The padded positions' values are
        never read (the loss mask is 0 there)."""
        keep = None if mask is None or not self._plain_head else mask[:, 1:]
        with self._autocast():
            if keep is None:
                logits = self.model(input_ids=ids, use_cache=False).logits[:, :-1]
            else:
                hidden = self.model.base_model(input_ids=ids, use_cache=False).last_hidden_state
                logits = self.model.get_output_embeddings()(hidden[:, :-1][keep])  # [N, V]
        logp_all = torch.log_softmax(logits.float() / self.hp.temperature, dim=-1)
        targets = ids[:, 1:] if keep is None else ids[:, 1:][keep]
        tok = torch.gather(logp_all, -1, targets[..., None]).squeeze(-1)
        ent = -(logp_all.exp() * logp_all).sum(-1)
        if keep is not None:  # back to [B, T - 1], row-major like the boolean index
            tok = tok.new_zeros(keep.shape).masked_scatter(keep, tok)
            ent = ent.new_zeros(keep.shape).masked_scatter(keep, ent)
        pad = torch.zeros(ids.shape[0], 1, device=ids.device)
        return torch.cat([pad, tok], 1), torch.cat([pad, ent], 1)

    def _tensors(self, batch: TrainBatch) -> tuple[torch.Tensor, ...]:
        """The batch padded on the right, on the model's device: token ids, loss mask,
        behaviour log-probs ([B, T] each) and advantages ([B]); and the lengths ([B], CPU)."""
        S = batch.samples
        T = max(len(s.token_ids) for s in S)
        ids = torch.zeros(len(S), T, dtype=torch.long)
        mask = torch.zeros(len(S), T, dtype=torch.bool)
        behav = torch.zeros(len(S), T)
        for i, s in enumerate(S):
            n = len(s.token_ids)
            ids[i, :n] = torch.from_numpy(np.asarray(s.token_ids, dtype=np.int64))
            mask[i, :n] = torch.from_numpy(np.asarray(s.loss_mask, dtype=bool))
            behav[i, :n] = torch.from_numpy(np.asarray(s.behaviour_logprobs, dtype=np.float32))
        adv = torch.tensor([s.advantage for s in S], dtype=torch.float32)
        lengths = torch.tensor([len(s.token_ids) for s in S])
        return (*(t.to(self.device) for t in (ids, mask, behav, adv)), lengths)

    def _batched_logprobs(self, ids: torch.Tensor, lengths: torch.Tensor, mask: torch.Tensor,
                          rows: np.ndarray | None = None) -> torch.Tensor:
        """:meth:`_logprobs` at ``mask`` of ``rows`` (default every row; the others get 0),
        without gradient, in passes of about a minibatch's rows over rows of similar length,
        each cut to its longest row: one pass over the rows' values, at a fraction of their
        padding."""
        out = torch.zeros(ids.shape, device=ids.device)
        rows = torch.arange(len(lengths)) if rows is None else torch.as_tensor(rows)
        if len(rows) == 0:
            return out
        order = rows[torch.argsort(lengths[rows])]
        passes = max(1, round(len(rows) * self.hp.minibatches / len(lengths)))
        for part in torch.tensor_split(order, min(passes, len(order))):
            n = int(lengths[part].max())
            part = part.to(ids.device)
            out[part, :n] = self._logprobs(ids[part, :n], mask[part, :n])[0]
        return out

    def logprobs(self, batch: TrainBatch) -> list[np.ndarray]:
        """What the current weights give each sample's tokens where its ``loss_mask`` is set (0
        elsewhere), computed as a train step computes its proximal log-probs: one float32 array
        per sample, position 0 gets 0. Set against ``behaviour_logprobs`` it measures the
        mismatch between the sampler's numerics and the trainer's."""
        with self._lock, torch.no_grad():
            ids, mask, _behav, _adv, lengths = self._tensors(batch)
            logp = self._batched_logprobs(ids, lengths, mask).cpu().numpy()
        return [logp[i, :len(s.token_ids)].copy() for i, s in enumerate(batch.samples)]

    def train_step(self, batch: TrainBatch) -> TrainStats:
        with self._lock:
            return self._train_step(batch)

    def _train_step(self, batch: TrainBatch) -> TrainStats:
        t0 = time.perf_counter()
        if batch.policy_version != self.version:
            raise RuntimeError(f"batch built for v{batch.policy_version}, trainer at v{self.version}")
        ids, mask, behav, adv, lengths = self._tensors(batch)
        order = list(range(len(batch.samples)))
        stats = []
        for epoch in range(self.hp.ppo_epochs):
            self._shuffle_rng.shuffle(order)
            minibatches = [mb for mb in np.array_split(np.array(order), self.hp.minibatches)
                           if len(mb)]
            if epoch == 0:
                # The proximal policy is the weights as the step starts, which the first
                # minibatch's own forward pass still has: only the other rows need a pass
                # without gradient, and the first's are filled in from its pass below.
                with torch.no_grad():
                    rest = np.concatenate([np.zeros(0, dtype=np.int64), *minibatches[1:]])
                    prox = self._batched_logprobs(ids, lengths, mask, rows=rest)
            for j, mb in enumerate(minibatches):
                n = int(lengths[mb].max())  # the minibatch cut to its longest row
                idx = torch.from_numpy(mb).to(self.device)
                m_mask = mask[idx, :n]
                logp, ent = self._logprobs(ids[idx, :n], m_mask)
                if epoch == 0 and j == 0:
                    prox[idx, :n] = logp.detach()
                out = self.loss(logp, prox[idx, :n], behav[idx, :n], adv[idx], m_mask,
                                clip_eps=self.hp.clip_eps, tis_cap=self.hp.tis_cap)
                m = m_mask.float()
                entropy = (ent * m).sum() / m.sum().clamp(min=1)
                loss = out.loss - self.hp.entropy_coef * entropy
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.hp.max_grad_norm)
                self.optimizer.step()
                stats.append((float(loss.detach()), out.clipfrac, out.tis_mean, out.kl_behaviour,
                              float(entropy.detach()), float(gn)))
        lr_used = self.optimizer.param_groups[0]["lr"]
        self.version += 1
        self.scheduler.step()
        mean = np.mean(np.array(stats), axis=0)
        return TrainStats(policy_version=self.version, loss=mean[0], pg_clipfrac=mean[1],
                          tis_mean=mean[2], kl_behaviour=mean[3], entropy=mean[4],
                          grad_norm=mean[5], lr=lr_used,
                          tokens=int(mask.sum()),
                          seconds=time.perf_counter() - t0)

    def export_weights(self) -> WeightsSnapshot:
        with self._lock:
            state = {k: v.detach().cpu().float().numpy().copy()
                     for k, v in self.model.state_dict().items()}
            return WeightsSnapshot(self.version, state)

    # -- checkpoints ------------------------------------------------------------------------
    def save_checkpoint(self, run_dir: str) -> str:
        """Final policy as a Hugging Face directory plus a resumable checkpoint."""
        with self._lock:
            return self._save_checkpoint(run_dir)

    def _save_checkpoint(self, run_dir: str) -> str:
        run = Path(run_dir)
        save_policy(self.model, self.tokenizer, run / "policy")
        return write_checkpoint(self.checkpoint_state(), run / "checkpoint.pt")

    def checkpoint_state(self) -> dict:
        """Everything a resume needs, as tensors and plain Python values only, so that it
        loads with ``torch.load(weights_only=True)`` (no arbitrary pickle from disk)."""
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        return {
            "model": _cpu(self.model.state_dict()), "optimizer": _cpu(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
            "version": self.version, "torch_rng": torch.get_rng_state(),
            "numpy_rng": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)),
                          "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)},
            "python_rng": _plain(random.getstate()),
            "shuffle_rng": _plain(self._shuffle_rng.getstate()),
        }

    def load_checkpoint(self, path: str) -> int:
        state = torch.load(path, map_location="cpu", weights_only=True)
        self.model.load_state_dict(state["model"])  # copied onto the model's device
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        with warnings.catch_warnings():  # the lr depends on the version, not the step count
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
            self.scheduler.step()  # re-evaluate the lr at the restored version
        torch.set_rng_state(state["torch_rng"])
        n = state["numpy_rng"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                             n["has_gauss"], n["gauss"]))
        random.setstate(_tuples(state["python_rng"]))
        self._shuffle_rng.setstate(_tuples(state["shuffle_rng"]))
        return self.version


def _cpu(state):
    """A state dict with every tensor on the CPU (nested dicts and lists followed)."""
    if isinstance(state, torch.Tensor):
        return state.cpu()
    if isinstance(state, dict):
        return {k: _cpu(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_cpu(v) for v in state)
    return state


def _plain(rng_state: tuple) -> list:
    """``random.getstate()`` as lists (tuples round-trip as lists)."""
    return [list(x) if isinstance(x, tuple) else x for x in rng_state]


def _tuples(rng_state: list) -> tuple:
    return tuple(tuple(x) if isinstance(x, list) else x for x in rng_state)


def write_checkpoint(state: dict, path: str | Path) -> str:
    """``torch.save`` to a temporary file beside ``path``, then an atomic rename: a crash
    mid-write never leaves a truncated checkpoint under the real name."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return str(path)


def policy_trainer(policy: PolicySpec | dict, hparams: TrainerHParams | dict, seed: int = 0,
                   loss: LossFn | None = None) -> PolicyTrainer:
    """Build the trainer from config (a ``_component_`` target): its own copy of the policy, in
    float32 on ``policy.device``, autocast to bfloat16 when ``policy.dtype`` resolves to it."""
    spec = policy if isinstance(policy, PolicySpec) else PolicySpec(**policy)
    hp = hparams if isinstance(hparams, TrainerHParams) else TrainerHParams(**hparams)
    model, tokenizer = load_policy(spec, dtype=torch.float32)
    autocast = torch.bfloat16 if torch_dtype(spec) == torch.bfloat16 else None
    return PolicyTrainer(model, tokenizer, hp, seed=seed, loss=loss, autocast=autocast)


def train_step(trainer: Trainer, batch: TrainBatch) -> TrainStats:
    return trainer.train_step(batch)


def publish_weights(trainer: Trainer) -> WeightsSnapshot:
    return trainer.export_weights()


def save_checkpoint(trainer: Trainer, run_dir: str) -> str:
    return trainer.save_checkpoint(run_dir)


def load_checkpoint(trainer: Trainer, path: str) -> int:
    return trainer.load_checkpoint(path)

