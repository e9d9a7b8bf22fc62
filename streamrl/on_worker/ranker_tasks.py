"""The tasks of the rank pool: the length ranker's scores for a step's prompts, the output lengths
it learns from once they are known, and its state for a checkpoint and back
(``flow/dispatch.py`` submits them, ordered by ``after``).

One at a time on the worker (:data:`_ONE`): ``after`` orders them, but the controller lets go of
a lesson it waited too long for, and a ranker (its state, its optimizer) is not made to be
taught and asked from two threads at once.
"""

from __future__ import annotations

import math
import threading

from streamrl.on_worker.resident import RANKER, resident
from streamrl.sample import Prompt

_ONE = threading.Lock()


def rank_prompts(prompts: list[Prompt], after=None) -> list[float] | str:
    """Rank pool: the length ranker's scores (higher = longer), one finite number per prompt; or,
    when the ranker raised or gave anything else, what went wrong, as text. A ranker only
    orders work: the run goes on without its scores (``flow/dispatch.py`` says so once)."""
    try:
        with _ONE:
            given = resident(RANKER).predict(prompts)
        scores = [float(x) for x in given]
    except Exception as exc:  # (a plugin's bug; a ComponentError too: the ranker could not be built)
        return f"predict() raised {type(exc).__name__}: {str(exc)[:200]}"
    if len(scores) != len(prompts) or not all(math.isfinite(x) for x in scores):
        return (f"predict() gave {len(scores)} scores for {len(prompts)} prompts" if len(scores) != len(prompts)
                else "predict() gave a score that is not finite")
    return scores


def observe_lengths(prompts: list[Prompt], lengths: list[list[int]], after=None) -> int | str:
    """Rank pool: teach the ranker the observed output lengths; returns how many prompts, or what
    went wrong as text (a lesson that fails is skipped: the run's save and next placements must
    not wait on it)."""
    try:
        with _ONE:
            resident(RANKER).observe(prompts, lengths)
    except Exception as exc:
        return f"observe() raised {type(exc).__name__}: {str(exc)[:200]}"
    return len(prompts)


def ranker_state(after=None) -> bytes:
    """Rank pool: what the ranker has learned (after the lessons ``after`` names), as bytes for
    a checkpoint."""
    import io

    import torch

    buf = io.BytesIO()
    with _ONE:
        torch.save(resident(RANKER).state_dict(), buf)
    return buf.getvalue()


def load_ranker_state(blob: bytes, after=None) -> bool:
    """Rank pool: restore a checkpoint's :func:`ranker_state` into the ranker."""
    import io

    import torch

    # plain values, tensors and the ranker's RNG state: never a full unpickling of a run-folder file
    with _ONE:
        resident(RANKER).load_state_dict(torch.load(io.BytesIO(blob), weights_only=True))
    return True
