"""``rloo``: REINFORCE Leave-One-Out (Ahmadian et al., 2024) advantages.

Each sample's baseline is the mean reward of the *other* samples of its group,
``A_i = r_i - mean_{j != i} r_j``, which is unbiased (GRPO's group mean includes the sample
itself) and unscaled. The loss is streamrl's clipped surrogate (``ClippedSurrogate``, the one
GRPO uses), so this file only gives the advantages.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from streamrl.api import ClippedConfig, ClippedSurrogate


class RLOOConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    clip: float = Field(0.2, gt=0)
    """PPO clip range on the probability ratio."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL penalty to the frozen initial policy."""


class RLOO(ClippedSurrogate):
    """The clipped surrogate loss with leave-one-out advantages."""

    def __init__(self, config: RLOOConfig):
        super().__init__(ClippedConfig(clip=config.clip, kl_coef=config.kl_coef))

    def advantages(self, rewards: list[float]) -> list[float]:
        """``r_i`` minus the mean of the group's other rewards (0 for a group of one)."""
        n = len(rewards)
        if n < 2:
            return [0.0] * n
        total = sum(rewards)
        return [r - (total - r) / (n - 1) for r in rewards]
