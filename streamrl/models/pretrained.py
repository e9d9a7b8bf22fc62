"""A model's weights from a folder, as every streamrl worker loads them.

transformers (5.25 on) swaps some layers of a model it loads for kernels it downloads from the
Hugging Face Hub (its ``kernels`` package) unless told not to, and does it again whenever the
model goes from ``eval()`` to ``train()``. streamrl chooses its kernels itself
(``engine.kernels``, ``trainer.kernels``): a download at load time would run code the recipe
never named, behave differently on a worker that has the Hub in its cache and one that has not,
and on a GPU worker without network it fails the engine's or the trainer's build outright
("... is not available in the local cache and Hugging Face Hub is in offline mode").
"""

from __future__ import annotations

import torch


def causal_lm(path: str, dtype: torch.dtype, **kwargs):
    """``AutoModelForCausalLM.from_pretrained(path)`` in ``dtype``, transformers' Hub kernels off
    (``kwargs``: further ``from_pretrained`` arguments, e.g. ``gguf_file``)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_kernels=False, **kwargs)


def backbone(path: str, dtype: torch.dtype):
    """``AutoModel.from_pretrained(path)`` (the model without its output head: a critic's trunk)
    in ``dtype``, transformers' Hub kernels off."""
    from transformers import AutoModel

    return AutoModel.from_pretrained(path, dtype=dtype, use_kernels=False)
