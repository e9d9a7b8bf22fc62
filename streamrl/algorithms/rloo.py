"""RLOO (Ahmadian et al., 2024, "Back to Basics"): REINFORCE with a leave-one-out baseline.

For a group of G samples of one prompt with rewards r_1..r_G:

    A_i = r_i - (sum_j r_j - r_i) / (G - 1)        # the mean of the *other* samples

unbiased (GRPO's group mean includes the sample itself) and unscaled. The loss is the
clipped surrogate, per-sample mean over tokens (``streamrl/algorithms/clipped.py``).
"""

from __future__ import annotations

from streamrl.algorithms.clipped import ClippedConfig, ClippedSurrogate


class RLOOConfig(ClippedConfig):
    """``clip``, ``kl_coef``, ``off_policy_cap``, ``epochs``: the clipped surrogate's."""


class RLOO(ClippedSurrogate):
    """The clipped surrogate loss with leave-one-out advantages."""

    min_group_size = 2  # a group baseline: a sample alone gets advantage 0

    def advantages(self, rewards: list[float]) -> list[float]:
        """``r_i`` minus the mean of the group's other rewards (0 for a group of one)."""
        n = len(rewards)
        if n < 2 or min(rewards) == max(rewards):  # (exact zeros: the trainer skips them; rounding would not)
            return [0.0] * n
        total = sum(rewards)
        return [r - (total - r) / (n - 1) for r in rewards]
