"""GRPO (Shao et al., 2024, DeepSeekMath): PPO's clipped objective with the critic replaced by
group-normalised rewards.

For a group of G samples of one prompt with rewards r_1..r_G:

    A_i = (r_i - mean(r)) / (std(r) + eps)                      # same A for every token of i

and the loss is the clipped surrogate with an optional KL penalty (``clipped.py``, which also
says how stale samples are corrected). The trainer sums L_i over the batch and scales by
1 / batch size.
"""

from __future__ import annotations

import math

from pydantic import Field

from streamrl.algorithms.clipped import ClippedConfig, ClippedSurrogate


class GRPOConfig(ClippedConfig):
    eps: float = Field(1e-6, gt=0)
    """Added to the group's reward std before dividing."""
    scale_rewards: bool = True
    """Divide by the group std (false gives Dr. GRPO's advantages; see ``dr_grpo``)."""


class GRPO(ClippedSurrogate):
    """Group-relative advantages and the clipped surrogate loss."""

    min_group_size = 2  # a group baseline: a sample alone gets advantage 0

    def advantages(self, rewards: list[float]) -> list[float]:
        """Group-normalised advantages; an all-equal group gets exact zeros (no signal, no update)."""
        if len(rewards) < 2 or min(rewards) == max(rewards):
            # (computed, the mean of equal values can be an ulp off while their std is exactly 0:
            # every sample got the same +-ulp/eps, pushed the same way by noise, and was not skipped)
            return [0.0] * len(rewards)
        n = len(rewards)
        mean = math.fsum(rewards) / n
        a = [r - mean for r in rewards]
        if self.config.scale_rewards:  # config is a GRPOConfig here; the sample std, as torch's
            std = math.sqrt(math.fsum(x * x for x in a) / (n - 1))
            a = [x / (std + self.config.eps) for x in a]
        return a
