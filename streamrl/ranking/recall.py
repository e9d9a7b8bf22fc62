"""How good a length ranker is: recall of the truly longest prompts in its predicted top."""

from __future__ import annotations


def top_recall(predicted: list[float], actual: list[float], frac: float = 0.2) -> float:
    """Share of the truly longest ``frac`` of items that the prediction also puts in its top ``frac``.

    Both lists are per item (higher = longer); ``k = max(1, round(frac * n))``. Ties are broken
    by position, the same way for both lists.
    """
    n = len(actual)
    if n == 0 or len(predicted) != n:
        raise ValueError(f"need two lists of the same non-zero length, got {len(predicted)} and {n}")
    k = max(1, round(frac * n))
    top_true = set(sorted(range(n), key=lambda i: (-actual[i], i))[:k])
    top_pred = set(sorted(range(n), key=lambda i: (-predicted[i], i))[:k])
    return len(top_true & top_pred) / k
