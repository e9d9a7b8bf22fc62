"""The ``[trainer]`` table of ``name = "hf"`` and what the trainer declares before it is built.

Apart from the trainer (``training/trainer.py``) because it imports no torch: the ``streamrl``
process validates the table and reads the trainer's capabilities but never trains.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from streamrl.api import TrainerCapabilities


class LoraConfig(BaseModel):
    """``[trainer] lora = { ... }``: train a low-rank adapter instead of the whole policy."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    rank: int = Field(16, ge=1, le=1024)
    """r: the rank of each adapter (its two matrices are ``d x r`` and ``r x k``)."""
    alpha: float = Field(32.0, gt=0)
    """The adapter's output is scaled by ``alpha / rank``."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input while training (0: none; RL's ratios are cleaner without)."""
    targets: list[str] | Literal["all-linear"] = "all-linear"
    """The linear layers that get an adapter, by name suffix (``["q_proj", "v_proj"]``), or
    ``all-linear``: every linear layer but the output head."""


class HFTrainerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    lr: float = Field(1e-4, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay, of the policy and (``ppo``) of the critic; a resume takes the
    recipe's, as it takes its learning rates."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps over which the learning rate rises linearly from ~0 to ``lr``. Adam's first
    steps move every weight by about ``lr`` whatever the gradient's size; a warm-up keeps noisy
    early RL gradients from wrecking a small policy."""
    max_grad_norm: float = Field(1.0, ge=0)
    """Gradient clipping norm before each optimizer step (0 disables)."""
    critic_lr: float = Field(5e-4, gt=0)
    """AdamW learning rate of the critic, for algorithms that have one (``ppo``)."""
    precision: Literal["auto", "fp32", "bf16-autocast", "bf16-params"] = "auto"
    """``fp32``: everything in float32. ``bf16-autocast``: float32 weights and AdamW state,
    forward/backward matmuls in bfloat16 (``torch.autocast``); log-softmax stays float32.
    ``bf16-params``: the policy's weights and gradients in bfloat16, float32 master weights and
    AdamW state beside them, the reference model in bfloat16 (``training/precision.py``).
    ``auto``: bf16-params on a GPU, fp32 on CPU."""
    logprob_chunk_tokens: int = Field(1024, ge=0)
    """Token log-probs are computed from the output head over chunks of this many response
    positions, recomputed in the backward pass, so the ``[batch, length, vocab]`` float32 logits
    never exist at once (``training/logprobs.py``). 0: all logits at once (the plain way)."""
    logprob_kernels: Literal["auto", "eager", "compiled", "checkpointed"] = "auto"
    """How each chunk's log-softmax and its gradient run (``training/head_logprobs.py``):
    ``compiled`` fuses each into one kernel that reads the bf16 logits and reduces in float32
    without writing a float32 copy (``torch.compile``: compiled once, at the first step);
    ``eager``: plain torch operations. ``auto``: compiled on a GPU with Triton, eager elsewhere.
    ``checkpointed``: each chunk's head and float32 log-softmax under activation checkpointing
    (the forward runs twice; the path of heads that are not a plain linear layer)."""
    kernels: Literal["torch", "liger"] = "torch"
    """The decoder's elementwise layers: ``torch``, transformers' own modules (many small kernels
    each: RMSNorm in float32, SwiGLU, rotary); ``liger``, the liger-kernel package's fused Triton
    kernels for RMSNorm, SwiGLU and rotary embeddings, patched into the model in place (GPU only;
    ``pip install liger-kernel`` on the train workers)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them:
    less memory per token (longer micro-batches fit), about a third more compute."""
    compile: bool = False
    """``torch.compile`` each decoder layer in place (parameter names unchanged) so that its
    elementwise work -- norms, activations, rotary embeddings, autocast's casts -- runs fused
    instead of one kernel per operation. The first micro-batches of each new length pay for the
    compilation (tens of seconds on a GPU); worth it for long runs on a GPU, not on CPU."""
    max_weight_change: float = Field(1.0, gt=0)
    """An update that changes the policy's weight norm by more than this share of it (1.0: to
    double it, or to nothing) stops the run before it is published or checkpointed, like one
    that is not finite: a learning rate far too high (``trainer.lr = 1e9``) makes finite weights
    that ruin every later step, and a checkpoint of them would make every resume fail too. A
    sane update moves the norm by well under 1% of it."""
    max_nonfinite_steps: int = Field(0, ge=0)
    """Optimizer steps in a row whose loss or gradient may be not finite (NaN or inf) and are
    skipped -- no update, the policy version still counted, ``nonfinite_skipped`` = 1 in the
    step's record -- before the run stops. 0: the first one stops the run (a one-line error
    naming the step and the last checkpoint). Either way a non-finite update is never applied,
    published or checkpointed. A few isolated skips can ride out a rare numerical spike; every
    step non-finite is a learning rate far too high or an algorithm that returns NaN."""
    lora: LoraConfig | None = None
    """Train a LoRA adapter (``{ rank = 16, alpha = 32 }``): the base weights frozen, only the
    adapters and their AdamW state trained (``training/lora.py``). Publications carry the merged
    weights, so any engine serves the policy; ``policy/`` holds the merged model and
    ``policy/adapter/``. None: the whole policy is trained."""

    @model_validator(mode="after")
    def _lora_checks(self):
        import importlib.util

        if self.lora is not None and importlib.util.find_spec("peft") is None:
            raise ValueError("lora needs the peft package: pip install 'streamrl[lora]'")
        if self.lora is not None and self.precision == "bf16-params":
            raise ValueError('lora keeps the frozen base weights as they load: use precision "bf16-autocast", '
                             '"fp32" or "auto" (bf16-autocast on a GPU with lora)')
        return self


def capabilities(config: HFTrainerConfig) -> TrainerCapabilities:
    """Data parallel over the train pool (``ddp``), and shardable (``fsdp``) unless it trains a
    LoRA adapter (``adapter``)."""
    lora = getattr(config, "lora", None) is not None  # (a subclass's config may have no lora)
    return TrainerCapabilities(data_parallel=True, shardable=not lora, adapter=lora)
