"""Data-parallel training over the train pool: one ``torch.distributed`` process group of the
train workers (gloo on CPU, NCCL on CUDA), gradients summed at the optimizer step.

Each rank runs forward/backward on the micro-batches Dask gives it, every loss already scaled by
1 / (samples in the whole step), so the *sum* of the ranks' accumulated gradients is exactly the
one-worker gradient. At the optimizer step every rank all-reduces (sums) its gradients, then
clips and steps: all ranks apply the same update and stay identical, as DDP keeps them. DDP's
module wrapper is not used because it synchronises inside backward, once per micro-batch, and
requires every rank to run the same number of them; in a streamed step a rank may train three
groups while another trains none. A rank that trained nothing contributes zeros.

Every socket of the group listens on the interface the train workers' Dask addresses are on
(127.0.0.1 on the embedded cluster), never on all of them: rank 0's store is handed a socket bound
there (:func:`listen`; a ``TCPStore`` opened by torch's ``tcp://`` rendezvous listens on every
interface, and anyone who reaches it can write the group's keys), and gloo's own sockets (NCCL's
too) are bound to that interface by name (:func:`bind_collectives_to`).
"""

from __future__ import annotations

import datetime
import socket

import torch

#: Bytes per all-reduce bucket: few collectives, bounded extra memory.
BUCKET_BYTES = 32 * 2**20


_RESERVED: dict[str, socket.socket] = {}
"""``host:port`` -> the listening socket :func:`free_address` opened there, for rank 0's store."""


def listen(host: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on ``host`` (one interface) at ``port`` (0: any free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host.strip("[]"), port), family=family, backlog=1024)


def free_address(host: str) -> str:
    """``host:port`` for rank 0's rendezvous, with a socket already listening there that rank 0's
    :func:`join` hands to its store: no other process can take the port in between, and the
    store listens on ``host`` alone. Sockets reserved earlier and never used are closed."""
    for old in _RESERVED.values():
        old.close()
    _RESERVED.clear()
    s = listen(host)
    address = f"{host}:{s.getsockname()[1]}"
    _RESERVED[address] = s
    return address


def store(host: str, port: int, rank: int, world: int, timeout: datetime.timedelta, listener=None):
    """The group's ``TCPStore``: rank 0 serves it on ``listener`` (a socket listening on
    ``host``, opened now if None; the store owns it from here on), the others connect."""
    import torch.distributed as dist

    if rank != 0:
        return dist.TCPStore(host, port, world, False, timeout=timeout)
    listener = listener or listen(host, port)
    # (master_listen_fd: torch's store would otherwise bind the port on every interface)
    return dist.TCPStore(host, port, world, True, timeout=timeout, master_listen_fd=listener.detach())


def interface_of(host: str) -> str | None:
    """The name of the network interface that holds address ``host`` (``lo`` for 127.0.0.1), or
    None when none does (a host name that does not resolve to one of this machine's addresses)."""
    import psutil

    try:
        wanted = {info[4][0] for info in socket.getaddrinfo(host.strip("[]"), None)}
    except OSError:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%", 1)[0] in wanted for a in addresses):
            return name
    return None


def own_host() -> str:
    """The interface this Dask worker listens on (127.0.0.1 outside a worker): where its process
    groups listen too, since that is where the pool already talks."""
    try:
        from distributed import get_worker

        return get_worker().address.split("://", 1)[-1].rsplit(":", 1)[0]
    except ValueError:  # not inside a worker (tests)
        return "127.0.0.1"


def bind_collectives_to(host: str, backend: str) -> None:
    """Make gloo (and NCCL, when the backend has it) listen on the interface of ``host`` only.
    Left to themselves they pick the address the machine's host name resolves to (gloo) or the
    first non-loopback interface (NCCL): on the embedded cluster that is a socket reachable
    from outside the machine. A choice the user made (``GLOO_SOCKET_IFNAME``,
    ``NCCL_SOCKET_IFNAME``) stands."""
    import os

    name = interface_of(host)
    if name is None:
        return
    os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
    if "nccl" in backend:
        os.environ.setdefault("NCCL_SOCKET_IFNAME", name)


def join(rank: int, world: int, address: str, timeout_s: float, backend: str | None = None) -> None:
    """Join the train pool's process group, leaving any earlier one first (every rank joins
    anew at a fresh address, rank 0's from :func:`free_address` on its own worker); ``world = 1``
    only leaves. ``backend`` None: gloo for CPU tensors, plus NCCL for CUDA tensors where CUDA
    is available (one group serves both)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    if world == 1:
        return
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    host, port = address.rsplit(":", 1)
    bind_collectives_to(own_host(), backend)  # (each rank on its own interface; rank 0's is host)
    timeout = datetime.timedelta(seconds=timeout_s)
    group_store = store(host, int(port), rank, world, timeout, _RESERVED.pop(address, None) if rank == 0 else None)
    dist.init_process_group(backend, store=group_store, rank=rank, world_size=world, timeout=timeout)


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
