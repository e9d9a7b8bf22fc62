"""DPO (Rafailov et al., 2023): learn from each group's best and worst sample as a preference
pair, against the frozen initial policy, with no reward model and no policy-gradient estimator.

Chosen +1, rejected -1, every other sample 0; the loss is ``-logsigmoid(beta * (z_chosen -
z_rejected))`` with ``z`` a response's summed log-ratio to the reference, plus optional label
smoothing (cDPO) and the chosen response's NLL (RPO). The trainer leaves advantage-0 samples out
and keeps the order, so the k-th positive and k-th negative sample of a micro-batch are one pair.
Off-policy by construction (``old`` is unused). docs/architecture.md ("Components") has the
whole loss and why each term. torch is imported in :meth:`DPO.loss` only, like ``clipped.py``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from streamrl.contracts.learning import Algorithm


class DPOConfig(BaseModel):
    """DPO's options."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    beta: float = Field(0.1, gt=0)
    """DPO temperature: the weight of the log-ratio to the reference in the implicit reward
    ``beta * z``. Smaller lets the policy go further from the reference before the loss
    saturates (0.1 is usual)."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """Probability that a pair's preference is wrong (conservative DPO, cDPO): 0 is plain DPO;
    > 0 mixes in the loss of the flipped pair, so the margin settles instead of growing forever."""
    nll_coef: float = Field(0.0, ge=0)
    """Weight of the chosen response's mean token negative log-likelihood added to each pair's
    loss (RPO); 0 is plain DPO. Keeps the chosen responses likely while the margin grows."""
    epochs: int = Field(1, ge=1, le=64)
    """Optimizer steps over each batch. DPO's loss does not depend on the generating policy, so
    later epochs need no correction; the weights are published once, after the last epoch, so
    the policy version still counts batches."""


class DPO(Algorithm):
    """Group -> (chosen, rejected) pair advantages and the DPO loss against the frozen reference."""

    needs_reference = True  # the frozen initial policy: z_i is the log-ratio to it
    zero_advantage_no_gradient = True  # only the pair's two samples enter the loss
    min_group_size = 2  # a pair needs two samples of the prompt
    pairs = True  # (one chosen and one rejected sample per group: a split rollout's last segment)

    def __init__(self, config: DPOConfig):
        self.config = config
        self.epochs = config.epochs

    def advantages(self, rewards: list[float]) -> list[float]:
        """+1 for the highest-reward rollout, -1 for the lowest, 0 for every other (first one on
        ties); all zeros for a group whose rewards are all equal (no pair). One reward per
        rollout: the trainer gives a rollout split into segments once, and pairs its last
        segment (``pairs``)."""
        adv = [0.0] * len(rewards)
        if len(rewards) < 2 or min(rewards) == max(rewards):
            return adv
        best = max(range(len(rewards)), key=lambda i: rewards[i])  # max/min keep the first on ties
        worst = min(range(len(rewards)), key=lambda i: rewards[i])
        adv[best], adv[worst] = 1.0, -1.0
        return adv

    def loss(self, new, old, ref, adv, mask):
        """Per-sample loss ``[B]``: each pair's DPO loss on its chosen sample's position, 0 on
        its rejected sample's and on samples outside any pair. ``old`` is unused (off-policy)."""
        import torch
        import torch.nn.functional as F

        if adv.dim() != 1:
            raise ValueError(f"dpo: advantages must be one per sample [B], got shape {tuple(adv.shape)}")
        chosen = (adv > 0).nonzero().flatten()
        rejected = (adv < 0).nonzero().flatten()
        if len(chosen) != len(rejected):
            raise ValueError(f"dpo: a micro-batch must hold as many chosen samples (advantage > 0) as "
                             f"rejected ones (advantage < 0), got {len(chosen)} and {len(rejected)}: "
                             "its groups must be whole, each with one pair")
        if len(chosen) == 0:  # no pair (the trainer's empty pass): zero, still in new's graph
            zero = new.new_zeros(())
            stats = {"reward_margin_sum": zero, "pair_accuracy_sum": zero, "pairs_sum": zero}
            return (new * mask).sum(-1) * 0.0, stats
        if ref is None:
            raise ValueError("dpo: needs the reference policy's logprobs (needs_reference), got ref = None")
        z = ((new - ref) * mask).sum(-1)  # [B] sequence log-ratio to the reference
        margin = self.config.beta * (z[chosen] - z[rejected])  # [pairs]
        ls = self.config.label_smoothing
        pair_loss = -(1 - ls) * F.logsigmoid(margin) - ls * F.logsigmoid(-margin)
        if self.config.nll_coef > 0:  # RPO: the chosen response's mean token NLL
            n_chosen = mask[chosen].sum(-1).clamp(min=1)
            pair_loss = pair_loss - self.config.nll_coef * (new[chosen] * mask[chosen]).sum(-1) / n_chosen
        per_sample = torch.zeros_like(z).index_put((chosen,), pair_loss)
        with torch.no_grad():
            # (a step divides each sum by the samples it trained, two per pair: twice the
            # pairs' sums read as per-pair means)
            stats = {
                "reward_margin_sum": 2 * margin.sum(),
                "pair_accuracy_sum": 2 * (z[chosen] > z[rejected]).float().sum(),
                "pairs_sum": torch.tensor(float(len(chosen)), device=z.device),
            }
        return per_sample, stats
