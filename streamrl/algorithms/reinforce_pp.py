"""REINFORCE++ (Hu et al., 2025): REINFORCE with PPO's clip and a *global* advantage
normalisation instead of a per-group one.

    b_i  = mean(r of the group)                    # the "baseline" variant: group mean first
    A_i  = (r_i - b_i - mu) / (sigma + eps)        # mu, sigma over every sample seen so far
    L_i  = mean_t[ -min(ratio_t * A_i, clip(ratio_t, 1-e, 1+e) * A_i) + beta * KL_t ]

The paper normalises over the whole batch. A streaming trainer never holds the whole batch
before its first micro-batch, so mu and sigma are running statistics of the centred rewards
of every group this trainer has seen (Welford's algorithm), the current group included.
"""

from __future__ import annotations

import math

from pydantic import Field

from streamrl.algorithms.clipped import ClippedConfig, ClippedSurrogate


class ReinforcePPConfig(ClippedConfig):
    eps: float = Field(1e-6, gt=0)
    """Added to the running std before dividing."""


class ReinforcePP(ClippedSurrogate):
    """Group-mean baseline, globally normalised advantages, the clipped surrogate loss."""

    min_group_size = 2  # the group-mean baseline: a sample alone is centred to 0

    def __init__(self, config: ReinforcePPConfig):
        super().__init__(config)
        self.n, self.mean, self.m2 = 0, 0.0, 0.0  # running statistics of centred rewards

    def advantages(self, rewards: list[float]) -> list[float]:
        """Centre on the group mean, then normalise with the run's running mean and std."""
        flat = min(rewards) == max(rewards)
        g = math.fsum(rewards) / len(rewards)
        centred = [0.0 if flat else r - g for r in rewards]  # (a computed mean can be an ulp off equal values)
        for x in centred:  # Welford
            self.n += 1
            d = x - self.mean
            self.mean += d / self.n
            self.m2 += d * (x - self.mean)
        std = math.sqrt(self.m2 / self.n) if self.n > 1 else 1.0
        if flat:  # no signal in the group (its zeros still count in the run's std, as in the paper's batch)
            return [0.0] * len(rewards)
        return [(x - self.mean) / (std + self.config.eps) for x in centred]

    def state_dict(self) -> dict:
        """The running statistics (a resumed run normalises as the uninterrupted one would)."""
        return {"n": self.n, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        """Restore the running statistics."""
        self.n, self.mean, self.m2 = state["n"], state["mean"], state["m2"]
