"""How the train pool holds the policy (``trainer.strategy``), as an object the trainer is
composed with, chosen once when the trainer is built.

:class:`Replicated` is one worker, or ``ddp``: every rank holds the whole model, and over a
train pool of several ranks the gradients are summed at the optimizer step
(``training/data_parallel.py``). The train pool's process group is joined after the trainer is
built, so the two are one object: a group of one is one worker.
:class:`~streamrl.training.fsdp.FSDP` shards parameters, gradients and optimizer state over the
ranks (``training/fsdp.py``).
"""

from __future__ import annotations

from typing import Callable

import torch

from streamrl.training import data_parallel as dp
from streamrl.training.precision import PolicyWeights, Precision


class Strategy:
    """What the trainer asks of its strategy (:class:`Replicated`, ``fsdp.FSDP``)."""

    def build_device(self, device: str) -> str:
        """Where the models are built, before training starts."""
        raise NotImplementedError

    def masters(self, precision: Precision, model: torch.nn.Module) -> PolicyWeights:
        """The weights AdamW steps for the policy ``model``."""
        raise NotImplementedError

    def shard(self, units: list[tuple[torch.nn.Module, torch.dtype | None]], model: torch.nn.Module) -> None:
        """Split each ``(module, compute dtype)`` over the ranks (``model``: the policy); every
        rank together, once the group is joined."""
        raise NotImplementedError

    def reduce_gradients(self, modules: list[torch.nn.Module]) -> None:
        """Before the optimizer step: make each rank's gradients of ``modules`` the whole pool's."""
        raise NotImplementedError

    def whole(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` whole on this rank."""
        raise NotImplementedError

    def clip_grad_norm(self, params, max_norm: float) -> float:
        """Clip the gradients of ``params`` to ``max_norm`` (0: no clipping); their norm before,
        the whole pool's (measured without clipping too: a norm that is not finite stops the step)."""
        if max_norm <= 0:
            grads = [p.grad for p in params if p.grad is not None]
            return float(self.whole(torch.nn.utils.get_total_norm(grads))) if grads else 0.0
        return float(self.whole(torch.nn.utils.clip_grad_norm_(params, max_norm)))

    def any_rank(self, flag: bool, device: str) -> bool:
        """Whether ``flag`` holds on any rank of the train pool, so that every rank takes the
        same decision (a collective over a group of several: every rank calls it)."""
        return dp.any_rank(flag, device)

    def without_gradient(self, empty_pass: Callable[[], object], params) -> None:
        """A micro-batch with nothing to back-propagate: make the optimizer step as on a zero
        gradient. ``empty_pass`` runs a zero-loss forward/backward; ``params``: the policy's."""
        raise NotImplementedError

    def weights_changed(self, model: torch.nn.Module) -> None:
        """After an optimizer step or a checkpoint load of the policy ``model``, every rank together."""
        raise NotImplementedError

    def forward_only_done(self, module: torch.nn.Module) -> None:
        """After a forward pass of ``module`` that no backward follows (a check of the weights):
        let go of whatever it gathered."""
        raise NotImplementedError

    def named_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The policy's parameters as the engines receive them."""
        raise NotImplementedError

    def alone(self, what: str) -> None:
        """Before a forward pass on this rank alone: refuse ``what`` where it cannot run so."""
        raise NotImplementedError

    def full_state(self, module: torch.nn.Module) -> dict | None:
        """``module``'s whole state for a saved model folder, every rank together; None: the
        module's own ``state_dict()``."""
        raise NotImplementedError

    @property
    def writes(self) -> bool:
        """This rank writes the saved model folder."""
        raise NotImplementedError


class Replicated(Strategy):
    """One worker, or ``ddp``: whole replicas whose gradients are summed over the train pool."""

    def build_device(self, device: str) -> str:
        """The worker's device."""
        return device

    def masters(self, precision: Precision, model: torch.nn.Module) -> PolicyWeights:
        """As ``precision`` keeps them (bf16-params: a float32 master copy)."""
        return precision.masters(model)

    def shard(self, units, model) -> None:
        """Refused: a trainer is sharded only when it was built to be (``context.sharded``)."""
        raise RuntimeError("trainer: built without context.sharded, it cannot be sharded")

    def reduce_gradients(self, modules: list[torch.nn.Module]) -> None:
        """Sum every gradient over the ranks, so that every rank applies the one-worker update
        and the replicas stay identical."""
        if dp.world_size() > 1:  # (one worker: no group to sum over)
            for m in modules:
                dp.all_reduce_gradients(m.parameters())

    def whole(self, t: torch.Tensor) -> torch.Tensor:
        """``t``: nothing is sharded."""
        return t

    def without_gradient(self, empty_pass, params) -> None:
        """Gradients that are still None become zeros, so the optimizer steps as it would on a
        zero gradient (AdamW skips a parameter whose grad is None: no momentum decay, no weight
        decay -- a different update). No pass: skipping it is the point."""
        for p in params:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)

    def weights_changed(self, model: torch.nn.Module) -> None:
        """Nothing to do: the policy is exported as it is."""

    def forward_only_done(self, module: torch.nn.Module) -> None:
        """Nothing to do: nothing was gathered."""

    @torch.no_grad()
    def named_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The parameters, detached (tied weights once, as ``named_parameters`` gives them)."""
        return {n: p.detach() for n, p in model.named_parameters()}

    def alone(self, what: str) -> None:
        """Anything runs alone."""

    def full_state(self, module: torch.nn.Module) -> dict | None:
        """None: the module's own state is whole."""
        return None

    @property
    def writes(self) -> bool:
        """True: only one rank is asked to write (``Topology.writers``)."""
        return True
