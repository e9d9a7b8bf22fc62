"""Dynamic micro-batches: whatever groups are ready, cut to a token budget.

In ``stream`` and ``async`` mode the controller hands the trainer every scored group that is
ready whenever the trainer is about to run dry (at most one train task queued behind the
running one), so a fast trainer takes small pieces and a busy one larger ones. The train task
then cuts its groups into micro-batches of at most ``trainer.micro_batch_tokens`` tokens
(prompt + response, as the forward pass sees them). A group is never split -- GRPO normalises
advantages within it -- so a group over the budget is a micro-batch of its own. Every group goes
to exactly one train task, so every sample is trained exactly once.
"""

from __future__ import annotations


def pack(sizes: list[int], budget: int, max_items: int = 0) -> list[list[int]]:
    """Cut items of ``sizes`` (in order) into consecutive micro-batches of total size ``<= budget``.

    ``budget == 0`` means no token budget; ``max_items > 0`` caps the items per micro-batch.
    An item larger than the budget gets a micro-batch to itself. Returns lists of indices.
    """
    out: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i, size in enumerate(sizes):
        over_budget = budget and cur and used + size > budget
        over_count = max_items and len(cur) >= max_items
        if over_budget or over_count:
            out.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += size
    if cur:
        out.append(cur)
    return out


def group_tokens(group) -> int:
    """Tokens of a group as the trainer's forward pass sees them (prompt + response per sample)."""
    return sum(len(s.prompt_ids) + len(s.response_ids) for s in group)
