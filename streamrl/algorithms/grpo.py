"""GRPO (Shao et al., 2024, DeepSeekMath): PPO's clipped objective with the critic replaced by
group-normalised rewards.

For a group of G samples of one prompt with rewards r_1..r_G:

    A_i = (r_i - mean(r)) / (std(r) + eps)                      # same A for every token of i
    ratio_t = exp(logp_new_t - logp_old_t)                      # old = the generating policy
    L_i = mean_t[ -min(ratio_t * A_i, clip(ratio_t, 1-e, 1+e) * A_i) + beta * KL_t ]
    KL_t = exp(ref_t - new_t) - (ref_t - new_t) - 1             # k3 estimator, >= 0

The trainer sums L_i over the batch and scales by 1 / batch size.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field


class GRPOConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    clip: float = Field(0.2, gt=0)
    """PPO clip range epsilon on the probability ratio."""
    kl_coef: float = Field(0.0, ge=0)
    """beta: weight of the KL penalty to the frozen initial policy (0 = no reference model)."""
    eps: float = Field(1e-6, gt=0)
    """Added to the group's reward std before dividing."""
    scale_rewards: bool = True
    """Divide by the group std (Dr. GRPO sets this to false)."""


class GRPO:
    """Group-relative advantages and the clipped surrogate loss."""

    def __init__(self, config: GRPOConfig):
        self.config = config
        self.needs_reference = config.kl_coef > 0

    def advantages(self, rewards: list[float]) -> list[float]:
        """Group-normalised advantages; an all-equal group gets zeros (no signal, no update)."""
        r = torch.tensor(rewards, dtype=torch.float32)
        a = r - r.mean()
        if self.config.scale_rewards and len(rewards) > 1:
            a = a / (r.std() + self.config.eps)
        return a.tolist()

    def loss(self, new, old, ref, adv, mask):
        """Per-sample loss ``[B]`` from token logprobs ``[B, T]`` and a response mask ``[B, T]``."""
        ratio = torch.exp(new - old)
        clipped = torch.clamp(ratio, 1 - self.config.clip, 1 + self.config.clip)
        a = adv[:, None]
        per_token = -torch.minimum(ratio * a, clipped * a)
        kl = torch.zeros_like(new)
        if ref is not None:
            d = ref - new
            kl = torch.exp(d) - d - 1
            per_token = per_token + self.config.kl_coef * kl
        n_tokens = mask.sum(-1).clamp(min=1)
        per_sample = (per_token * mask).sum(-1) / n_tokens
        with torch.no_grad():
            was_clipped = ((ratio - clipped).abs() > 1e-8).float()
            stats = {
                "clip_frac_sum": ((was_clipped * mask).sum(-1) / n_tokens).sum(),
                "kl_sum": ((kl * mask).sum(-1) / n_tokens).sum(),
            }
        return per_sample, stats
