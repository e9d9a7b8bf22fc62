"""Which device a worker computes on: ``[pools.<name>] device``, resolved on the worker itself.

The local cluster exports each pool's setting to its workers as ``STREAMRL_DEVICE``; a worker of
a cluster you started yourself has none and counts as ``auto``. ``auto`` means CUDA when the worker
sees a GPU (``CUDA_VISIBLE_DEVICES`` from ``pools.<name>.cuda_visible_devices`` decides which),
else the CPU -- so one recipe runs on a laptop and on a GPU node unchanged.
"""

from __future__ import annotations

import os

ENV = "STREAMRL_DEVICE"


def worker_device() -> str:
    """``"cuda"`` or ``"cpu"`` for this process (see the module docstring). A pool set to
    ``cuda`` on a worker that sees no GPU is an error naming the setting."""
    import torch

    wanted = os.environ.get(ENV, "auto")
    has_gpu = torch.cuda.is_available()
    if wanted == "cuda" and not has_gpu:
        raise RuntimeError(f"device = 'cuda' for this pool, but this worker sees no GPU "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')!r}, "
                           f"torch {torch.__version__})")
    if wanted == "cpu":
        return "cpu"
    return "cuda" if has_gpu else "cpu"
