"""Weights as bytes: named tensors in the safetensors format, for what carries a policy's
weights as one blob (the ``dask`` transfer, the export a restarted engine catches up from).
safetensors keeps any dtype (bfloat16 included) and loads without unpickling anything."""

from __future__ import annotations

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors


def weights_to_bytes(named: dict[str, torch.Tensor]) -> bytes:
    """Named tensors as safetensors bytes (any dtype; copied to the CPU first)."""
    return save_safetensors({n: t.detach().to("cpu").contiguous() for n, t in named.items()})


def weights_from_bytes(blob: bytes) -> dict[str, torch.Tensor]:
    """Inverse of :func:`weights_to_bytes`."""
    return load_safetensors(blob)
