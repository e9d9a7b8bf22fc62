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


def group_generator(seed: int, uid: str) -> torch.Generator:
    """The random stream of one prompt group: a function of the run's seed and the prompt only."""
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(uid.encode()))


@torch.no_grad()
def sample_group(model, ids: list[int], n: int, max_new_tokens: int, temperature: float, eos_id: int,
                 generator: torch.Generator) -> list[tuple[list[int], list[float]]]:
    """``n`` sampled responses to the prompt ``ids``: ``[(tokens, logprobs)]``, each ending at
    its first EOS (included) or after ``max_new_tokens``. Logprobs are of the tempered
    distribution, as the trainer computes them."""
    device = next(model.parameters()).device
    out = model(torch.tensor([ids] * n, device=device), use_cache=True)
    past, logits = out.past_key_values, out.logits[:, -1]
    tokens, logps = [], []
    done = torch.zeros(n, dtype=torch.bool)
    for _ in range(max_new_tokens):
        lp = torch.log_softmax(logits.float().cpu() / temperature, dim=-1)
        nxt = torch.multinomial(lp.exp(), 1, generator=generator).squeeze(1)
        tokens.append(nxt)
        logps.append(lp.gather(1, nxt[:, None]).squeeze(1))
        done |= nxt == eos_id
        if bool(done.all()):
            break
        out = model(nxt[:, None].to(device), past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1]
    tok, lps = torch.stack(tokens, 1), torch.stack(logps, 1)
    responses = []
    for i in range(n):
        row = tok[i].tolist()
        end = row.index(eos_id) + 1 if eos_id in row else len(row)  # cut after the first EOS
        responses.append((row[:end], lps[i, :end].tolist()))
    return responses
