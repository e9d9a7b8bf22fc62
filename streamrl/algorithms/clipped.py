"""The PPO clipped surrogate on a per-sample or per-token advantage: the loss the built-in
policy-gradient algorithms share (GRPO, RLOO, Dr. GRPO, REINFORCE++, PPO), and a base a plugin's
algorithm can build on (``from streamrl.api import ClippedSurrogate, ClippedConfig``): subclass
it, give it ``advantages`` and it has the loss, the KL penalty, decoupled PPO for stale samples
and PPO epochs.

    ratio_t = exp(logp_new_t - logp_old_t)                      # old = the generating policy
    L_i = mean_t[ -min(ratio_t * A_i, clip(ratio_t, 1-e, 1+e) * A_i) + beta * KL_t ]
    KL_t = exp(ref_t - new_t) - (ref_t - new_t) - 1             # k3 estimator, >= 0
    + behaviour_kl * (exp(new_t - old_t) - (new_t - old_t) - 1)  # optional: KL(behaviour || new)

Stale samples (``async`` mode), and samples another learner's policy generated, are corrected
by ``[algorithm.off_policy]`` (``algorithms/off_policy.py``: ``none``, ``tis``, ``decoupled``,
``icepop``, ``geo_reject``, ``m2po``): a per-token weight and mask on this loss, with each
formula and its paper there. ``off_policy_cap = C`` is the short form of ``{correction = "tis",
cap = C}``.

torch is imported in :meth:`ClippedSurrogate.loss` only: ``streamrl.api`` exports this module and
stays light for the ``streamrl`` process.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from streamrl.algorithms.off_policy import LOG_RATIO_BOUND, TOKEN_FLAGS, OffPolicyConfig, ratio_and_weight
from streamrl.contracts.learning import Algorithm



def k3(d):
    """The k3 estimate ``e^d - d - 1`` of a KL from log-ratios ``d``, continued past
    :data:`LOG_RATIO_BOUND` by its tangent there. ``e^d`` past float32's range is an infinity whose
    backward is NaN; bounding ``d`` inside the exp alone would leave ``-d``'s gradient, which
    points the other way (the penalty would push a token already far off further off). The
    tangent keeps the pull's direction, at its size at the bound."""
    import torch

    b = d.clamp(max=LOG_RATIO_BOUND)
    e = torch.exp(b)
    return e - b - 1 + (e - 1) * (d - b)

class ClippedConfig(BaseModel):
    """The clipped surrogate's options, shared by the algorithms built on it."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    clip: float = Field(0.2, gt=0)
    """PPO clip range epsilon on the probability ratio."""
    kl_coef: float = Field(0.0, ge=0)
    """beta: weight of the KL penalty to the frozen initial policy (0 = no reference model)."""
    off_policy: OffPolicyConfig = OffPolicyConfig()
    """How tokens another policy generated are corrected (stale ``async`` samples, a side
    learner's or a variant's samples): ``{correction = "tis", cap = 2.0}`` and the others of
    ``algorithms/off_policy.py``. Default ``none``: PPO's clip to the behaviour policy."""
    off_policy_cap: float = Field(0.0, ge=0)
    """Short form: ``C > 0`` is ``off_policy = {correction = "tis", cap = C}`` (token-level
    truncated importance sampling against the trainer's weights before the step). 0: off."""
    behaviour_kl: float = Field(0.0, ge=0)
    """Weight of an anchor to the policy that generated the samples: the per-token k3 estimate
    of KL(behaviour || trained) on the sampled tokens, ``r - 1 - log r`` with ``r = pi / pi_b``
    (>= 0; its gradient is ``(r - 1) * grad log pi``, whose mean is that of behaviour cloning on
    the samples). For a learner that is not served: its policy-gradient term pushes down the
    tokens of bad samples, and the mass it frees goes to tokens the behaviour policy never
    samples, so nothing ever corrects them; the anchor keeps the learner's mass where the
    behaviour policy puts it. On-policy (``r`` near 1) it is near 0. 0: off."""
    dual_clip: float = Field(0.0, ge=0)
    """0: off. ``c > 1``: dual-clip PPO (Ye et al., 2020) -- for a negative advantage the per-token
    loss is at most ``c * |A|``, so a token the trained policy finds far likelier than the policy
    that generated it (a ratio far above 1, as for a learner that is not served) cannot pull with
    an unbounded weight."""
    epochs: int = Field(1, ge=1, le=64)
    """Optimizer steps over each batch (PPO epochs; with the ``none`` or ``m2po`` correction,
    whose clip is to the generating policy). Every epoch trains the advantages (and a critic's
    values and returns) of the first pass over the batch. Epoch ``e`` trains on samples ``e - 1``
    updates older than the policy, on top of any ``async`` staleness; the clip bounds how far
    the ratio to the generating policy may pull. The weights are published once, after the
    last epoch, so the policy version still counts batches."""

    @model_validator(mode="after")
    def _short_form(self):
        if 0 < self.dual_clip <= 1:  # (the bound c * |A| would sit below the clipped surrogate: it would do nothing)
            raise ValueError(f"dual_clip = {self.dual_clip}: expected 0 (off) or a value above 1")
        if self.off_policy_cap > 0:
            # (the table as the short form would write it is the same setting, not a second one)
            if "off_policy" in self.model_fields_set and self.off_policy != OffPolicyConfig(
                    correction="tis", cap=self.off_policy_cap):
                raise ValueError("give off_policy_cap or [algorithm.off_policy], not both")
            self.off_policy = OffPolicyConfig(correction="tis", cap=self.off_policy_cap)
        if self.epochs > 1 and self.off_policy.correction not in ("none", "m2po"):
            # these take the weights before each optimizer step as the proximal policy: from the
            # second epoch on the ratio to it is 1, and nothing bounds how far the step goes
            raise ValueError(f"epochs = {self.epochs} with off_policy correction {self.off_policy.correction!r}: "
                             "its trust region is around the weights before each optimizer step, so later epochs "
                             "would have none; expected epochs = 1, or correction 'none' or 'm2po' (clipped to the "
                             "policy that generated the samples)")
        return self


