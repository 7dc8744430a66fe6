"""Policy loss for off-policy agentic RL.

Decoupled PPO (Hilton et al., "Batch size-invariance for policy optimization", 2022; also ROLL
Flash, arXiv 2510.11345 Sec. 4): the PPO ratio is taken against the *proximal* policy, here the
trainer's weights at the start of the step, recomputed; the behaviour policy that actually sampled
the tokens (possibly several versions older) enters only through a truncated importance weight
min(pi_prox / pi_behav, cap) (TIS, Yao et al. 2025), which is not differentiated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class LossOutput:
    loss: torch.Tensor
    clipfrac: float
    tis_mean: float
    kl_behaviour: float


class LossFn(Protocol):
    """The policy loss the trainer minimises, swappable as a component.

    logp: [B, T] current policy's log-prob of each token, with grad; prox_logp: [B, T] proximal
    (recomputed old) policy, no grad; behaviour_logp: [B, T] the sampler's log-probs;
    advantages: [B], one per trajectory; mask: [B, T] bool, True on policy-generated tokens.
    Position 0 of each row has no log-prob (0) and is masked. ``loss`` must be a scalar that
    backpropagates to ``logp``; the floats are reported in TrainStats.
    """

    def __call__(
        self,
        logp: torch.Tensor,
        prox_logp: torch.Tensor,
        behaviour_logp: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        *,
        clip_eps: float,
        tis_cap: float,
    ) -> LossOutput: ...


def decoupled_ppo_loss(
    logp: torch.Tensor,  # [B, T] current policy, with grad
    prox_logp: torch.Tensor,  # [B, T] proximal (recomputed old) policy
    behaviour_logp: torch.Tensor,  # [B, T] sampler's log-probs
    advantages: torch.Tensor,  # [B] group-relative, one per trajectory
    mask: torch.Tensor,  # [B, T] bool, policy-generated tokens
    *,
    clip_eps: float = 0.2,
    tis_cap: float = 2.0,
) -> LossOutput:
    maskf = mask.float()
    n = maskf.sum().clamp(min=1.0)
    adv = advantages[:, None].expand_as(logp)
    ratio = torch.exp(logp - prox_logp.detach())
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv
    pg = -torch.minimum(unclipped, clipped)
    log_tis = (prox_logp - behaviour_logp).detach()
    tis = torch.exp(log_tis.clamp(max=20.0)).clamp(max=tis_cap)
    loss = (pg * tis * maskf).sum() / n
    with torch.no_grad():
        clipfrac = (((ratio - 1).abs() > clip_eps).float() * maskf).sum() / n
        tis_mean = (tis * maskf).sum() / n
        kl = ((behaviour_logp - prox_logp) * maskf).sum() / n
    return LossOutput(loss, float(clipfrac), float(tis_mean), float(kl))


def group_advantages(rewards: list[float], normalise_std: bool = True, eps: float = 1e-6) -> list[float]:
    """Group-relative advantages (GRPO): reward minus the group mean, over the group's std."""
    r = torch.tensor(rewards, dtype=torch.float64)
    if r.numel() < 2:
        return [0.0] * r.numel()
    a = r - r.mean()
    if normalise_std:
        a = a / (r.std(unbiased=False) + eps)
    return [float(x) for x in a]
