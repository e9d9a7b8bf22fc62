"""The ``dask`` transport: weights travel as safetensors bytes through Dask itself.

The trainer's worker serialises its parameters once (an ``export-weights-<v>`` task); every
generate worker then runs a ``load-weights-<v>-<worker>`` task pinned to it, and Dask moves the
bytes worker to worker (the controller never holds them). Safetensors bytes carry any dtype, so
bf16 weights work where bf16 tensors would not pickle through Dask, and CUDA tensors never
cross. Good on one machine or a fast network; a NCCL broadcast is the GPU-cluster alternative.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from streamrl.flow import tasks


#: Dask priority of weight export/load tasks: above any generate task (schedulers use the
#: predicted-length rank, at most the prompts per step, as generate priorities).
LOAD_PRIORITY = 1_000_000


class DaskTransportConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class DaskTransport:
    """Publishes weights with two ordinary Dask tasks per step."""

    def __init__(self, config: DaskTransportConfig):
        self.config = config

    def publish(self, client, after, version: int, train_worker: str, generate_workers: dict[str, str]):
        """Submit export + one load per generate worker (``{name: address}``); returns the load futures."""
        # High priority: on a busy generate worker the load must not queue behind generate tasks
        # submitted earlier (Dask otherwise runs tasks in submission order).
        blob = client.submit(tasks.export_weights, after=after, key=f"export-weights-{version}",
                             workers=[train_worker], resources={"train": 1}, priority=LOAD_PRIORITY)
        return [
            client.submit(tasks.load_weights, blob, version, key=f"load-weights-{version}-{name}",
                          workers=[addr], allow_other_workers=False, priority=LOAD_PRIORITY)
            for name, addr in generate_workers.items()
        ]
