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

import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from streamrl.training.hf_config import LoraConfig

#: the adapter's name inside peft (one adapter per trainer)
ADAPTER = "default"


def _peft_config(config: LoraConfig):
    from peft import LoraConfig as PeftLoraConfig

    targets = config.targets if isinstance(config.targets, str) else list(config.targets)
    return PeftLoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
                          target_modules=targets, bias="none", task_type="CAUSAL_LM")


def add_adapter(model: torch.nn.Module, config: LoraConfig, name: str = ADAPTER):
    """Inject a LoRA adapter named ``name`` into ``model`` in place and freeze everything else;
    returns the ``PeftModel`` around it (``model`` itself now runs base + adapter)."""
    from peft import get_peft_model

    try:
        peft = get_peft_model(model, _peft_config(config), adapter_name=name)
    except ValueError as e:  # no module of that name: the user's targets
        raise ValueError(f"trainer.lora.targets: {e}") from None
    if getattr(model.config, "tie_word_embeddings", False):
        from peft.tuners.lora import LoraLayer

        # the embedding and the output head are one tensor: an adapter on either side cannot be
        # merged into it (the merged policy is one weight for both; the head's delta was dropped)
        embedding = model.get_input_embeddings()
        shared = (embedding.get_base_layer() if isinstance(embedding, LoraLayer) else embedding).weight
        tied = [n for n, m in peft.named_modules() if isinstance(m, LoraLayer)
                and (name in m.lora_embedding_A or m.get_base_layer().weight is shared)]
        if tied:
            raise ValueError(f"trainer.lora.targets: {tied[0].split('.')[-1]} shares its weight with the other end "
                             "of this model (tie_word_embeddings: the input embedding and the output head are one "
                             "tensor), so its adapter cannot be merged into the policy; leave it out of the targets")
    return peft


class SharedBase:
    """One copy of a model's base weights in this process, and the adapters of the LoRA
    learners training over it (side learners sharing a worker: ``[[learners]] worker``).

    Each learner's adapter is a peft adapter of its own name in the one ``PeftModel``; only one
    is active at a time, so a learner computes while it holds :attr:`lock` and has made its
    adapter the active one (:meth:`turn`): Dask may run two learners' tasks on the worker's
    threads at once, and they take turns here."""

    def __init__(self, model: torch.nn.Module, peft):
        self.model, self.peft = model, peft
        self.lock = threading.RLock()

    @contextmanager
    def turn(self, name: str):
        """Within: the lock held and adapter ``name`` the active (and only trainable) one."""
        with self.lock:
            if self.peft.active_adapter != name:
                self.peft.set_adapter(name)  # (peft: the others' parameters frozen meanwhile)
            yield


_SHARED: dict[tuple[str, str], SharedBase] = {}
_SHARED_LOCK = threading.Lock()


def join_shared_base(model_path: str, device: str, config: LoraConfig, name: str,
                     prepare: Callable[[torch.nn.Module], None] = lambda model: None) -> SharedBase:
    """The process's copy of ``model_path``'s base weights on ``device`` (loaded by the first
    learner to ask, and made ready by its ``prepare``: kernels, activation checkpointing,
    compilation, once for every learner over it), with a fresh adapter ``name`` for this learner
    (one of that name left by a learner removed earlier is replaced)."""
    from streamrl.models import pretrained

    with _SHARED_LOCK:
        shared = _SHARED.get((model_path, device))
        if shared is None:
            model = pretrained.causal_lm(model_path, torch.float32).to(device)
            shared = SharedBase(model, add_adapter(model, config, name))
            prepare(model)
            _SHARED[(model_path, device)] = shared
            return shared
    with shared.lock:
        if name in shared.peft.peft_config:
            shared.peft.delete_adapter(name)
        try:
            shared.peft.add_adapter(name, _peft_config(config))
        except ValueError as e:
            raise ValueError(f"trainer.lora.targets: {e}") from None
    return shared


@dataclass
class LoraPolicy:
    """A LoRA learner's policy: the model computing base + adapter, and how it is held."""

    model: torch.nn.Module
    """The model the trainer computes with (its layers carry the adapter)."""
    peft: Any
    """The ``PeftModel`` around :attr:`model`, into which the adapter was injected in place."""
    name: str
    """The adapter's name in :attr:`peft` (a side learner sharing the base: its own)."""
    shared: SharedBase | None
    """A side learner's: the process's one copy of the base weights, on which it takes turns."""
    publishes_adapter: bool
    """A publication is the adapter alone (the engine holds adapters over its base weights),
    not the merged weights: the engine takes adapters and every adapted layer is linear."""
    prepared: bool
    """The model was made ready already (another learner's, over the shared base)."""


