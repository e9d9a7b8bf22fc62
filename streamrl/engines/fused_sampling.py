"""The next token and its log-prob from a decode step's logits in two Triton kernels: how the
slot decoder samples on a GPU (``engine.fused_sampling``).

Sampling in torch ops (``SlotDecoder._sample``) turns the ``[slots, vocabulary]`` bf16 logits
into float32, divides, takes the log-softmax, draws as many exponentials, adds and takes two
argmaxes: about ten passes over a float32 tensor of 155 MB at 256 slots of Qwen's 151,936
tokens, three quarters of a millisecond of a 4.6 ms step on an H200, and it grows with the
slots. Here the logits are read once, as bf16, and nothing of their size is written:

1. ``_chunk_kernel``, one program per (row, chunk of :data:`CHUNK` tokens): the chunk's largest
   tempered logit and its index, the sum of ``exp(logit / T - max)`` (float32), and the
   Gumbel-max draw -- the index of the largest ``logit / T + Gumbel noise``, the noise from
   Philox (``tl.rand4x``, four uniforms a call) keyed by a seed in device memory and each
   element's own offset;
2. ``_pick_kernel``, one program per row: the log-sum-exp over the chunks, the winning chunk's
   draw (or its argmax where the row is greedy), and that token's log-prob ``logit / T - lse``;
   it also moves the seed on by one, so the next step (a CUDA graph's replay reads the same
   seed tensor) draws new noise.

The draw is the Gumbel-max trick as in the torch ops, a sample of ``softmax(logits / T)``; its
log-prob is computed in float32 from the bf16 logits, as the trainer computes it.
:func:`available` says whether Triton is here; a CPU runs the torch ops (the tests run these
kernels on a CPU through Triton's interpreter, ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU install: the slot decoder samples with torch ops
    triton = None

#: Vocabulary entries one program of the first kernel reads: four blocks of ``CHUNK // 4``, one
#: Philox call giving the four uniforms of an offset.
CHUNK = 4096
#: Most chunks a row may have (the second kernel reads them in one block): 256 x 4,096 tokens.
MAX_CHUNKS = 256


def available() -> bool:
    """Whether Triton can be imported (the kernels' only requirement besides a GPU)."""
    return triton is not None


if triton is not None:

    @triton.jit
    def _block(logits_ptr, cols, vocab, temperature, u):
        # one block's tempered logits (-inf past the vocabulary) and their Gumbel-perturbed scores
        ok = cols < vocab
        x = tl.load(logits_ptr + cols, mask=ok, other=float("-inf")).to(tl.float32) / temperature
        # -log(-log(u)) is Gumbel noise; u = 0 gives -inf, a score that never wins
        g = -tl.log(-tl.log(u))
        return x, tl.where(ok, x + g, float("-inf"))

    @triton.jit
    def _first_max(v0, v1, v2, v3, Q: tl.constexpr):
        # the largest value of four consecutive blocks of Q and its first index among the 4 x Q
        # (blocks in order, ties to the left, as torch's argmax)
        best, at = tl.max(v0, 0, return_indices=True)
        m, i = tl.max(v1, 0, return_indices=True)
        at = tl.where(m > best, Q + i, at)
        best = tl.maximum(best, m)
        m, i = tl.max(v2, 0, return_indices=True)
        at = tl.where(m > best, 2 * Q + i, at)
        best = tl.maximum(best, m)
        m, i = tl.max(v3, 0, return_indices=True)
        at = tl.where(m > best, 3 * Q + i, at)
        return tl.maximum(best, m), at

    @triton.jit
    def _chunk_kernel(logits_ptr, stride, vocab, temperature, seed_ptr, top_ptr, top_idx_ptr, sum_ptr,
                      draw_ptr, draw_idx_ptr, n_chunks, Q: tl.constexpr):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        seed = tl.load(seed_ptr)
        lane = tl.arange(0, Q)
        start = chunk * 4 * Q
        u0, u1, u2, u3 = tl.rand4x(seed, (row * n_chunks + chunk) * Q + lane)
        base = logits_ptr + row.to(tl.int64) * stride
        x0, s0 = _block(base, start + lane, vocab, temperature, u0)
        x1, s1 = _block(base, start + Q + lane, vocab, temperature, u1)
        x2, s2 = _block(base, start + 2 * Q + lane, vocab, temperature, u2)
        x3, s3 = _block(base, start + 3 * Q + lane, vocab, temperature, u3)
        top, top_i = _first_max(x0, x1, x2, x3, Q)  # the chunk's largest logit (torch's argmax)
        total = (tl.sum(tl.exp(x0 - top), 0) + tl.sum(tl.exp(x1 - top), 0)
                 + tl.sum(tl.exp(x2 - top), 0) + tl.sum(tl.exp(x3 - top), 0))
        draw, draw_i = _first_max(s0, s1, s2, s3, Q)  # the chunk's Gumbel-max draw
        at = row * n_chunks + chunk
        tl.store(top_ptr + at, top)
        tl.store(top_idx_ptr + at, start + top_i)
        tl.store(sum_ptr + at, total)
        tl.store(draw_ptr + at, draw)
        tl.store(draw_idx_ptr + at, start + draw_i)

    @triton.jit
    def _pick_kernel(logits_ptr, stride, temperature, greedy_ptr, seed_ptr, top_ptr, top_idx_ptr, sum_ptr,
                     draw_ptr, draw_idx_ptr, token_ptr, logprob_ptr, n_chunks, NC: tl.constexpr):
        row = tl.program_id(0)
        c = tl.arange(0, NC)
        ok = c < n_chunks
        at = row * n_chunks + c
        top = tl.load(top_ptr + at, mask=ok, other=float("-inf"))
        total = tl.load(sum_ptr + at, mask=ok, other=0.0)
        peak = tl.max(top, 0)
        lse = peak + tl.log(tl.sum(total * tl.exp(top - peak), 0))
        _, best = tl.max(top, 0, return_indices=True)
        draw = tl.load(draw_ptr + at, mask=ok, other=float("-inf"))
        _, won = tl.max(draw, 0, return_indices=True)
        argmax = tl.sum(tl.where(c == best, tl.load(top_idx_ptr + at, mask=ok, other=0), 0), 0)
        drawn = tl.sum(tl.where(c == won, tl.load(draw_idx_ptr + at, mask=ok, other=0), 0), 0)
        token = tl.where(tl.load(greedy_ptr + row) != 0, argmax, drawn)
        x = tl.load(logits_ptr + row.to(tl.int64) * stride + token).to(tl.float32) / temperature
        tl.store(token_ptr + row, token)
        tl.store(logprob_ptr + row, x - lse)
        if row == 0:  # (every program of the first kernel has read the seed: the launches are in order)
            tl.store(seed_ptr, tl.load(seed_ptr) + 1)


def new_seed(device) -> torch.Tensor:
    """A seed tensor for :func:`sample`, drawn from torch's default generator (so
    ``torch.manual_seed`` fixes it)."""
    return torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64).to(device)


