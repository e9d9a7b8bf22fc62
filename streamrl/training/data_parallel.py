"""Data-parallel training over the train pool: one ``torch.distributed`` process group of the
train workers (gloo on CPU, NCCL on CUDA), gradients summed at the optimizer step.

Each rank runs forward/backward on the micro-batches Dask gives it, every loss already scaled by
1 / (samples in the whole step), so the *sum* of the ranks' accumulated gradients is exactly the
one-worker gradient. At the optimizer step every rank all-reduces (sums) its gradients, then
clips and steps: all ranks apply the same update and stay identical, as DDP keeps them. DDP's
module wrapper is not used because it synchronises inside backward, once per micro-batch, and
requires every rank to run the same number of them; in a streamed step a rank may train three
groups while another trains none. A rank that trained nothing contributes zeros.
"""

from __future__ import annotations

import datetime
import socket

import torch

#: Bytes per all-reduce bucket: few collectives, bounded extra memory.
BUCKET_BYTES = 32 * 2**20


def free_address(host: str) -> str:
    """``host:port`` with a port free on this machine now, for rank 0's rendezvous."""
    with socket.socket() as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"


def join(rank: int, world: int, address: str, timeout_s: float, backend: str | None = None) -> None:
    """Join the train pool's process group, leaving any earlier one first (every rank joins
    anew at a fresh address); ``world = 1`` only leaves. ``backend`` None: gloo for CPU tensors,
    plus NCCL for CUDA tensors where CUDA is available (one group serves both)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    if world == 1:
        return
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def world_size() -> int:
    """Ranks in the train pool's group (1 when there is none)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def any_rank(flag: bool, device: str) -> bool:
    """``flag`` of any rank (a collective on every rank of a group; ``flag`` itself without one).
    ``device``: where the group's backend takes tensors (gloo: CPU, NCCL: CUDA)."""
    if world_size() == 1:
        return flag
    import torch.distributed as dist

    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


@torch.no_grad()
def all_reduce_gradients(params) -> None:
    """Sum every parameter's gradient over the ranks, in place. A rank that has no gradient for
    a parameter contributes 0; a parameter no rank has a gradient for keeps none (so the
    optimizer skips it, as it would on one worker)."""
    import torch.distributed as dist

    params = [p for p in params if p.requires_grad]
    if not params:
        return
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=params[0].device)
    dist.all_reduce(has, op=dist.ReduceOp.SUM)
    params = [p for p, n in zip(params, has.tolist()) if n > 0]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    bucket, size = [], 0
    for p in params:
        bucket.append(p)
        size += p.grad.numel() * p.grad.element_size()
        if size >= BUCKET_BYTES:
            _reduce(bucket, dist)
            bucket, size = [], 0
    if bucket:
        _reduce(bucket, dist)


def _reduce(bucket, dist) -> None:
    flat = torch.cat([p.grad.reshape(-1) for p in bucket])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for p in bucket:
        n = p.grad.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
        offset += n
