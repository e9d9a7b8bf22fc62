"""Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training"): GRPO without its two
length and difficulty biases.

    A_i = r_i - mean(r)                            # no division by the group's std
    L_i = sum_t[ -min(ratio_t * A_i, clip(ratio_t, 1-e, 1+e) * A_i) ] / L_max

GRPO averages each sample's tokens (``/ |o_i|``), which lets long wrong answers off lightly;
dividing every sample by the same constant ``L_max`` (the generation budget, ``max_tokens``)
makes the loss token-level. The trainer then divides by the samples in the batch.
"""

from __future__ import annotations

import math

from pydantic import Field

from streamrl.algorithms.clipped import ClippedConfig, ClippedSurrogate


class DrGRPOConfig(ClippedConfig):
    max_tokens: int = Field(16, ge=1)
    """L_max, the constant every sample's token sum is divided by; set it to the engine's
    ``max_new_tokens``."""


class DrGRPO(ClippedSurrogate):
    """Mean-centred advantages and a token-level clipped surrogate."""

    min_group_size = 2  # a group baseline: a sample alone gets advantage 0

    def advantages(self, rewards: list[float]) -> list[float]:
        """``r_i - mean(r)`` (exact zeros for an all-equal group: the trainer skips them)."""
        if min(rewards) == max(rewards):  # (a computed mean can be an ulp off the equal values)
            return [0.0] * len(rewards)
        mean = math.fsum(rewards) / len(rewards)
        return [r - mean for r in rewards]

    def loss(self, new, old, ref, adv, mask):
        """The clipped surrogate's, each sample's token sum divided by ``max_tokens`` instead of
        its length."""
        per_sample, stats = super().loss(new, old, ref, adv, mask)
        n_tokens = mask.sum(-1).clamp(min=1)
        return per_sample * n_tokens / self.config.max_tokens, stats