def sample(logits: torch.Tensor, greedy: torch.Tensor, temperature: float,
           seed: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens (int64) and their log-probs (float32) for ``logits`` ``[rows, vocab]``: a
    draw from ``softmax(logits / temperature)``, or the argmax where ``greedy`` (bool, ``[rows]``).
    ``seed`` (int64, one element, on the logits' device) keys the noise and moves on by one.
    ``chunk``: vocabulary entries per program of the first kernel (a power of two, at least 64;
    smaller ones let the tests cover several chunks of a small vocabulary)."""
    rows, vocab = logits.shape
    chunks = -(-vocab // chunk)
    if chunks > MAX_CHUNKS:
        raise ValueError(f"fused sampling reads at most {MAX_CHUNKS * chunk} vocabulary entries; this head has {vocab}")
    if rows * chunks * (chunk // 4) >= 2**31:
        raise ValueError(f"fused sampling: {rows} rows of {vocab} entries overflow the noise's 32-bit offsets")
    logits = logits.contiguous()
    dev = logits.device
    top = torch.empty(rows, chunks, dtype=torch.float32, device=dev)
    total, draw = torch.empty_like(top), torch.empty_like(top)
    top_idx = torch.empty(rows, chunks, dtype=torch.int32, device=dev)
    draw_idx = torch.empty_like(top_idx)
    token = torch.empty(rows, dtype=torch.int64, device=dev)
    logprob = torch.empty(rows, dtype=torch.float32, device=dev)
    _chunk_kernel[(rows, chunks)](logits, logits.stride(0), vocab, float(temperature), seed, top, top_idx, total,
                                  draw, draw_idx, chunks, Q=chunk // 4)
    _pick_kernel[(rows,)](logits, logits.stride(0), float(temperature), greedy.contiguous().view(torch.uint8), seed,
                          top, top_idx, total, draw, draw_idx, token, logprob, chunks,
                          NC=max(16, triton.next_power_of_2(chunks)))
    return token, logprob
