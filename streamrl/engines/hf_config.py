"""The ``[engine]`` table of ``name = "hf"`` and what it fixes before any engine is built.

Apart from the engine's code so that the ``streamrl`` process, which validates recipes and reads
capabilities but never generates, does not import torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class HFEngineConfig(BaseModel):
    """The ``[engine]`` table of ``name = "hf"``: sampling, batching and the KV cache."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    max_new_tokens: int = Field(16, ge=1)
    """Most tokens generated per response."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature. The trainer divides its logits by the same value, so the engine's
    logprobs and the trainer's agree."""
    max_batch_tokens: int = Field(1024, ge=16)
    """Most tokens in one forward pass of the continuous-batching loop."""
    num_blocks: int = Field(256, ge=1)
    """KV-cache blocks (of ``page_size`` tokens each) reserved on the worker."""
    page_size: int = Field(32, ge=1)
    """Tokens per KV-cache block."""
    batching: Literal["continuous", "static", "slots"] = "continuous"
    """``continuous``: transformers' continuous batching, requests join the running batch at any
    decode step (long or uneven outputs). ``static``: the requests waiting when a batch starts
    are decoded together as one padded batch until all finish (``engines/static.py``); faster
    when outputs are short and arrive together, as in W1. ``slots``: streamrl's own decode loop
    over the model's modules with a static KV cache of ``slots`` request slots, each decode step
    one captured CUDA graph on a GPU (``engines/slots.py``; Llama and Qwen2 models): the fast
    path on a GPU, where the other two spend most of a step launching kernels."""
    slots: int = Field(64, ge=1)
    """``batching = "slots"``: requests decoding at once (each holds a slot of the KV cache from
    its prefill to its last token; more wait in the engine's queue). Size it to the requests a
    worker gets at once (prompts x samples per step, over the generate workers)."""
    max_prompt_tokens: int = Field(512, ge=1)
    """``batching = "slots"``: the longest prompt a slot takes; each slot holds
    ``max_prompt_tokens + max_new_tokens`` positions, so together with ``slots`` this sizes the
    KV cache. A longer prompt fails its request, naming this field."""
    max_running: int = Field(0, ge=0)
    """Most requests in the running batch at once; the rest wait in the engine's queue, highest
    priority first. 0: no cap (every request goes straight into the batch)."""
    profile: bool | None = None
    """Measure the decode step latency at a few batch sizes when the engine starts; a
    scheduler (``skew``) uses it to decide how many instances the long tail gets. Unset: measured
    when the recipe has a ``[scheduler]`` (the run fills it in; ``streamrl plan`` always
    measures), since nothing else reads it and it costs start-up time that grows with the model
    (docs/benchmarks.md). False: no profile, schedulers only balance predicted work."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Torch dtype the engine loads the model in. ``auto``: bfloat16 on a GPU, float32 on CPU
    (where float32 keeps engine and trainer logprobs within 1e-5)."""
    cuda_graph: bool = True
    """On a GPU, let continuous batching replay CUDA graphs of its decode steps: each step's
    many small kernel launches become one (docs/benchmarks.md has the gain). Ignored on CPU, and
    with ``adapters`` (transformers' graphs would replay the forward without them: set
    ``adapters = 0``, or use ``slots``, whose graphs hold the adapters)."""
    kv_memory_fraction: float | None = Field(None, gt=0, lt=1)
    """Size the KV cache as this share of the device's free memory instead of ``num_blocks``
    (continuous batching; leave room for a train worker sharing the GPU)."""
    reproducible: bool = False
    """True: each group is decoded alone with a random generator seeded by ``seed`` and the
    prompt, so a seed gives the same samples every run (and a resumed run the same samples as an
    uninterrupted one); no continuous batching across groups, so slower under load."""
    seed: int | None = None
    """Seed of ``reproducible`` sampling (default: ``run.seed``)."""
    request_timeout: float = Field(600.0, gt=0, le=1e6)  # (bounded: a timer of 1e300 s cannot be armed)
    """Seconds a generate task waits for one response before it fails (naming the request)
    instead of hanging the step on a stuck generation loop."""
    adapters: int = Field(4, ge=0)
    """LoRA adapters one engine holds at once over its base weights (``engines/adapters.py``).
    A LoRA learner (``trainer.lora``) then publishes its adapter alone, a few MB instead of the
    model, and the engine adds it to the base weights it keeps at every forward; with ``slots``
    batching each request may use its own adapter in the same decode step (served variants of
    LoRA learners). 0: no adapters, and a LoRA learner publishes its merged weights."""
    stop_early_every: int = Field(0, ge=0)
    """``batching = "slots"``: every this many tokens of a response, ask the reward's
    ``stop_early(prompt, text so far)`` (``Reward.stop_early``) and end the response there when
    it says the rest cannot change its score -- the tokens it would have spent go to other
    requests. The reward is built on each generate worker for it. 0: never."""

    finished_every: int = Field(1, ge=1)
    """``batching = "slots"``: look for ended requests every this many decode steps. Each look
    copies the finished flags from the device, which waits for the steps before it; on a GPU,
    looking less often lets the loop queue that many steps back to back. An ended request stops
    decoding at once and waits at most ``finished_every - 1`` steps to be handed back (its slot
    free again then). Waiting requests are admitted on the same turns (or at once when nothing
    runs), so requests that arrive a few at a time -- one generate task's group after another --
    share one prefill instead of one each between two decode steps. Streamed and watched requests
    are still read every step."""
    fused_sampling: bool = True
    """``batching = "slots"`` on a GPU with Triton: draw each step's tokens and their log-probs
    in two kernels that read the logits once (``engines/fused_sampling.py``) instead of torch
    ops that write float32 copies of ``[slots, vocabulary]`` about ten times. The same draw (a
    Gumbel-max sample of the tempered softmax) and the same float32 log-probs; false: the torch
    ops (the reference; what a CPU runs)."""
    prefill_graphs: bool = True
    """``batching = "slots"`` on a GPU with ``cuda_graph``: prefill prompts from CUDA graphs
    captured per bucket (a power of two of prompts by a width of 16 x a power of two, up to 8,192
    positions), padded to the smallest that holds them, instead of launching every layer's kernels
    at each admission while the running requests wait (``engines/slot_prefill.py``). A prefill
    past the buckets, or with LoRA adapters, runs eagerly; false: always eagerly. Costs a staging
    buffer of 8,192 positions' keys and values and the graphs' memory (docs/benchmarks.md)."""
    kernels: Literal["torch", "liger"] = "torch"
    """How the model's elementwise layers run in the engine: ``torch``, transformers' modules
    (several kernels each: RMSNorm in float32, SwiGLU, rotary); ``liger``, the liger-kernel
    package's fused Triton kernels, one each (a CUDA GPU, ``pip install liger-kernel`` on the
    generate workers). In the slot decoder's step of a 0.5B model they are hundreds of tiny
    kernels; with ``trainer.kernels = "liger"`` the engine computes as the trainer does."""

    @model_validator(mode="after")
    def _stop_early_in_slots(self) -> "HFEngineConfig":
        if self.stop_early_every and self.batching != "slots":
            raise ValueError('stop_early_every needs batching = "slots" (the loop that sees each decode step)')
        if self.stop_early_every and self.reproducible:
            raise ValueError("stop_early_every needs reproducible = false (the seeded decoder decodes each group "
                             "alone, to its end)")
        if self.finished_every > 1 and self.batching != "slots":
            raise ValueError('finished_every needs batching = "slots" (the loop that reads the finished flags)')
        return self


def kv_capacity_tokens(config: HFEngineConfig) -> int:
    """Tokens the KV cache holds, fixed by ``config`` before the engine is built; 0 where it is
    not fixed: it grows with each batch (static batching, seeded decoding), or
    ``kv_memory_fraction`` sizes it from the device's free memory, known only once it is built.
    Continuous batching holds ``num_blocks`` blocks of ``page_size`` tokens; slot batching
    ``slots`` slots of ``max_prompt_tokens + max_new_tokens`` positions each."""
    if config.reproducible:
        return 0
    if config.batching == "slots":
        return config.slots * (config.max_prompt_tokens + config.max_new_tokens)
    if config.batching == "continuous" and not config.kv_memory_fraction:
        return config.num_blocks * config.page_size
    return 0
