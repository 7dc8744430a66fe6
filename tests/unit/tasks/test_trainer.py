"""The trainer: its protocol and factory, the loss component, eval-mode log-probs, seeded shuffle,
float32 master weights under bfloat16 autocast."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tasks.components import instantiate
from tasks.losses import LossOutput, decoupled_ppo_loss
from tasks.policy import load_policy
from tasks.records import TrainBatch, TrainSample
from tasks.specs import PolicySpec, TrainerHParams
from tasks.trainer import PolicyTrainer, Trainer, policy_trainer, train_step

# they seed the process-wide RNGs: leave them as they were
pytestmark = pytest.mark.usefixtures("restore_global_rngs")


# exact equality of steps and tensors built on the host: the CPU, whatever the machine has
CPU = PolicySpec(device="cpu")


def _batch(n: int, version: int = 0, seed: int = 0, length: tuple[int, int] = (6, 14),
           vocab: int = 60) -> TrainBatch:
    """Random trajectories: a prompt, then policy tokens with made-up behaviour log-probs."""
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n):
        t = int(rng.integers(*length)) if length[0] < length[1] else length[0]
        mask = np.arange(t) >= t // 2
        behav = np.where(mask, rng.normal(-4.0, 0.5, t), 0.0).astype(np.float32)
        samples.append(TrainSample(rng.integers(1, vocab, t), mask, behav, float(rng.normal())))
    return TrainBatch(samples, version)


def _padded(batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(s.token_ids) for s in batch.samples)
    ids = torch.zeros(len(batch.samples), T, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, s in enumerate(batch.samples):
        ids[i, :len(s.token_ids)] = torch.as_tensor(s.token_ids)
        attn[i, :len(s.token_ids)] = 1
    return ids, attn


def test_policy_trainer_factory_builds_a_trainer_from_config():
    trainer = instantiate({"_component_": "tasks.trainer.policy_trainer"}, policy=PolicySpec(),
                          hparams={"minibatches": 2}, seed=1, loss=None)
    assert isinstance(trainer, PolicyTrainer) and isinstance(trainer, Trainer)
    assert trainer.hp.minibatches == 2 and trainer.loss is decoupled_ppo_loss
    stats = train_step(trainer, _batch(4))
    assert trainer.version == stats.policy_version == 1
    with pytest.raises(RuntimeError, match="built for v0"):
        trainer.train_step(_batch(4))


def test_custom_loss_is_called_once_per_minibatch():
    calls = []

    def loss(logp, prox_logp, behaviour_logp, advantages, mask, *, clip_eps, tis_cap):
        calls.append((logp.requires_grad, logp.shape == mask.shape, advantages.shape[0],
                      clip_eps, tis_cap))
        m = mask.float()
        return LossOutput(-(logp * m).sum() / m.sum(), 0.0, 1.0, 0.0)

    hp = TrainerHParams(minibatches=3, ppo_epochs=2, clip_eps=0.3, tis_cap=1.5)
    stats = policy_trainer(PolicySpec(), hp, loss=loss).train_step(_batch(6))
    assert calls == [(True, True, 2, 0.3, 1.5)] * 6  # 2 epochs x 3 minibatches of 2
    assert stats.tis_mean == 1.0 and stats.pg_clipfrac == 0.0


def test_log_probs_are_computed_without_dropout():
    spec = PolicySpec(architecture={**CPU.architecture, "attention_dropout": 0.5}, device="cpu")
    model, tok = load_policy(spec)
    batch = _batch(6, length=(10, 10))  # equal lengths: no padding
    ids, attn = _padded(batch)
    with torch.no_grad():  # the sampler's log-probs: the same weights, in eval mode
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(2, ids[:, 1:, None])[..., 0]
    for s, row in zip(batch.samples, logp, strict=True):
        s.behaviour_logprobs = np.concatenate([[0.0], row.numpy()]).astype(np.float32)

    # a clip range far below dropout's noise, far above float rounding
    trainer = PolicyTrainer(model, tok, TrainerHParams(minibatches=1, clip_eps=1e-3))
    with torch.no_grad():
        first, second = trainer._logprobs(ids)[0], trainer._logprobs(ids)[0]
    assert torch.equal(first, second)
    # one minibatch, before its optimiser step: on-policy, so no drift and no clipping
    stats = trainer.train_step(batch)
    assert stats.kl_behaviour == pytest.approx(0.0, abs=1e-5)
    assert stats.tis_mean == pytest.approx(1.0, abs=1e-4)
    assert stats.pg_clipfrac == 0.0


def test_log_probs_at_the_loss_positions_are_those_of_the_full_forward():
    trainer = policy_trainer(CPU, TrainerHParams(temperature=0.7))
    assert trainer._plain_head
    batch = _batch(5)
    ids, _ = _padded(batch)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for i, s in enumerate(batch.samples):
        mask[i, :len(s.loss_mask)] = torch.as_tensor(s.loss_mask)
    full_logp, full_ent = trainer._logprobs(ids)
    logp, ent = trainer._logprobs(ids, mask)
    assert logp.requires_grad and int((logp != 0).sum()) == int(mask.sum())
    torch.testing.assert_close(logp[mask], full_logp[mask])
    torch.testing.assert_close(ent[mask], full_ent[mask])
    assert not logp[~mask].any() and not ent[~mask].any()
    logp.sum().backward()  # through the selected hidden states into the head (tied embedding)
    assert trainer.model.get_output_embeddings().weight.grad.abs().sum() > 0


def test_a_head_that_transforms_its_logits_is_read_from_the_full_forward():
    model, tok = load_policy(CPU)
    model.config.final_logit_softcapping = 30.0  # as Gemma 2 declares it
    trainer = PolicyTrainer(model, tok, TrainerHParams())
    assert not trainer._plain_head
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    mask = torch.tensor([[False, False, False, True, True]])
    torch.testing.assert_close(trainer._logprobs(ids, mask)[0], trainer._logprobs(ids)[0])


def _steps_equal(a, b) -> bool:
    fields = ("loss", "pg_clipfrac", "tis_mean", "kl_behaviour", "entropy", "grad_norm")
    return all(getattr(a, f) == getattr(b, f) for f in fields)


def _weights_equal(a: Trainer, b: Trainer) -> bool:
    wa, wb = a.export_weights(), b.export_weights()
    return wa.version == wb.version and all(np.array_equal(wa.state[k], wb.state[k])
                                            for k in wa.state)


HP = TrainerHParams(minibatches=4, ppo_epochs=2, lr=1e-2)


def test_minibatch_order_follows_the_trainer_seed_not_the_global_rng():
    a, b = policy_trainer(CPU, HP, seed=7), policy_trainer(CPU, HP, seed=7)
    random.seed(1)
    sa = a.train_step(_batch(8))
    random.seed(2)
    sb = b.train_step(_batch(8))
    assert _steps_equal(sa, sb)
    assert _weights_equal(a, b)


def test_checkpoint_restores_the_shuffle_state(tmp_path):
    a = policy_trainer(CPU, HP, seed=7)
    a.train_step(_batch(8, seed=0))
    path = a.save_checkpoint(str(tmp_path))
    assert (tmp_path / "policy" / "config.json").exists()
    keys = set(torch.load(path, weights_only=True))  # tensors and plain values only
    assert keys == {"model", "optimizer", "scheduler", "version", "torch_rng", "numpy_rng",
                    "python_rng", "shuffle_rng"}
    saved = np.random.get_state(), random.getstate()
    expected = (np.random.random(), random.random())  # what the global RNGs draw next
    np.random.set_state(saved[0])
    random.setstate(saved[1])
    random.seed(1)  # other code on the worker draws from the global RNG meanwhile
    uninterrupted = a.train_step(_batch(8, version=1, seed=1))

    b = policy_trainer(CPU, HP, seed=99)  # everything must come from the checkpoint
    assert b.load_checkpoint(path) == 1
    random.seed(2)
    resumed = b.train_step(_batch(8, version=1, seed=1))
    assert _steps_equal(uninterrupted, resumed)
    assert _weights_equal(a, b)
    b.load_checkpoint(path)  # the global RNGs come back too
    assert (np.random.random(), random.random()) == expected


def test_bfloat16_autocast_keeps_float32_weights_and_exports():
    trainer = policy_trainer(PolicySpec(device="cpu", dtype="bfloat16"), HP, seed=3)
    assert trainer.autocast == torch.bfloat16 and trainer.device == torch.device("cpu")
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    before = trainer.export_weights()
    stats = trainer.train_step(_batch(8))
    after = trainer.export_weights()
    assert all(np.isfinite(getattr(stats, f)) for f in ("loss", "grad_norm", "tis_mean", "entropy"))
    assert {v.dtype for v in after.state.values()} == {np.dtype(np.float32)}
    assert any(not np.array_equal(before.state[k], after.state[k]) for k in after.state)
    assert policy_trainer(CPU, HP).autocast is None


def test_logprobs_are_the_proximal_logprobs_of_a_step():
    trainer = policy_trainer(CPU, TrainerHParams(minibatches=1, clip_eps=1e-3))
    batch = _batch(5)
    logps = trainer.logprobs(batch)
    assert [len(lp) for lp in logps] == [len(s.token_ids) for s in batch.samples]
    assert all(lp.dtype == np.float32 and lp[0] == 0.0 for lp in logps)
    for s, lp in zip(batch.samples, logps, strict=True):  # sampled by these very weights
        s.behaviour_logprobs = np.where(s.loss_mask, lp, 0.0).astype(np.float32)
    stats = trainer.train_step(batch)
    assert stats.kl_behaviour == 0.0 and stats.tis_mean == 1.0 and stats.pg_clipfrac == 0.0
