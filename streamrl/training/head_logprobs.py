"""The output head and the log-softmax as one autograd function over chunks of positions.

``log p(target) = logits[target] - logsumexp(logits)`` with ``logits = hidden @ W.T``. The
forward keeps only each position's log-sum-exp (one float per position); the backward
recomputes each chunk's logits and turns them straight into their gradient,
``g * (onehot(target) - softmax)``, in the head's dtype. So neither pass keeps a float32
``[positions, vocabulary]`` tensor or a stored softmax, and the log-softmax forward runs once per
chunk instead of twice (activation checkpointing's recompute).

The two per-chunk reductions (:func:`logprob_and_lse`, :func:`logits_grad`) read bf16 logits and
reduce in float32. Eager, each is a few kernels with float32 temporaries of the chunk; compiled
(``torch.compile``, on a GPU) each is one fused kernel that never writes the float32 copy.
"""

from __future__ import annotations

import functools

import torch


def logprob_and_lse(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, V]`` logits (any float dtype) -> float32 ``log p(targets)`` and ``logsumexp``, ``[N]``
    each, reduced in float32."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    return x.gather(-1, targets[:, None]).squeeze(-1) - lse, lse


def logits_grad(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The gradient of ``sum(g * log p(targets))`` with respect to ``logits``:
    ``g * (onehot(targets) - softmax(logits))``, in the logits' dtype. Eager: three passes over
    the chunk, in place."""
    d = logits.float() - lse[:, None]
    d.exp_().mul_(-g[:, None])
    d.scatter_add_(-1, targets[:, None], g[:, None])
    return d.to(logits.dtype)


def _logits_grad_fusable(logits, lse, targets, g):
    # the same as one expression of elementwise operations, which the compiler makes one kernel
    p = torch.exp(logits.float() - lse[:, None])
    hit = torch.arange(logits.shape[-1], device=logits.device)[None, :] == targets[:, None]
    return ((hit.float() - p) * g[:, None]).to(logits.dtype)


@functools.cache
def _compiled():
    # dynamic: the chunk's row count changes with every batch's number of response tokens
    return (torch.compile(logprob_and_lse, dynamic=True), torch.compile(_logits_grad_fusable, dynamic=True))


def kernels(device: torch.device, mode: str):
    """The two per-chunk functions for ``trainer.logprob_kernels = mode`` on ``device``: compiled
    for ``compiled``, and for ``auto`` on a GPU where Triton is installed; eager otherwise."""
    if mode == "compiled" or (mode == "auto" and device.type == "cuda" and _has_triton()):
        return _compiled()
    return logprob_and_lse, logits_grad


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class HeadLogprobs(torch.autograd.Function):
    """``log p(targets)`` of the linear ``head`` (no bias) over ``hidden`` ``[N, H]``, ``chunk``
    rows at a time. The head module is called for each chunk's logits (its hooks see them)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, head, chunk, fns):
        """Each chunk's logits, reduced to ``[N]`` float32 log-probs; keeps the log-sum-exps."""
        first, _ = fns
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)
        for i in range(0, hidden.shape[0], chunk):
            out[i:i + chunk], lse[i:i + chunk] = first(head(hidden[i:i + chunk]), targets[i:i + chunk])
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.head, ctx.chunk, ctx.fns = head, chunk, fns
        # the backward recomputes the logits as the forward made them (bf16 under autocast)
        ctx.device_type = hidden.device.type
        ctx.autocast = torch.is_autocast_enabled(ctx.device_type)
        ctx.autocast_dtype = torch.get_autocast_dtype(ctx.device_type)
        return out

    @staticmethod
    def backward(ctx, g):
        """Per chunk: recompute the logits, turn them into their gradient, then the two products."""
        hidden, weight, targets, lse = ctx.saved_tensors
        _, grad_fn = ctx.fns
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gh = torch.empty_like(hidden) if want_h else None
        # summed over chunks in float32: a bf16 sum of many chunks' products would lose bits
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        g = g.contiguous()
        with torch.autocast(ctx.device_type, dtype=ctx.autocast_dtype, enabled=ctx.autocast):
            for i in range(0, hidden.shape[0], ctx.chunk):
                h = hidden[i:i + ctx.chunk]
                d = grad_fn(ctx.head(h), lse[i:i + ctx.chunk], targets[i:i + ctx.chunk], g[i:i + ctx.chunk])
                if want_h:
                    gh[i:i + ctx.chunk] = d @ weight.to(d.dtype)
                if want_w and d.dtype == torch.float32:
                    gw.addmm_(d.t(), h.float())
                elif want_w:
                    gw += (d.t() @ h.to(d.dtype)).float()
        return gh, (gw.to(weight.dtype) if want_w else None), None, None, None, None


def head_logprobs(head: torch.nn.Linear, hidden: torch.Tensor, targets: torch.Tensor, chunk: int,
                  mode: str = "auto") -> torch.Tensor:
    """``[N]`` float32 log-probabilities of ``targets`` under ``head(hidden)``, ``chunk`` positions
    at a time, with the per-chunk kernels ``trainer.logprob_kernels = mode`` picks."""
    return HeadLogprobs.apply(hidden, head.weight, targets, head, chunk, kernels(hidden.device, mode))
