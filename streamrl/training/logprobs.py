"""Log-probabilities of the sampled tokens, without the full ``[B, T, vocab]`` float32 logits.

The plain way -- ``log_softmax(model(ids).logits.float())`` then gather -- keeps every position's
logits over the whole vocabulary, in float32, alive until the backward pass. For a 0.5B model
with a 150 K vocabulary that is 16 x 576 x 151,936 x 4 bytes = 5.6 GB per micro-batch (twice
with the softmax), more than the model. Here the decoder runs once, and the output head +
log-softmax run over chunks of positions: only one chunk's logits exist at a time, forward or
backward, and the backward recomputes them. A plain linear head goes through
``training/head_logprobs.py`` (one autograd function that keeps a log-sum-exp per position and
never a float32 copy of the logits); any other head through activation checkpointing of
:func:`_head_logprobs`. Positions that are not response tokens are not computed at all.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from streamrl.training.head_logprobs import head_logprobs


def pad_token(tokenizer) -> int:
    """The id a batch is padded with: the tokenizer's pad token, else its EOS, else 0. Many
    tokenizers name no pad token (GPT-2's, Llama 3's, Mistral's); the masks are built from the
    rows' lengths, never from this id, so any token will do."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if isinstance(candidate, int):
            return candidate
    return 0


def pad_batch(samples, pad_id: int):
    """Right-padded ``input_ids``, ``attention_mask`` and a mask of response-token positions.

    ``response_mask[i, t]`` is 1 where token ``t+1`` of row ``i`` is a response token, i.e. it
    lines up with the logits at position ``t`` that predicted it, and 0 where the sample's
    ``loss_mask`` says the token was not generated (an agent's tool output between two turns).
    """
    rows = [s.prompt_ids + s.response_ids for s in samples]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    resp = torch.zeros((len(rows), width - 1), dtype=torch.float32)
    old = torch.zeros((len(rows), width - 1), dtype=torch.float32)
    for i, (s, row) in enumerate(zip(samples, rows)):
        ids[i, : len(row)] = torch.tensor(row)
        attn[i, : len(row)] = 1
        p, r = len(s.prompt_ids), len(s.response_ids)
        resp[i, p - 1: p - 1 + r] = torch.tensor(s.loss_mask, dtype=torch.float32) if s.loss_mask else 1.0
        old[i, p - 1: p - 1 + r] = torch.tensor(s.logprobs, dtype=torch.float32)
    return ids, attn, resp, old


def naive_token_logprobs(model, ids, attn, temperature: float = 1.0):
    """Log-probability of each next token (shape ``[B, T-1]``), the straightforward way."""
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def _head_logprobs(head, hidden, targets, temperature: float):
    # one chunk: [N, H] hidden states -> [N] log-probabilities of ``targets``. The head is linear:
    # dividing its [N, H] input by the temperature gives the logits / temperature with
    # vocab / H times fewer divisions (170x for Qwen2.5-0.5B) than dividing the [N, vocab]
    # logits -- that division was 6% of a GPU step's device time, 17% of a CPU one's
    if isinstance(head, torch.nn.Linear) and head.bias is None:
        logits = head(hidden / temperature if temperature != 1.0 else hidden).float()
    else:
        logits = head(hidden).float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)


def _chunkable(model) -> bool:
    # models whose logits are not just ``lm_head(last hidden state)`` (soft-capping, scaling)
    # take the plain path, which transformers computes right for them
    cfg = model.config
    return (model.get_output_embeddings() is not None and not getattr(cfg, "final_logit_softcapping", None)
            and getattr(cfg, "logit_scale", None) is None)


def token_logprobs(model, ids, attn, temperature: float = 1.0, chunk_tokens: int = 0, mask=None,
                   kernels: str = "auto"):
    """Log-probability of each next token, ``[B, T-1]`` (position ``t`` holds token ``t+1``'s).

    ``chunk_tokens > 0``: the output head and log-softmax run over at most that many positions
    at a time (recomputed in the backward pass), and with ``mask`` (``[B, T-1]``, 1 on response
    tokens) only masked positions are computed; the rest of the result is 0. ``chunk_tokens = 0``
    or a model whose logits are not a plain head: the full-logits computation. ``kernels``:
    ``trainer.logprob_kernels`` (eager or compiled per-chunk reductions of a linear head, or
    ``checkpointed``: every head through activation checkpointing).
    """
    if chunk_tokens <= 0 or not _chunkable(model):
        return naive_token_logprobs(model, ids, attn, temperature)
    hidden = model.get_decoder()(input_ids=ids, attention_mask=attn).last_hidden_state[:, :-1]
    targets = ids[:, 1:]
    where = mask > 0 if mask is not None else torch.ones_like(targets, dtype=torch.bool)
    h, y = hidden[where], targets[where]
    head = model.get_output_embeddings()
    out = torch.zeros(targets.shape, dtype=torch.float32, device=hidden.device)
    if not h.shape[0] and torch.is_grad_enabled():
        # no position to compute (empty responses, tokens all masked): still a result in the
        # graph, through the head too, whose gradient is exactly zero -- a loss without one is
        # an algorithm's mistake to the trainer, and every rank's backward must reach every weight
        return out + head(hidden[:1, :1]).float().sum() * 0.0
    if isinstance(head, torch.nn.Linear) and head.bias is None and kernels != "checkpointed":
        # the head is linear: dividing its input by the temperature divides the logits by it
        if h.shape[0]:
            out = out.masked_scatter(where, head_logprobs(head, h / temperature if temperature != 1.0 else h, y,
                                                          chunk_tokens, kernels))
        return out
    parts = []
    for i in range(0, h.shape[0], chunk_tokens):
        if torch.is_grad_enabled():
            parts.append(checkpoint(_head_logprobs, head, h[i:i + chunk_tokens], y[i:i + chunk_tokens], temperature,
                                    use_reentrant=False))
        else:
            parts.append(_head_logprobs(head, h[i:i + chunk_tokens], y[i:i + chunk_tokens], temperature))
    if parts:
        out = out.masked_scatter(where, torch.cat(parts))
    return out


class TokenLogprobs(torch.nn.Module):
    """:func:`token_logprobs` as a module around a causal LM. Sharded (FSDP), the model's own
    weights outside its decoder layers (embeddings, final norm, output head) are gathered by
    hooks around the *root* module's forward; the chunked path calls the decoder and the head
    separately, so the root must be this module, whose forward is the whole computation."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids, attn, temperature: float = 1.0, chunk_tokens: int = 0, mask=None, kernels: str = "auto"):
        """Same as :func:`token_logprobs` on the wrapped model."""
        return token_logprobs(self.model, ids, attn, temperature, chunk_tokens, mask, kernels)
