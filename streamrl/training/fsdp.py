"""Fully sharded data parallel (``trainer.strategy = "fsdp"``): parameters, gradients and
optimizer state split over the train pool's ranks with FSDP2's ``fully_shard``, for models whose
training state does not fit one device.

Each decoder layer is its own FSDP unit (its full weights exist only while it runs), then the
whole model. Unlike ``ddp`` (``training/data_parallel.py``), every forward and backward is a
collective: all ranks must run the same number of passes, in the same order. streamrl pairs the
ranks' train tasks in rounds and pads a rank that has less to do with an empty pass (a zero
loss through every module), so a streamed step still works.

Gradients are *summed* over the ranks, not averaged: each rank's loss is already scaled by
1 / (samples in the whole step), so the sum is exactly the one-worker gradient.

:class:`FSDP` is the trainer's strategy (``training/strategy.py``) made of these pieces.
"""

from __future__ import annotations

import torch

from streamrl.training.precision import PolicyWeights, Precision
from streamrl.training.strategy import Strategy


def shard(module: torch.nn.Module, device: str, param_dtype: torch.dtype | None = None) -> None:
    """Shard ``module`` in place over the default process group: each transformer block (the
    classes transformers names in ``_no_split_modules``) as one unit, then the rest.
    ``param_dtype`` (bf16-params): the float32 shards are gathered in this dtype for compute and
    gradients are reduced in float32 -- the shards stay the float32 master weights."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else MixedPrecisionPolicy()
    blocks = set()
    for m in module.modules():
        blocks |= set(getattr(m, "_no_split_modules", None) or [])
    for m in list(module.modules()):
        if m is not module and type(m).__name__ in blocks:
            fully_shard(m, mesh=mesh, mp_policy=mp)
    fully_shard(module, mesh=mesh, mp_policy=mp)
    for m in module.modules():
        if isinstance(m, FSDPModule):
            # sum, not mean; and with SUM alone (gloo has no pre-multiplied sum)
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


def full(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor (DTensor) gathered whole -- a collective on every rank -- or ``t``."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


@torch.no_grad()
def full_weights(model: torch.nn.Module, keep: bool) -> dict[str, torch.Tensor] | None:
    """Every parameter gathered whole onto the CPU (a collective: every rank calls it); returned
    where ``keep`` (rank 0, which exports), else dropped as it arrives."""
    out = {}
    for name, p in model.named_parameters():
        t = full(p.detach()).to("cpu")  # (gathered into a fresh tensor: no copy needed on the CPU)
        if keep:
            out[name] = t
    return out if keep else None


def agree_passes(n: int, device: str) -> int:
    """The most forward/backward passes any rank has in this round (a collective)."""
    import torch.distributed as dist

    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def is_rank0() -> bool:
    """True on rank 0 of the train pool's group (or without a group)."""
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


class FSDP(Strategy):
    """``trainer.strategy = "fsdp"``: the trainer's strategy (``training/strategy.py``) from its
    build, on every rank; :meth:`shard` splits the models once the process group is joined.
    Rank 0 keeps the whole policy weights, gathered at each step, for the engines."""

    def __init__(self, device: str):
        self.device = device
        self.full: dict[str, torch.Tensor] | None = None
        """The whole weights on rank 0, gathered at the last step (None elsewhere)."""

    def build_device(self, device: str) -> str:
        """The CPU: each rank's shard goes to the device in :meth:`shard`, so a model that does
        not fit one device can still be built."""
        return "cpu"

    def masters(self, precision: Precision, model: torch.nn.Module) -> PolicyWeights:
        """The policy itself: its float32 shards are the masters, gathered for compute in
        ``precision.compute_dtype`` (FSDP's mixed precision) -- no second copy."""
        return PolicyWeights(model)

    def shard(self, units: list[tuple[torch.nn.Module, torch.dtype | None]], model: torch.nn.Module) -> None:
        """:func:`shard` each module, then gather the policy's whole weights for the first export."""
        for module, dtype in units:
            shard(module, self.device, param_dtype=dtype)
        self.full = full_weights(model, keep=is_rank0())

    def reduce_gradients(self, modules: list[torch.nn.Module]) -> None:
        """Nothing: gradients were summed over the ranks in each backward."""

    def whole(self, t: torch.Tensor) -> torch.Tensor:
        """:func:`full` (a collective)."""
        return full(t)

    def without_gradient(self, empty_pass, params) -> None:
        """The zero-loss pass: every rank must take part in the others' collectives."""
        empty_pass()

    def weights_changed(self, model: torch.nn.Module) -> None:
        """Gather the whole weights now, while every rank is here: rank 0 exports them later."""
        self.full = None  # (the last version's copy goes first: one whole copy at a time)
        self.full = full_weights(model, keep=is_rank0())

    def forward_only_done(self, module: torch.nn.Module) -> None:
        """Reshard every unit of ``module``: FSDP keeps the root's weights gathered after a
        forward pass, for the backward it expects, and none comes."""
        from torch.distributed.fsdp import FSDPModule

        for m in module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def named_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole weights gathered at the last step, on rank 0."""
        if self.full is None:
            raise RuntimeError("trainer: with trainer.strategy = 'fsdp' only rank 0 holds the whole weights")
        return self.full

    def alone(self, what: str) -> None:
        """Refused: a forward on one rank alone would wait for the others for ever."""
        raise RuntimeError(f"trainer: {what} with trainer.strategy = 'fsdp'")

    def full_state(self, module: torch.nn.Module) -> dict | None:
        """The whole state gathered onto rank 0's CPU (a collective)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    @property
    def writes(self) -> bool:
        """Rank 0 writes."""
        return is_rank0()
