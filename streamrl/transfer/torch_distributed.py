"""The ``torch_distributed`` transfer: a collective broadcast from the train worker to every
generate worker, so the weights never pass through Dask.

Each publication gets its own small process group (a ``TCPStore`` on the train worker at a fresh
port, then ``ProcessGroupGloo`` over the train worker and the ``receivers`` generate workers):
``send`` snapshots the weights, opens the store and returns at once with a token (address,
bucket layout) that Dask carries to the loads; a background thread broadcasts the weights in
buckets of ``bucket_mb`` while each generate worker's ``receive`` joins the group and fills its
buffers. A group per version keeps no state between publications, so a generate worker restarted
in between simply joins the next one. Every collective has ``timeout_s``: a receiver that never
comes (a dead worker) fails the others' loads with one line, never a hang.

The store and gloo's sockets listen on the interface of the worker's Dask address only (127.0.0.1
on the embedded cluster), as the train pool's group does (``training/data_parallel.py``).

Gloo carries CPU tensors; a CUDA deployment would use NCCL the same way.
"""

from __future__ import annotations

import datetime
import logging
import threading

from pydantic import BaseModel, ConfigDict, Field

from streamrl.api import Transfer

log = logging.getLogger(__name__)


class TorchDistributedConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    bucket_mb: float = Field(64.0, gt=0)
    """Megabytes per broadcast: fewer collectives against a bounded extra buffer."""
    timeout_s: float = Field(120.0, gt=0)
    """Seconds every member waits for the others (group set-up and each broadcast)."""


def _buckets(layout: list[tuple[str, list[int], str]], bucket_bytes: float) -> list[list[int]]:
    """Indices of ``layout`` entries grouped into buckets of about ``bucket_bytes`` (same dtype)."""
    import torch

    out, current, size, dtype = [], [], 0, None
    for i, (_, shape, dt) in enumerate(layout):
        n = torch.Size(shape).numel() * torch.empty(0, dtype=getattr(torch, dt)).element_size()
        if current and (size + n > bucket_bytes or dt != dtype):
            out.append(current)
            current, size = [], 0
        current.append(i)
        size, dtype = size + n, dt
    if current:
        out.append(current)
    return out


def _host() -> str:
    """The interface this Dask worker listens on (the group meets where Dask already talks)."""
    from streamrl.training.data_parallel import own_host

    return own_host()


class TorchDistributedTransfer(Transfer):
    """Weights broadcast over a gloo process group per version."""

    def __init__(self, config: TorchDistributedConfig):
        self.config = config

    def _group(self, store, rank: int, world: int):
        import torch.distributed as dist

        # gloo's own sockets on this worker's interface: by default gloo listens on whatever the
        # machine's host name resolves to, which may be reachable from outside the machine
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=_host())]
        options._timeout = datetime.timedelta(seconds=self.config.timeout_s)
        return dist.ProcessGroupGloo(store, rank, world, options)

    def send(self, weights, version: int) -> dict:
        """Snapshot the weights, open this version's group and broadcast in the background;
        returns the token the generate workers need."""
        if not weights:
            return {}
        import torch
        import torch.distributed as dist

        from streamrl.training.data_parallel import listen

        names = list(weights)
        snapshot = [weights[n].detach().to("cpu").clone() for n in names]  # the trainer may step on
        layout = [(n, list(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in zip(names, snapshot)]
        world = 1 + self.receivers
        host = _host()
        listener = listen(host)  # (torch's store would listen on every interface, not only host's)
        port = listener.getsockname()[1]
        store = dist.TCPStore(host, port, world, True, timeout=datetime.timedelta(seconds=self.config.timeout_s),
                              wait_for_workers=False, master_listen_fd=listener.detach())

        def broadcast():
            try:
                group = self._group(store, 0, world)
                for idx in _buckets(layout, self.config.bucket_mb * 2**20):
                    flat = torch.cat([snapshot[i].reshape(-1) for i in idx])
                    opts = dist.BroadcastOptions()
                    opts.rootRank = 0
                    group.broadcast([flat], opts).wait()
            except Exception as exc:  # the receivers fail with their own timeout and say so
                log.warning("torch_distributed transfer: version %s not sent: %s", version, exc)

        threading.Thread(target=broadcast, name=f"streamrl-broadcast-v{version}", daemon=True).start()
        return {"address": f"{host}:{port}", "world": world, "layout": layout}

    def receive(self, payload: dict, version: int) -> dict:
        """Join this version's group and receive every bucket; returns the named tensors."""
        if not payload:
            return {}
        import torch
        import torch.distributed as dist

        host, port = payload["address"].rsplit(":", 1)
        timeout = datetime.timedelta(seconds=self.config.timeout_s)
        try:
            store = dist.TCPStore(host, int(port), payload["world"], False, timeout=timeout)
            rank = int(store.add("streamrl-next-rank", 1))  # 1 .. receivers, in arrival order
            group = self._group(store, rank, payload["world"])
            layout, out = payload["layout"], {}
            for idx in _buckets(layout, self.config.bucket_mb * 2**20):
                dtype = getattr(torch, layout[idx[0]][2])
                shapes = [torch.Size(layout[i][1]) for i in idx]
                flat = torch.empty(sum(s.numel() for s in shapes), dtype=dtype)
                opts = dist.BroadcastOptions()
                opts.rootRank = 0
                group.broadcast([flat], opts).wait()
                offset = 0
                for i, shape in zip(idx, shapes):
                    out[layout[i][0]] = flat[offset:offset + shape.numel()].view(shape)
                    offset += shape.numel()
            return out
        except Exception as exc:
            raise RuntimeError(f"torch_distributed transfer: version {version} from {payload['address']} "
                               f"not received within {self.config.timeout_s:.0f} s ({type(exc).__name__}); "
                               "is every generate worker alive?") from None