def build(config: LoraConfig, model_path: str, device: str, learner: str, engine_adapters: int,
          prepare: Callable[[torch.nn.Module], None]) -> LoraPolicy:
    """A LoRA learner's policy on ``device``: a side learner (``learner`` named) joins the
    process's shared base with an adapter of its own; the main learner loads the model and
    injects its adapter. ``prepare`` makes a freshly loaded shared base ready, under its lock."""
    if learner:
        shared = join_shared_base(model_path, device, config, learner, prepare)
        model, peft, name, prepared = shared.model, shared.peft, learner, True
    else:
        from streamrl.models import pretrained

        model = pretrained.causal_lm(model_path, torch.float32).to(device)
        shared, peft, name, prepared = None, add_adapter(model, config), ADAPTER, False
    # (only linear layers' adapters load into an engine's)
    publishes = engine_adapters > 0 and linear_only(model, name)
    return LoraPolicy(model, peft, name, shared, publishes, prepared)


def save_policy(policy: LoraPolicy, out: str) -> None:
    """The merged model as a transformers folder at ``out``, and the adapter beside it in
    ``out/adapter`` (which ``peft.PeftModel.from_pretrained`` loads over the base model)."""
    policy.model.save_pretrained(out, state_dict=merged_weights(policy.model, policy.name))
    policy.peft.save_pretrained(f"{out}/adapter", selected_adapters=[policy.name])
    if policy.name != ADAPTER:  # (peft puts an adapter of another name in a folder of it)
        for f in Path(f"{out}/adapter/{policy.name}").iterdir():
            f.replace(Path(f"{out}/adapter") / f.name)
        Path(f"{out}/adapter/{policy.name}").rmdir()


def linear_only(model: torch.nn.Module, adapter: str = ADAPTER) -> bool:
    """Whether every layer adapter ``adapter`` adapts is a ``torch.nn.Linear`` (what an engine's
    adapters take: an adapted embedding or a GPT-2 ``Conv1D`` is published merged instead)."""
    from peft.tuners.lora import LoraLayer

    return all(isinstance(m.get_base_layer(), torch.nn.Linear) for m in model.modules()
               if isinstance(m, LoraLayer) and (adapter in m.lora_A or adapter in m.lora_embedding_A))


def own_parameters(model: torch.nn.Module, name: str) -> list[torch.nn.Parameter]:
    """Adapter ``name``'s parameters in ``model`` (what its learner's AdamW steps)."""
    # (an adapted embedding's are lora_embedding_A/B.<name>, peft's parameters without a sub-module)
    return [p for n, p in model.named_parameters() if f".lora_A.{name}." in n or f".lora_B.{name}." in n
            or n.endswith((f".lora_embedding_A.{name}", f".lora_embedding_B.{name}"))]


#: an adapter's parameter in peft's names: ``<layer>.lora_A.<adapter>.weight``,
#: ``<embedding>.lora_embedding_A.<adapter>``, ``<layer>.lora_magnitude_vector.<adapter>.weight``
_ADAPTER_PART = re.compile(r"(?<=\.)(lora_[A-Za-z_]+)\.([^.]+)(?=\.|$)")


def checkpoint_name(name: str, adapter: str) -> str | None:
    """Parameter ``name`` of a LoRA learner whose adapter is ``adapter``, as its checkpoint names
    it: its own adapter's under peft's default name -- a side learner's adapter is named after
    it on a base shared with other learners, ``default`` on a base of its own, and its state
    resumes into either -- and None for another learner's adapter on the shared base (its
    state, not this learner's). Anything else as it is."""
    found = _ADAPTER_PART.search(name)
    if found is None:
        return name
    if found.group(2) != adapter:
        return None
    return name[:found.start(2)] + ADAPTER + name[found.end(2):]


def base_name(name: str) -> str:
    """A parameter's name in the plain model: peft's wrapper level (``.base_layer``) removed."""
    return name.replace(".base_layer.", ".")


@torch.no_grad()
def merged_weights(model: torch.nn.Module, adapter: str = ADAPTER) -> dict[str, torch.Tensor]:
    """The policy as a plain model's parameters (names and tied weights as ``named_parameters``
    of the model without adapters gives them): each adapted layer's weight plus adapter
    ``adapter``'s delta, the adapters' own parameters left out. The base weights are not changed."""
    from peft.tuners.lora import LoraLayer

    # (an adapted embedding keeps its adapter in lora_embedding_A/B, not lora_A: its delta too)
    deltas = {name: module.get_delta_weight(adapter) for name, module in model.named_modules()
              if isinstance(module, LoraLayer) and (adapter in module.lora_A or adapter in module.lora_embedding_A)}
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
def adapter_payload(model: torch.nn.Module, adapter: str = ADAPTER) -> dict[str, torch.Tensor]:
    """Adapter ``adapter`` as a publication (``contracts/adapters.py``): per adapted layer, under
    the plain model's layer name, its ``A``, ``B`` and scale, detached (an engine that takes
    adapters adds ``scale * B @ A`` to the base weights it already holds)."""
    from peft.tuners.lora import LoraLayer

    from streamrl.contracts import adapters

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and adapter in module.lora_A:
            layer = name.removeprefix("base_model.model.")  # (the PeftModel's own names, if given it)
            out[layer + adapters.A] = module.lora_A[adapter].weight.detach()
            out[layer + adapters.B] = module.lora_B[adapter].weight.detach()
            out[layer + adapters.SCALE] = torch.tensor(float(module.scaling[adapter]))
    return out


def adapter_parameters(model: torch.nn.Module) -> int:
    """How many parameters the adapter trains."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
