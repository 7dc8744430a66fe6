"""The trainer and the ``hf`` backend on a CUDA device: bfloat16 autocast over float32 master
weights, CPU float32 results from a bfloat16 engine, the sampler's log-probs against the
trainer's, and checkpoints that load on another device. Skipped without CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from resources.engine import hf_backend
from tasks.generation import decode, prefill
from tasks.records import EnvHandle, EnvObservation, SamplingParams, TrainBatch, TrainSample
from tasks.specs import PolicySpec, TrainerHParams
from tasks.trainer import policy_trainer
from tests.unit.tasks.test_trainer import _batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device: torch.cuda.is_available() is False"),
]

HP = TrainerHParams(minibatches=2, lr=1e-2)
CUDA = PolicySpec(device="cuda")  # dtype auto: bfloat16 where the GPU supports it


def test_a_train_step_on_cuda_in_bfloat16_autocast():
    trainer = policy_trainer(CUDA, HP, seed=0)
    if torch.cuda.is_bf16_supported():
        assert trainer.autocast == torch.bfloat16
    assert {(p.device.type, p.dtype) for p in trainer.model.parameters()} == {
        ("cuda", torch.float32)}
    before = trainer.export_weights()
    stats = trainer.train_step(_batch(8))
    after = trainer.export_weights()
    assert stats.policy_version == after.version == 1
    for f in ("loss", "grad_norm", "tis_mean", "kl_behaviour", "entropy"):
        assert np.isfinite(getattr(stats, f)), f
    assert stats.grad_norm > 0
    for k, v in after.state.items():  # numpy float32 on the host, whatever the trainer's device
        assert isinstance(v, np.ndarray) and v.dtype == np.float32, k
    assert any(not np.array_equal(before.state[k], after.state[k]) for k in after.state)


def test_hf_backend_on_cuda_samples_the_log_probs_the_trainer_recomputes():
    trainer = policy_trainer(CUDA, HP, seed=0)
    backend = hf_backend(CUDA)
    try:
        assert backend.engine.device.type == "cuda"
        assert backend.load_weights(trainer.export_weights()) == 0
        prompt = [3, 6, 7, 8, 9, 4]
        obs = EnvObservation(handle=EnvHandle("w", "e"), text="", input_ids=prompt)
        pre = prefill(backend, None, obs)
        out = decode(backend, pre, None, SamplingParams(max_new_tokens=24), seed=1)
        kept = backend.store.lookup(out.cache.key, out.cache.token_ids, out.cache.n_tokens)
    finally:
        backend.close()
    # what a turn hands on or keeps is host memory in float32, fit for Dask's serialisation
    assert pre.kv_new.dtype == pre.last_logits.dtype == kept.dtype == np.float32
    response = out.sample.token_ids
    ids = np.array(prompt + response)
    mask = np.arange(len(ids)) >= len(prompt)
    behaviour = np.concatenate([np.zeros(len(prompt)), out.sample.logprobs]).astype(np.float32)
    batch = TrainBatch([TrainSample(ids, mask, behaviour, 1.0)], 0)
    delta = np.abs(trainer.logprobs(batch)[0][mask] - behaviour[mask])
    assert delta.max() < 2e-2, delta


def test_a_cuda_checkpoint_resumes_on_the_cpu(tmp_path):
    a = policy_trainer(CUDA, HP, seed=0)
    a.train_step(_batch(8))
    path = a.save_checkpoint(str(tmp_path))
    saved = torch.load(path, weights_only=True)  # no map_location needed: host tensors only
    assert {t.device.type for t in saved["model"].values()} == {"cpu"}
    b = policy_trainer(PolicySpec(device="cpu"), HP, seed=9)
    assert b.load_checkpoint(path) == 1
    wa, wb = a.export_weights(), b.export_weights()
    assert all(np.array_equal(wa.state[k], wb.state[k]) for k in wa.state)
    stats = b.train_step(_batch(8, version=1, seed=1))
    assert np.isfinite(stats.loss)