class ClippedSurrogate(Algorithm):
    """The clipped surrogate loss on the advantages a subclass gives (:meth:`advantages`)."""

    def __init__(self, config: ClippedConfig):
        self.config = config
        self.needs_reference = config.kl_coef > 0
        # without a KL term the loss is advantage * (a function of the ratio): zero advantage,
        # zero gradient, so the trainer may skip such samples -- unless the correction looks
        # across the micro-batch's tokens (M2PO's mask is chosen over all of them: leaving some
        # out changes which tokens of the others are masked)
        self.zero_advantage_no_gradient = (config.kl_coef == 0 and config.behaviour_kl == 0
                                           and config.off_policy.correction != "m2po")
        self.epochs = config.epochs

    def loss(self, new, old, ref, adv, mask):
        """Per-sample loss ``[B]`` from token logprobs ``[B, T]`` and a response mask ``[B, T]``."""
        import torch

        ratio, behaviour_weight, flags = ratio_and_weight(self.config.off_policy, new, old, mask)
        clipped = torch.clamp(ratio, 1 - self.config.clip, 1 + self.config.clip)
        a = adv[:, None] if adv.dim() == 1 else adv  # per sample [B] or per token [B, T]
        surrogate = torch.minimum(ratio * a, clipped * a)
        if self.config.dual_clip > 1:  # (a >= 0 is untouched: its surrogate is already at most (1 + e) * a)
            surrogate = torch.where(a < 0, torch.maximum(surrogate, self.config.dual_clip * a), surrogate)
        per_token = -surrogate * behaviour_weight
        kl = torch.zeros_like(new)
        if ref is not None:
            kl = k3(ref - new)
            per_token = per_token + self.config.kl_coef * kl
        anchor = torch.zeros_like(new)
        if self.config.behaviour_kl > 0:  # k3 of KL(behaviour || new) on the behaviour's samples
            anchor = k3(new - old)
            per_token = per_token + self.config.behaviour_kl * anchor
        n_tokens = mask.sum(-1).clamp(min=1)
        # (where, not a product: a padded position's value may be anything, and inf * 0 is NaN)
        per_sample = torch.where(mask > 0, per_token, 0.0).sum(-1) / n_tokens
        with torch.no_grad():
            was_clipped = ((ratio - clipped).abs() > 1e-8).float()
            stats = {
                TOKEN_FLAGS: {**flags, "clipped": (was_clipped * mask) > 0},
                "clip_frac_sum": ((was_clipped * mask).sum(-1) / n_tokens).sum(),
                "kl_sum": ((kl * mask).sum(-1) / n_tokens).sum(),
                "behaviour_weight_sum": ((behaviour_weight * mask).sum(-1) / n_tokens).sum(),
            }
            if self.config.behaviour_kl > 0:
                stats["behaviour_kl_sum"] = ((anchor * mask).sum(-1) / n_tokens).sum()
        return per_sample, stats
