"""The ``offpolicy/...`` fields of a step record: how far the trained tokens were from the
policy being trained, per token-staleness bucket, from the sums the trainer counted
(``training/off_policy_stats.py``).

Per bucket ``b`` (``0``, ``1``, ``2-3``, ``4+``; a bucket without tokens has no fields):

- ``offpolicy/<b>/tokens``: tokens trained;
- ``offpolicy/<b>/log_ratio``: mean of ``log pi_trained - log pi_behaviour``;
- ``offpolicy/<b>/k3``: mean k3 estimate of KL(behaviour || trained);
- ``offpolicy/<b>/ess``: the normalised effective sample size of the importance weights
  ``w = pi_trained / pi_behaviour``, ``(sum w)^2 / (n sum w^2)`` in (0, 1];
- ``offpolicy/<b>/clipped``, ``/truncated``, ``/masked``: the shares of its tokens the loss
  clipped, truncated or masked.

And over all tokens: ``offpolicy/token_staleness_mean``, ``offpolicy/ess``, and ``offpolicy/mismatch_k3`` -- bucket ``0``'s k3, the
training-inference mismatch (engine and trainer log-probs of the same weights) on a step's first
pass. ``offpolicy/low_ess`` is 1 when a bucket's effective sample size fell below
:data:`LOW_ESS` (the console says so once per run, naming the step and the bucket).
"""

from __future__ import annotations

#: a bucket whose importance weights' normalised effective sample size falls below this is
#: flagged (``offpolicy/low_ess``): its update rests on a few tokens (docs/benchmarks.md)
LOW_ESS = 0.5

def ess(w: float, w2: float, n: float) -> float:
    """Normalised effective sample size from the sums of the weights and their squares."""
    return min(1.0, (w * w) / (n * w2)) if n > 0 and w2 > 0 else 1.0  # (<= 1 in exact arithmetic)


def record_fields(sums: dict[str, dict[str, float]]) -> dict[str, float]:
    """The record's ``offpolicy/...`` fields from the summed buckets (empty without tokens)."""
    out: dict[str, float] = {}
    total = {"tokens": 0.0, "w": 0.0, "w2": 0.0, "staleness": 0.0}
    low = False
    for bucket in ("0", "1", "2-3", "4+"):
        b = sums.get(bucket)
        if not b or not b.get("tokens"):
            continue
        n = b["tokens"]
        e = ess(b.get("w", n), b.get("w2", n), n)
        low = low or e < LOW_ESS
        out.update({f"offpolicy/{bucket}/tokens": int(n), f"offpolicy/{bucket}/log_ratio": b.get("log_ratio", 0.0) / n,
                    f"offpolicy/{bucket}/k3": b.get("k3", 0.0) / n, f"offpolicy/{bucket}/ess": e,
                    **{f"offpolicy/{bucket}/{k}": b.get(k, 0.0) / n for k in ("clipped", "truncated", "masked")}})
        total["tokens"] += n
        total["w"] += b.get("w", n)
        total["w2"] += b.get("w2", n)
        total["staleness"] += b.get("staleness", 0.0)
    if total["tokens"]:
        out["offpolicy/token_staleness_mean"] = total["staleness"] / total["tokens"]
        out["offpolicy/ess"] = ess(total["w"], total["w2"], total["tokens"])
        out["offpolicy/low_ess"] = int(low)
        if "offpolicy/0/k3" in out:
            out["offpolicy/mismatch_k3"] = out["offpolicy/0/k3"]
    return out


def lowest_ess_bucket(record: dict) -> tuple[str, float] | None:
    """The bucket with the lowest effective sample size under :data:`LOW_ESS` in a step's
    record, and that size; None when no bucket is under it."""
    found = [(k.split("/")[1], v) for k, v in record.items()
             if k.startswith("offpolicy/") and k.endswith("/ess") and k.count("/") == 2 and v < LOW_ESS]
    return min(found, key=lambda x: x[1]) if found else None
