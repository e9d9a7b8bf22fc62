"""A LoRA adapter as a publication: what a LoRA learner's trainer sends instead of the whole
policy when the engine takes adapters (``EngineCapabilities.adapters``).

The payload is an ordinary ``{name: tensor}`` dict, so every transfer carries it as it carries
weights. For each adapted linear layer of the plain model (its name as ``named_modules`` gives
it, e.g. ``model.layers.0.self_attn.q_proj``) it holds three tensors:

- ``<layer>.lora_A``: ``(rank, in_features)``
- ``<layer>.lora_B``: ``(out_features, rank)``
- ``<layer>.lora_scale``: a 0-d tensor, the factor of ``B @ A`` (``alpha / rank`` for peft's
  default)

so the layer computes ``base(x) + scale * (x @ A.T) @ B.T``: the base weights never change, and
one publication is the adapter's bytes (about 1% of a 0.5B model's at rank 16). A dict with any
other name is whole weights.
"""

from __future__ import annotations

A, B, SCALE = ".lora_A", ".lora_B", ".lora_scale"
_PARTS = (A, B, SCALE)


def is_adapter(named: dict) -> bool:
    """Whether a publication is an adapter (every name one of a layer's three parts), not weights."""
    return bool(named) and all(name.endswith(_PARTS) for name in named)


def by_layer(named: dict) -> dict[str, tuple]:
    """``{layer: (A, B, scale)}`` of an adapter publication; a layer missing a part is refused
    with the layer's name (a payload cut short must not load half an adapter)."""
    layers: dict[str, dict] = {}
    for name, tensor in named.items():
        part = next(p for p in _PARTS if name.endswith(p))
        layers.setdefault(name[: -len(part)], {})[part] = tensor
    out = {}
    for layer, parts in layers.items():
        missing = [p for p in _PARTS if p not in parts]
        if missing:
            raise ValueError(f"adapter publication: layer {layer!r} lacks {', '.join(m.lstrip('.') for m in missing)}")
        out[layer] = (parts[A], parts[B], parts[SCALE])
    return out
