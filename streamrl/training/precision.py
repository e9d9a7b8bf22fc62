"""The trainer's precision (``trainer.precision``), as an object the trainer is composed with:
how forward passes compute (:meth:`Precision.autocast`), which weights AdamW steps
(:meth:`Precision.masters`) and in what dtype FSDP gathers sharded weights
(:attr:`Precision.compute_dtype`).

``fp32``: everything in float32. ``bf16-autocast``: float32 weights and AdamW state, matmuls
in bfloat16 under ``torch.autocast``. ``bf16-params``: bf16 weights with float32 master weights.

bf16-params: the policy the forward and backward passes run is bfloat16: its weights, activations
and gradients, with no per-matmul cast of float32 weights (what ``torch.autocast`` does on every
forward). A float32 copy of every weight (the *master* weights) is what AdamW steps, with float32
moments, and what a checkpoint holds: an update of ``lr`` ~1e-6 on a weight of ~0.02 is below
bfloat16's resolution there (8 bits of mantissa: ~8e-5), so applied to bf16 weights directly it
would be lost. After each micro-batch the bf16 gradients are added into float32 ones (many
micro-batches would lose precision summed in bf16); after each optimizer step the master weights
are rounded into the bf16 policy.

Memory per parameter, against ``bf16-autocast`` (float32 weights and gradients, 16 bytes with
AdamW's two moments): 2 (bf16 weights) + 4 (master) + 4 (float32 gradient) + 8 (moments) = 18
bytes at the optimizer step, the bf16 gradient (2) freed as it is accumulated. What it saves is
time (no weight casts, bf16 gradients in the backward), and the reference model, which is
only ever run, is kept in bf16 (2 bytes per parameter instead of 4).

Sharded (``trainer.strategy = "fsdp"``) the same split is FSDP's own mixed precision: float32
sharded parameters (the masters) gathered as :attr:`Precision.compute_dtype` for compute,
gradients reduced in float32 (``training/fsdp.py``); :class:`MasterWeights` is not used there.
"""

from __future__ import annotations

import contextlib
import copy

import torch


class PolicyWeights:
    """The weights AdamW steps when they are the policy's own (float32): nothing to move
    between two copies. :class:`MasterWeights` is the two-copy kind."""

    def __init__(self, model: torch.nn.Module):
        self.module = model
        """The module whose parameters AdamW steps and checkpoints hold."""

    def accumulate(self) -> None:
        """After a micro-batch: move the policy's gradients to :attr:`module` (here, they are)."""

    def copy_back(self) -> None:
        """After a step or a checkpoint load: bring the policy to :attr:`module` (here, it is)."""


class MasterWeights(PolicyWeights):
    """The float32 master copy of a policy that is turned to bfloat16 here."""

    def __init__(self, model: torch.nn.Module):
        super().__init__(copy.deepcopy(model))  # float32: what AdamW steps and checkpoints hold
        model.to(torch.bfloat16)
        # parameters() yields tied weights once, in the same order for the model and its copy
        self.pairs = list(zip(model.parameters(), self.module.parameters()))

    def accumulate(self) -> None:
        """Move the policy's bf16 gradients into the master weights' float32 ones (summed)."""
        for p, m in self.pairs:
            if p.grad is None:
                continue
            g = p.grad.float()
            m.grad = g if m.grad is None else m.grad.add_(g)
            p.grad = None

    @torch.no_grad()
    def copy_back(self) -> None:
        """Round the master weights into the bf16 policy (after a step, or a checkpoint load)."""
        for p, m in self.pairs:
            p.copy_(m)


class Precision:
    """``fp32``: float32 weights, gradients, AdamW state and compute. The base of the others."""

    name = "fp32"
    """The ``trainer.precision`` this object implements (``auto`` resolved)."""
    compute_dtype: torch.dtype | None = None
    """The dtype the policy's weights compute in when it is not their own (float32): FSDP
    gathers its float32 shards in it (``bf16-params``)."""

    def __init__(self, device: str):
        self.device_type = torch.device(device).type

    def autocast(self):
        """The context forward passes run in."""
        return contextlib.nullcontext()

    def masters(self, model: torch.nn.Module) -> PolicyWeights:
        """The weights AdamW steps for the (unsharded) policy ``model``, which this may turn to
        another dtype."""
        return PolicyWeights(model)


class BF16Autocast(Precision):
    """``bf16-autocast``: float32 weights and AdamW state, forward/backward matmuls in bfloat16
    (``torch.autocast``); log-softmax stays float32."""

    name = "bf16-autocast"

    def autocast(self):
        """bf16 autocast on the trainer's device."""
        return torch.autocast(self.device_type, dtype=torch.bfloat16)


class BF16Params(BF16Autocast):
    """``bf16-params``: the policy in bfloat16, float32 master weights beside it (see the module
    docstring). Forward passes still run under bf16 autocast: the float32 critic computes in bf16 too."""

    name = "bf16-params"
    compute_dtype = torch.bfloat16

    def masters(self, model: torch.nn.Module) -> PolicyWeights:
        """A float32 master copy; ``model`` becomes bfloat16."""
        return MasterWeights(model)


PRECISIONS = {p.name: p for p in (Precision, BF16Autocast, BF16Params)}


def precision_for(name: str, device: str) -> Precision:
    """The precision ``trainer.precision = name`` asks for on ``device``; ``auto`` is
    bf16-params on a GPU (no float32 weight cast at every forward, the engine's own bf16 weights,
    less memory: faster than bf16-autocast in docs/benchmarks.md) and fp32 on the CPU (where bf16
    matmuls are slow)."""
    if name == "auto":
        name = "bf16-params" if device == "cuda" else "fp32"
    return PRECISIONS[name](device)
