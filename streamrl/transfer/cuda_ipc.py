"""The ``cuda_ipc`` transfer: when the train and generate workers share a GPU (or a host), the
engine reads the new weights from the trainer's GPU memory, with no trip through host memory.

On the train worker the parameters are cast (bf16 by default) into one flat GPU buffer, and the
payload Dask carries is a few hundred bytes: torch's CUDA IPC handle of that buffer (what
``torch.multiprocessing`` sends between processes) and where each tensor lies in it. A generate
worker on the same host opens the handle, and the engine copies every parameter from the
mapped buffer, GPU to GPU. Before, the ``dask`` transfer copied the float32 weights to host
memory, into bytes, through a socket and back: seconds for a 0.5B model where a GPU copy takes
about a millisecond.

The train worker keeps its last ``keep`` buffers alive (an engine may load a version after the
next one was exported, and torch frees a buffer only once every process that opened it let go).

A generate worker that cannot open the handle -- it runs on another host, does not see the
trainer's GPU, or the weights are on the CPU -- gets the weights again as safetensors bytes from
the train worker (:class:`~streamrl.api.ReceiveMissed`, then :meth:`CudaIpcTransfer.resend`), so a
recipe that mixes placements still runs; the host path stays for CPU and across hosts.
"""

from __future__ import annotations

import inspect
import socket
from collections import OrderedDict
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from streamrl.api import ReceiveMissed, Transfer


class CudaIpcConfig(BaseModel):
    """The ``[transfer]`` table of ``name = "cuda_ipc"``."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    dtype: Literal["bfloat16", "as_trained"] = "bfloat16"
    """Dtype of the shared buffer: ``bfloat16``, what the ``hf`` engine decodes in on a GPU (half
    the bytes of float32 master weights); ``as_trained``: the trainer's own dtype (an engine that
    decodes in float32)."""
    keep: int = Field(2, ge=1)
    """Exported buffers the train worker keeps alive: the newest, and older ones an engine may
    still be loading (``run.max_staleness`` above 1 can want more)."""


def pack(weights: dict, dtype) -> tuple[object, list[tuple[str, tuple[int, ...], int, int]]]:
    """``weights`` cast to ``dtype`` and laid end to end in one flat buffer on their device:
    ``(buffer, [(name, shape, offset, numel)])``. ``dtype`` None: as trained -- the one dtype of
    them all, or, for a model of several (bfloat16 weights beside float32 norms), the one every
    one of them fits in exactly (each engine parameter takes its own dtype back on load)."""
    import functools

    import torch

    tensors = list(weights.items())
    # (the first tensor's dtype, as before: float32 norms after bfloat16 weights lost their bits)
    dtype = dtype or functools.reduce(torch.promote_types, {t.dtype for _, t in tensors})
    flat = torch.empty(sum(t.numel() for _, t in tensors), dtype=dtype, device=tensors[0][1].device)
    layout, offset = [], 0
    for name, t in tensors:
        flat[offset:offset + t.numel()].copy_(t.detach().reshape(-1))
        layout.append((name, tuple(t.shape), offset, t.numel()))
        offset += t.numel()
    return flat, layout


def unpack(flat, layout) -> dict:
    """The named views of a :func:`pack` buffer (no copy)."""
    return {name: flat[offset:offset + n].view(shape) for name, shape, offset, n in layout}


def gpu_uuid(index: int) -> str:
    """The physical identity of CUDA device ``index`` as this process numbers it."""
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


class CudaIpcTransfer(Transfer):
    """Weights handed over through CUDA IPC; bytes to a worker that cannot open the handle."""

    def __init__(self, config: CudaIpcConfig):
        self.config = config
        self._sent: OrderedDict[int, tuple[object, list]] = OrderedDict()  # version -> (buffer, layout)
        # the bytes of the newest version resent: every worker that cannot open the handle asks for
        # them (engines on another host, all of them at each version), and each copy is the model
        self._resent: tuple[int, bytes] | None = None

    def send(self, weights, version: int):
        """The IPC handle of the weights packed into one GPU buffer, or safetensors bytes when
        they are on the CPU (nothing to share); no weights (a simulated trainer), no bytes."""
        self._resent = None  # (a newer version: the older one's bytes go, a whole model's worth)
        if not weights:
            return b""
        import torch
        from torch.multiprocessing.reductions import reduce_tensor

        first = next(iter(weights.values()))
        if first.device.type != "cuda":  # nothing to share: the weights as they are (CPU engines decode float32)
            from streamrl.training.weights_bytes import weights_to_bytes

            return weights_to_bytes(weights)
        dtype = torch.bfloat16 if self.config.dtype == "bfloat16" and first.is_floating_point() else None
        flat, layout = pack(weights, dtype)
        torch.cuda.current_stream(flat.device).synchronize()  # the copy is done before anyone reads it
        self._sent[version] = (flat, layout)
        while len(self._sent) > self.config.keep:
            self._sent.popitem(last=False)  # torch frees it once every reader closed it
        rebuild, args = reduce_tensor(flat)
        return {"host": socket.gethostname(), "gpu": gpu_uuid(flat.device.index or 0), "handle": args,
                "layout": layout}

    def receive(self, payload, version: int) -> dict:
        """The weights as views of the trainer's buffer, opened on this worker (same host, a GPU
        it sees); bytes are read as they are. :class:`ReceiveMissed` when the handle cannot be
        opened here, so the train worker sends bytes instead."""
        if isinstance(payload, bytes):
            if not payload:
                return {}
            from streamrl.training.weights_bytes import weights_from_bytes

            return weights_from_bytes(payload)
        import torch
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        if payload["host"] != socket.gethostname():
            raise ReceiveMissed(f"cuda_ipc: weights v{version} are on host {payload['host']}, this worker runs on "
                                f"{socket.gethostname()}")
        local = [i for i in range(torch.cuda.device_count()) if gpu_uuid(i) == payload["gpu"]]
        if not local:
            raise ReceiveMissed(f"cuda_ipc: this worker does not see the trainer's GPU {payload['gpu']}")
        # the handle names the device as the train worker numbers it; this worker may number it otherwise
        bound = inspect.signature(rebuild_cuda_tensor).bind(*payload["handle"])
        bound.arguments["storage_device"] = local[0]
        try:
            flat = rebuild_cuda_tensor(*bound.args)
        except RuntimeError as exc:
            raise ReceiveMissed(f"cuda_ipc: could not open the handle of weights v{version}: {exc}") from None
        return unpack(flat, payload["layout"])

    def resend(self, version: int) -> tuple[bytes, int]:
        """The newest weights sent, as safetensors bytes, for a worker that cannot open the handle."""
        if not self._sent:
            raise RuntimeError("cuda_ipc: nothing was sent through CUDA IPC, so nothing can be sent again")
        newest = max(self._sent)
        if self._resent is None or self._resent[0] != newest:
            self._resent = (newest, self._bytes(*self._sent[newest]))
        return self._resent[1], newest

    @staticmethod
    def _bytes(flat, layout) -> bytes:
        from streamrl.training.weights_bytes import weights_to_bytes

        return weights_to_bytes(unpack(flat, layout))
