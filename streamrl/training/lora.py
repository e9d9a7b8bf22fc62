"""LoRA learners (``[trainer] lora = { rank, alpha, dropout, targets }``): the policy's base weights
frozen, a low-rank adapter per targeted linear layer trained with its AdamW state (peft).

The adapter is injected into the loaded model in place (peft's ``get_peft_model``), so the
trainer keeps computing with the same module: its forward runs base + adapter, only the
adapters' parameters have gradients and AdamW state.

What a publication sends depends on the engine. One that takes adapters
(``EngineCapabilities.adapters``, the ``hf`` engine) gets the adapter alone
(:func:`adapter_payload`, ``contracts/adapters.py``): its base weights never change, so a
publication is a few MB, not the model. Any other engine gets the *merged* weights
(``W + (alpha / rank) * B @ A`` for each adapted layer, computed beside the base weights, never
written into them) under the base model's own parameter names, and loads a LoRA learner's policy
as it loads any other. The run's ``policy/`` holds both the merged model and the adapter
(``policy/adapter/``, which ``peft.PeftModel.from_pretrained`` loads over the base model).
"""

from __future__ import annotations

import torch

from streamrl.training.hf_config import LoraConfig

#: the adapter's name inside peft (one adapter per trainer)
ADAPTER = "default"


def add_adapter(model: torch.nn.Module, config: LoraConfig):
    """Inject a LoRA adapter into ``model`` in place and freeze everything else; returns the
    ``PeftModel`` around it (``model`` itself now runs base + adapter)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    targets = config.targets if isinstance(config.targets, str) else list(config.targets)
    peft_config = PeftLoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
                                 target_modules=targets, bias="none", task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, peft_config)
    except ValueError as e:  # no module of that name: the user's targets
        raise ValueError(f"trainer.lora.targets: {e}") from None


def base_name(name: str) -> str:
    """A parameter's name in the plain model: peft's wrapper level (``.base_layer``) removed."""
    return name.replace(".base_layer.", ".")


@torch.no_grad()
def merged_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The policy as a plain model's parameters (names and tied weights as ``named_parameters``
    of the model without adapters gives them): each adapted layer's weight plus its adapter's
    delta, the adapters' own parameters left out. The base weights are not changed."""
    from peft.tuners.lora import LoraLayer

    deltas = {name: module.get_delta_weight(ADAPTER) for name, module in model.named_modules()
              if isinstance(module, LoraLayer) and ADAPTER in module.lora_A}
    out = {}
    for name, p in model.named_parameters():
        if ".lora_" in name:
            continue
        owner = name.rsplit(".", 2)[0] if name.endswith(".base_layer.weight") else None
        weight = p.detach()
        if owner in deltas:
            weight = weight + deltas[owner].to(weight.dtype)
        out[base_name(name)] = weight
    return out


@torch.no_grad()
def adapter_payload(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter as a publication (``contracts/adapters.py``): per adapted layer, under the
    plain model's layer name, its ``A``, ``B`` and scale, detached (an engine that takes adapters
    adds ``scale * B @ A`` to the base weights it already holds)."""
    from peft.tuners.lora import LoraLayer

    from streamrl.contracts import adapters

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            layer = name.removeprefix("base_model.model.")  # (the PeftModel's own names, if given it)
            out[layer + adapters.A] = module.lora_A[ADAPTER].weight.detach()
            out[layer + adapters.B] = module.lora_B[ADAPTER].weight.detach()
            out[layer + adapters.SCALE] = torch.tensor(float(module.scaling[ADAPTER]))
    return out


def adapter_parameters(model: torch.nn.Module) -> int:
    """How many parameters the adapter trains."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
