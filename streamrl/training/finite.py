"""Nothing that is not finite gets past an optimizer step.

A loss or gradient norm that is not finite (NaN or inf) is no update: the step raises
:class:`~streamrl.errors.NonFiniteStep`, or is skipped while ``trainer.max_nonfinite_steps``
allows. The answer is the same on every rank of the train pool (``Strategy.any_rank``), so the
ranks apply or skip an update together. After an update the trainer also checks the weights
(:func:`all_finite`), how far the update moved them (:func:`weight_norm`: an update that changes
their norm by more than ``trainer.max_weight_change`` of it is finite but ruinous) and the new
policy's log-probabilities of one sample before the weights can be exported or checkpointed.
"""

from __future__ import annotations

import math

import torch

from streamrl.errors import NonFiniteStep


class FiniteGuard:
    """One trainer's record of what was not finite in the step it is taking, and how many steps
    in a row were skipped for it."""

    def __init__(self, allowed: int):
        """``allowed``: ``trainer.max_nonfinite_steps``, the steps in a row that may be skipped."""
        self.allowed = allowed
        self.loss: str | None = None
        """A loss of this step's micro-batches on this rank that was not finite (its value), or None."""
        self.in_a_row = 0
        """Optimizer steps skipped in a row for a non-finite loss or gradient."""

    def saw_losses(self, *values: float) -> None:
        """Remember the first loss of this step that is not finite: a NaN loss whose gradient
        happens to be finite (a detached term) would otherwise pass the gradient-norm check."""
        for value in values:
            if not math.isfinite(value) and self.loss is None:
                self.loss = str(value)

    def problem(self, strategy, device: str, norm: float, critic_norm: float) -> str | None:
        """What was not finite in this step (the same answer on every rank), or None; forgets
        this step's loss."""
        local, self.loss = self.loss, None
        # (the norms are the whole pool's already; a loss is one rank's)
        if strategy.any_rank(local is not None, device):
            return f"the loss is not finite ({local or 'on another rank'})"
        if not math.isfinite(norm):
            return f"the gradient is not finite (norm {norm})"
        if not math.isfinite(critic_norm):
            return f"the critic's gradient is not finite (norm {critic_norm})"
        return None

    def refuse(self, problem: str, step: str, lr: float, algorithm: str) -> None:
        """A step whose loss or gradient is not finite: raise :class:`NonFiniteStep` naming
        ``step``, unless ``max_nonfinite_steps`` lets it be skipped (the caller then clears the
        gradients)."""
        self.in_a_row += 1
        if self.in_a_row <= self.allowed:
            return
        in_a_row = (f" ({self.in_a_row} steps in a row; trainer.max_nonfinite_steps = {self.allowed})"
                    if self.allowed else "")
        raise NonFiniteStep(f"{step}: {problem}{in_a_row}, so the update was not applied and nothing of "
                            f"this step was published or checkpointed; lower trainer.lr (now {lr:g}) "
                            f"or check the algorithm ({algorithm})")

    def applied(self) -> None:
        """An update was applied: the count of skips in a row starts again."""
        self.in_a_row = 0


@torch.no_grad()
def all_finite(params) -> bool:
    """Every value of ``params`` is finite (a shard: its local part)."""
    from torch.distributed.tensor import DTensor

    checks = [torch.isfinite(p.to_local() if isinstance(p, DTensor) else p).all() for p in params]
    return bool(torch.stack(checks).all()) if checks else True


@torch.no_grad()
def weight_norm(params) -> float:
    """The float32 norm of ``params`` (a shard: its local part), for the size of an update."""
    from torch.distributed.tensor import DTensor

    local = [(p.to_local() if isinstance(p, DTensor) else p).detach() for p in params]
    if not local:
        return 0.0
    # (one fused kernel per dtype and device for the per-tensor norms, in float32)
    norms = torch._foreach_norm(local, 2, dtype=torch.float32)
    return float(torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms])))
