"""The ``dask`` transfer: weights travel as safetensors bytes through Dask itself.

On the train worker the parameters become one safetensors blob (the ``export-weights-<v>``
task's result); Dask moves the bytes to every generate worker (``load-weights-<v>-<worker>``),
worker to worker, so the ``streamrl`` process never holds them. Safetensors bytes carry any
dtype, so bf16 weights work where bf16 tensors would not pickle through Dask, and CUDA tensors
never cross. Good on one machine or a fast network; a collective broadcast is the GPU-cluster
alternative.

Across a slow link (generate workers in another datacenter) two options make a publication
cheaper: ``relay`` (the payload crosses once per site and the site's other generate workers take
it from the one that received it, ``flow/weights.publish``) and ``wire_dtype = "bfloat16"``
(half the bytes of fp32 weights; the receiver casts them back).
"""

from __future__ import annotations

import json
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator

from streamrl.api import Transfer


class DaskTransferConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    relay: bool = False
    """Fan the weights out within each site: one generate worker per site (the first of the site
    that is in the pool) fetches the payload from the train worker, and the site's other generate
    workers fetch it from that one, so it crosses the link between the pools once per site and
    step instead of once per generate worker. Worth it when the generate workers sit behind a
    slower link than the one between them (another datacenter); on one machine it only adds a
    hop. False: every generate worker fetches from the train worker (Dask's default)."""
    sites: list[list[str]] = []
    """With ``relay``: the generate workers by site, e.g. ``[["generate-0", "generate-1"],
    ["generate-2", "generate-3"]]``. Empty: the whole generate pool is one site. A generate
    worker named in no site (one an elastic pool added) fetches from the train worker itself."""
    wire_dtype: Literal["as_trained", "bfloat16"] = "as_trained"
    """Dtype the floating-point weights cross in. ``bfloat16``: fp32 weights travel as bf16
    (half the bytes) and are cast back to their own dtype on receipt, so the engine serves the
    trained weights rounded to bf16 -- a small gap between the policy that samples and the one
    that is trained, which the algorithm's importance ratios see like any other staleness."""

    @field_validator("sites")
    @classmethod
    def _sites(cls, sites: list[list[str]]) -> list[list[str]]:
        seen: set[str] = set()
        for site in sites:
            for name in site:
                if not re.fullmatch(r"generate-\d+", name):
                    raise ValueError(f"{name!r} is not a generate worker's name (generate-<i>)")
                if name in seen:
                    raise ValueError(f"{name!r} is in two sites")
                seen.add(name)
        return sites


class DaskTransfer(Transfer):
    """Weights as one safetensors payload per version, carried by Dask."""

    def __init__(self, config: DaskTransferConfig):
        self.config = config

    def send(self, weights, version: int) -> bytes:
        """The parameters as safetensors bytes (copied to the CPU); no weights (a simulated
        trainer), no bytes, and no torch import."""
        if not weights:
            return b""
        if self.config.wire_dtype == "as_trained":
            from streamrl.training.weights_bytes import weights_to_bytes

            return weights_to_bytes(weights)
        import torch
        from safetensors.torch import save

        # only fp32 shrinks; each cast tensor's own dtype travels in the header to be restored
        cast = {n: str(t.dtype).removeprefix("torch.") for n, t in weights.items() if t.dtype == torch.float32}
        return save({n: (t.to(torch.bfloat16) if n in cast else t).detach().to("cpu").contiguous()
                     for n, t in weights.items()}, metadata={"streamrl_cast": json.dumps(cast)})

    def receive(self, payload: bytes, version: int) -> dict:
        """The named tensors back from the bytes (in the dtypes they were trained in)."""
        if not payload:
            return {}
        from streamrl.training.weights_bytes import weights_from_bytes

        weights = weights_from_bytes(payload)
        cast = _cast_back(payload)
        if cast:
            import torch

            weights = {n: t.to(getattr(torch, cast[n])) if n in cast else t for n, t in weights.items()}
        return weights


def _cast_back(payload: bytes) -> dict[str, str]:
    """``{name: dtype}`` of the tensors that crossed in ``wire_dtype`` (from the safetensors header)."""
    header_len = int.from_bytes(payload[:8], "little")
    meta = json.loads(payload[8:8 + header_len]).get("__metadata__") or {}
    return json.loads(meta.get("streamrl_cast", "{}"))
