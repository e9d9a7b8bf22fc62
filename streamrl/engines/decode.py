"""One padded batch decoded to the end: what the static variant, the seeded one and greedy
evaluation run (``engines/static.py``, ``engines/seeded.py``, ``engines/base.py``).

Prompts are left-padded so every row's next token is in the last column; position ids count
only real tokens, so a padded row sees the positions (and hence the logits) it would see alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import transformers

from streamrl.engines.stop_tokens import first_stop

#: The name a causal LM's forward takes its KV cache by, and its output gives it back by:
#: ``cache`` from transformers 5.24 on (``past_key_values`` is deprecated there and goes in 5.40),
#: ``past_key_values`` before.
CACHE = "cache" if tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 24) else "past_key_values"


@torch.no_grad()
def decode_batch(model, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                 stop_ids: Sequence[int], pad_id: int = 0, generator: torch.Generator | None = None,
                 stop_at_eos: bool = True, greedy: bool = False) -> list[tuple[list[int], list[float]]]:
    """Sample one response per prompt: ``[(tokens, logprobs)]``, each ending at its first token
    of ``stop_ids`` (included; ``engines/stop_tokens.py``) or after ``max_new_tokens``. Logprobs
    are of the tempered distribution, as the trainer computes them. ``generator`` (a CPU generator) makes the draws reproducible;
    ``stop_at_eos=False`` decodes every row to ``max_new_tokens`` (latency profiles);
    ``greedy``: the most likely token at every step instead of a draw (evaluation)."""
    device = next(model.parameters()).device
    # Samples of one group share their prompt: prefill each distinct prompt once, then give
    # every row a copy of its prompt's KV cache (8 samples per prompt: 1/8 of the prefill)
    distinct: dict[tuple[int, ...], int] = {}
    row_of = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
    unique = [list(p) for p in distinct]
    width = max(len(p) for p in unique)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in unique], device=device)
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in unique], device=device)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True)
    past, logits, pos = out[CACHE], out.logits[:, -1], pos[:, -1:]
    if len(unique) < len(prompts):
        rows = torch.tensor(row_of, device=device)
        past.reorder_cache(rows)
        logits, attn, pos = logits[rows], attn[rows], pos[rows]
    stops = torch.tensor(list(stop_ids), dtype=torch.long, device=device)
    tokens, logps = [], []
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    for _ in range(max_new_tokens):
        lp = torch.log_softmax(logits.float() / temperature, dim=-1)
        if generator is not None:  # a CPU generator draws on the CPU
            lp = lp.cpu()
        if greedy:
            nxt = lp.argmax(-1).to(device)
        else:
            nxt = torch.multinomial(lp.exp(), 1, generator=generator).squeeze(1).to(device)
        tokens.append(nxt)
        logps.append(lp.gather(1, nxt[:, None].to(lp.device)).squeeze(1))
        done |= (nxt[:, None] == stops).any(-1)
        if stop_at_eos and bool(done.all()):
            break
        attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
        pos = pos + 1
        out = model(input_ids=nxt[:, None], attention_mask=attn, position_ids=pos, use_cache=True, **{CACHE: past})
        past, logits = out[CACHE], out.logits[:, -1]
    tok, lps = torch.stack(tokens, 1).tolist(), torch.stack(logps, 1).tolist()
    responses = []
    for row, lrow in zip(tok, lps):
        first = first_stop(row, stop_ids) if stop_at_eos else None
        end = len(row) if first is None else first + 1  # cut after the first stop token
        responses.append((row[:end], lrow[:end]))
    return responses
