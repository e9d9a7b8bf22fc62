"""PPO with a critic (Schulman et al., 2017; the RLHF form of Ouyang et al., 2022).

The reward of a response arrives at its last token; a critic V (a second copy of the policy's
transformer with a scalar head, trained beside the policy on the train worker) gives a value
per response token, and generalised advantage estimation spreads the reward over the tokens:

    r_t     = reward if t is the response's last token else 0
    delta_t = r_t + gamma * V_{t+1} - V_t                  # V after the last token is 0
    A_t     = delta_t + gamma * lam * A_{t+1}              # GAE(gamma, lam)
    R_t     = A_t + V_t                                    # the critic's regression target
    L_i     = mean_t[ -min(ratio_t * A_t, clip(ratio_t, 1-e, 1+e) * A_t) + beta * KL_t ]
    V_loss  = mean_t[ max((V_t - R_t)^2, (clip(V_t, V_old - c, V_old + c) - R_t)^2) ] / 2

The policy and the critic train in the same streamed micro-batches (one optimizer step each per
batch); for the first ``critic_warmup_steps`` steps only the critic learns. ``V_old`` is the
critic's value when the batch was first seen, so with one optimizer step per batch the value
clip only matters once epochs over a batch exist; it is kept for that. Advantages are not
whitened per micro-batch, so the update does not depend on how the batch was cut (stream
equals batch).
"""

from __future__ import annotations

from pydantic import Field

from streamrl.algorithms.clipped import ClippedConfig, ClippedSurrogate


class PPOConfig(ClippedConfig):
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount per token."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE lambda: 1 is the Monte-Carlo return, 0 the one-step TD error."""
    value_clip: float = Field(0.2, ge=0)
    """How far the critic's prediction may move from ``V_old`` in the clipped value loss."""
    value_coef: float = Field(0.5, ge=0)
    """Weight of the value loss next to the policy loss."""
    critic_warmup_steps: int = Field(0, ge=0)
    """Optimizer steps at the start in which only the critic learns (the policy stays put until
    its advantages come from a critic that has seen some returns)."""


class PPO(ClippedSurrogate):
    """Clipped surrogate with token-level GAE advantages from a learned critic."""

    needs_critic = True

    def __init__(self, config: PPOConfig):
        super().__init__(config)
        self.critic_warmup_steps = config.critic_warmup_steps
        self.zero_advantage_no_gradient = False  # advantages are per token, from the critic

    def advantages(self, rewards: list[float]) -> list[float]:
        """Unused: PPO's advantages are per token (:meth:`token_advantages`)."""
        return [0.0] * len(rewards)

    def token_advantages(self, rewards, values, mask):
        """GAE over the response tokens: ``(advantages [B, T], returns [B, T])`` from the
        sequence rewards ``[B]``, the critic's ``values [B, T]`` and the response ``mask``."""
        import torch  # here, not at the top: the `streamrl` process registers PPO without torch

        with torch.no_grad():
            c = self.config
            B, T = mask.shape
            positions = torch.arange(T, device=mask.device)
            last = (mask * positions).argmax(-1)  # each response's last token
            first = (mask > 0).float().argmax(-1)  # and its first
            # tokens the policy did not generate inside a response (an agent's tool results, masked
            # out) are skipped, not a restart: the recursion carries the reward across them
            gap = (mask == 0) & (positions >= first[:, None]) & (positions <= last[:, None])
            token_r = torch.zeros_like(values)
            token_r[torch.arange(B), last] = rewards
            values = values * mask
            adv = torch.zeros_like(values)
            next_adv = torch.zeros(B, device=values.device)
            next_v = torch.zeros(B, device=values.device)
            for t in range(T - 1, -1, -1):
                delta = token_r[:, t] + c.gamma * next_v - values[:, t]
                a = delta + c.gamma * c.lam * next_adv
                adv[:, t] = a * mask[:, t]
                # outside the response (padding, prompt) the recursion restarts; across a gap it goes on
                next_adv = torch.where(mask[:, t] > 0, a, torch.where(gap[:, t], next_adv, torch.zeros_like(a)))
                next_v = torch.where(mask[:, t] > 0, values[:, t], torch.where(gap[:, t], next_v, torch.zeros_like(a)))
            return adv, (adv + values) * mask

    def value_loss(self, values, old_values, returns, mask):
        """Per-sample clipped value loss ``[B]`` (mean over the response tokens)."""
        import torch

        c = self.config
        clipped = old_values + (values - old_values).clamp(-c.value_clip, c.value_clip)
        per_token = 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
        return c.value_coef * (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
