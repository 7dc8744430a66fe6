"""Decoupled PPO with truncated IS: masking, clipping, truncation, group advantages."""

from __future__ import annotations

import inspect

import pytest
import torch

from tasks.losses import LossFn, decoupled_ppo_loss, group_advantages


def test_loss_ignores_masked_tokens():
    logp = torch.zeros(1, 4, requires_grad=True)
    mask = torch.tensor([[False, True, True, False]])
    out = decoupled_ppo_loss(logp, torch.zeros(1, 4), torch.zeros(1, 4), torch.tensor([1.0]), mask)
    out.loss.backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 3] == 0
    assert logp.grad[0, 1] == pytest.approx(-0.5) and logp.grad[0, 2] == pytest.approx(-0.5)


def test_ratio_is_clipped_against_proximal_policy():
    logp = torch.full((1, 2), 1.0, requires_grad=True)  # ratio e^1 > 1 + eps
    out = decoupled_ppo_loss(logp, torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([1.0]),
                             torch.ones(1, 2, dtype=torch.bool), clip_eps=0.2)
    out.loss.backward()
    assert out.clipfrac == 1.0 and torch.all(logp.grad == 0)


def test_importance_weight_is_truncated():
    out = decoupled_ppo_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.full((1, 1), -5.0),
                             torch.tensor([1.0]), torch.ones(1, 1, dtype=torch.bool), tis_cap=2.0)
    assert out.tis_mean == pytest.approx(2.0)
    assert out.loss.item() == pytest.approx(-2.0)


def test_decoupled_ppo_loss_is_a_loss_fn():
    """The trainer calls any LossFn with clip_eps and tis_cap by keyword; the defaults stay."""
    proto = list(inspect.signature(LossFn.__call__).parameters.values())[1:]  # without self
    params = list(inspect.signature(decoupled_ppo_loss).parameters.values())
    assert [(p.name, p.kind) for p in params] == [(p.name, p.kind) for p in proto]
    assert (params[-2].default, params[-1].default) == (0.2, 2.0)


def test_group_advantages():
    assert group_advantages([1.0, 0.0]) == pytest.approx([1.0, -1.0], abs=1e-5)
    assert group_advantages([0.5, 0.5, 0.5]) == [0.0, 0.0, 0.0]
    assert group_advantages([1.0]) == [0.0]
