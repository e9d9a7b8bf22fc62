"""How off-policy a micro-batch was, counted by token staleness: the trainer side of the
``offpolicy/...`` fields of every step record (``telemetry/off_policy.py`` turns the sums into
means).

A token's staleness is the number of policy versions between the policy being trained and the
one that generated it (the sample's per-token versions where the engine kept them, else its
version). Tokens fall into buckets ``0``, ``1``, ``2-3`` and ``4+``. Per bucket, with
``d_t = new_t - old_t`` (the trained policy's log-prob of the token over the behaviour one's)
and ``w_t = exp(d_t)``, the sums returned are:

- ``tokens``: how many; ``staleness``: the sum of their staleness;
- ``log_ratio``: the sum of ``d_t``;
- ``k3``: the sum of ``w_t - 1 - d_t``, the k3 estimate of KL(behaviour || trained) (>= 0);
- ``w`` and ``w2``: the sums of ``w_t`` and ``w_t^2``, for the normalised effective sample size
  ``(sum w)^2 / (n * sum w^2)`` (1: every token weighs the same; near 0: a few dominate);
- ``clipped``, ``truncated``, ``masked``: tokens the loss clipped, truncated or masked (the
  algorithm's per-token flags, ``algorithms/off_policy.TOKEN_FLAGS``, where it gives them).

At staleness 0 of a step's first pass the trained weights are the generating ones, so bucket
``0`` measures the training-inference mismatch (engine vs trainer log-probs of the same
weights; non-zero in bf16 on a GPU).
"""

from __future__ import annotations

import torch

#: the staleness buckets, as (name, lowest, highest) with None: no upper end
BUCKETS = (("0", 0, 0), ("1", 1, 1), ("2-3", 2, 3), ("4+", 4, None))

#: the sums kept per bucket
SUMS = ("tokens", "staleness", "log_ratio", "k3", "w", "w2", "clipped", "truncated", "masked")


def token_versions(samples, width: int) -> torch.Tensor:
    """``[B, width - 1]`` of each response token's generating version, laid out as
    ``pad_batch``'s response mask (0 elsewhere)."""
    out = torch.zeros((len(samples), width - 1), dtype=torch.long)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        versions = s.token_versions if len(s.token_versions) == r else [s.policy_version] * r
        if r:
            out[i, p - 1: p - 1 + r] = torch.tensor(versions, dtype=torch.long)
    return out


@torch.no_grad()
def bucket_sums(new: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, staleness: torch.Tensor,
                flags: dict | None = None) -> dict[str, dict[str, float]]:
    """Per bucket holding tokens: the :data:`SUMS` over its response tokens (``mask > 0``).
    ``staleness`` ``[B, T]``: versions behind, per token; ``flags``: bool ``[B, T]`` tensors."""
    d = (new.detach().float() - old.float()).clamp(-30.0, 30.0)  # (e^30: as good as infinite, and finite)
    w = torch.exp(d)
    valid = mask > 0
    flags = flags or {}
    zero = torch.zeros_like(d)
    # one value per token and sum, summed per bucket on the device and read back in one transfer
    # (a read per number would wait on the device 36 times a micro-batch)
    per_token = torch.stack([torch.ones_like(d), staleness.to(d.dtype), d, w - 1 - d, w, w * w,
                             *(flags[k].to(d.dtype) if k in flags else zero for k in ("clipped", "truncated", "masked"))])
    rows = []
    for _, lo, hi in BUCKETS:
        sel = valid & (staleness >= lo) if hi is None else valid & (staleness >= lo) & (staleness <= hi)
        rows.append((per_token * sel).sum(dim=(1, 2)))
    table = torch.stack(rows).tolist()
    return {name: dict(zip(SUMS, values)) for (name, _, _), values in zip(BUCKETS, table) if values[0] > 0}
