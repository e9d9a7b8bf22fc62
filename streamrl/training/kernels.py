"""How the policy's decoder layers run faster than transformers' modules eagerly:
``torch.compile`` of each layer (``trainer.compile``), or Liger's fused Triton kernels for the
elementwise layers (``trainer.kernels = "liger"``). Both change the modules in place and keep
every parameter's name, so checkpoints and weight publication see the same model."""

from __future__ import annotations

import torch

from streamrl.errors import UserError


def compile_layers(model) -> None:
    """``torch.compile`` the decoder's layers in place (``Module.compile``: the state dict keeps
    its names, so checkpoints and weight publication see the same model); dynamic shapes, since
    micro-batches differ in length."""
    decoder = model.get_decoder()
    for layer in getattr(decoder, "layers", None) or [decoder]:  # (a decoder without a layer list: whole)
        layer.compile(dynamic=True)


def use_liger_kernels(model, device: str, field: str = "trainer.kernels", workers: str = "train workers") -> None:
    """Swap the decoder's RMSNorm, SwiGLU MLP and rotary embedding for Liger's fused Triton
    kernels, in place (``trainer.kernels = "liger"``, or ``engine.kernels``: ``field``; parameter
    names unchanged). A user error where they cannot run: not a GPU, the library missing, a
    model type Liger does not know."""
    if torch.device(device).type != "cuda":
        raise UserError(f'{field} = "liger" needs a CUDA GPU; the {workers[:-1]} has {device}')
    try:
        from liger_kernel.transformers import monkey_patch
    except ImportError as e:
        raise UserError(f'{field} = "liger" needs the liger-kernel package on the {workers} '
                        f"(pip install liger-kernel): {e}") from None
    kind = model.config.model_type
    apply = monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN.get(kind)
    if apply is None:
        raise UserError(f'{field} = "liger": Liger has no kernels for model type {kind!r}')
    # the log-prob head is streamrl's own (training/head_logprobs.py): no loss patching
    apply(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False)
