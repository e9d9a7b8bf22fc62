"""The ``dask`` transfer: weights travel as safetensors bytes through Dask itself.

On the train worker the parameters become one safetensors blob (the ``export-weights-<v>``
task's result); Dask moves the bytes to every generate worker (``load-weights-<v>-<worker>``),
worker to worker, so the ``streamrl`` process never holds them. Safetensors bytes carry any
dtype, so bf16 weights work where bf16 tensors would not pickle through Dask, and CUDA tensors
never cross. Good on one machine or a fast network; a collective broadcast is the GPU-cluster
alternative.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from streamrl.api import Transfer


class DaskTransferConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class DaskTransfer(Transfer):
    """Weights as one safetensors payload per version, carried by Dask."""

    def __init__(self, config: DaskTransferConfig):
        self.config = config

    def send(self, weights, version: int) -> bytes:
        """The parameters as safetensors bytes (copied to the CPU); no weights (a simulated
        trainer), no bytes, and no torch import."""
        if not weights:
            return b""
        from streamrl.training.trainer import weights_to_bytes

        return weights_to_bytes(weights)

    def receive(self, payload: bytes, version: int) -> dict:
        """The named tensors back from the bytes."""
        if not payload:
            return {}
        from streamrl.training.trainer import weights_from_bytes

        return weights_from_bytes(payload)
