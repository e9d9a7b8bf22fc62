"""bf16 weights with float32 master weights (``trainer.precision = "bf16-params"``).

The policy the forward and backward passes run is bfloat16: its weights, activations and
gradients, with no per-matmul cast of float32 weights (what ``torch.autocast`` does on every
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
sharded parameters (the masters) gathered as bf16 for compute, gradients reduced in float32
(``training/fsdp.py``); this class is not used there.
"""

from __future__ import annotations

import copy

import torch


class MasterWeights:
    """The float32 master copy of a policy that is turned to bfloat16 here."""

    def __init__(self, model: torch.nn.Module):
        self.module = copy.deepcopy(model)  # float32: what AdamW steps and checkpoints hold
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
