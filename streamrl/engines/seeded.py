"""Reproducible sampling: one prompt group decoded by its own loop with its own random generator.

Continuous batching shares one random stream among whatever requests happen to be in a batch,
so which tokens a request draws depends on arrival timing. Here a group is decoded alone (``n``
copies of one prompt, so the batch and hence the arithmetic are the same every time) and draws
from a ``torch.Generator`` seeded by the run's seed and the prompt's uid: the same seed gives
the same samples whatever else the worker is doing. The price is no batching across groups.
"""

from __future__ import annotations

import zlib

import torch

from streamrl.engines.static import decode_batch


def group_generator(seed: int, uid: str) -> torch.Generator:
    """The random stream of one prompt group: a function of the run's seed and the prompt only."""
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(uid.encode()))


def sample_group(model, ids: list[int], n: int, max_new_tokens: int, temperature: float, eos_id: int,
                 generator: torch.Generator) -> list[tuple[list[int], list[float]]]:
    """``n`` sampled responses to the prompt ``ids``: ``[(tokens, logprobs)]``, each ending at
    its first EOS (included) or after ``max_new_tokens``. Logprobs are of the tempered
    distribution, as the trainer computes them."""
    return decode_batch(model, [ids] * n, max_new_tokens, temperature, eos_id, generator=generator)
