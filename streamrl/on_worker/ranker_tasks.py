"""The tasks of the rank pool: the length ranker's scores for a step's prompts, the output lengths
it learns from once they are known, and its state for a checkpoint and back
(``flow/dispatch.py`` submits them, ordered by ``after``).
"""

from __future__ import annotations

from streamrl.on_worker.resident import RANKER, resident
from streamrl.sample import Prompt


def rank_prompts(prompts: list[Prompt], after=None) -> list[float]:
    """Rank pool: the length ranker's scores (higher = longer)."""
    return [float(x) for x in resident(RANKER).predict(prompts)]


def observe_lengths(prompts: list[Prompt], lengths: list[list[int]], after=None) -> int:
    """Rank pool: teach the ranker the observed output lengths; returns how many prompts."""
    resident(RANKER).observe(prompts, lengths)
    return len(prompts)


def ranker_state(after=None) -> bytes:
    """Rank pool: what the ranker has learned (after the lessons ``after`` names), as bytes for
    a checkpoint."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save(resident(RANKER).state_dict(), buf)
    return buf.getvalue()


def load_ranker_state(blob: bytes, after=None) -> bool:
    """Rank pool: restore a checkpoint's :func:`ranker_state` into the ranker."""
    import io

    import torch

    # plain values, tensors and the ranker's RNG state: never a full unpickling of a run-folder file
    resident(RANKER).load_state_dict(torch.load(io.BytesIO(blob), weights_only=True))
    return True
