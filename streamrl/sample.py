"""The unit of data that streams between pools: a prompt, and the samples generated for it.

A *group* is the ``samples_per_prompt`` samples of one prompt; it is what one generate task
produces, what one reward task scores, and the smallest piece a micro-batch is made of (GRPO
normalises advantages within a group). Everything here is plain Python so it pickles cheaply
between Dask workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Prompt:
    """One prompt handed out by a task."""

    uid: str
    """Unique id of the prompt within the run, e.g. ``"3-07"`` (step 3, prompt 7)."""
    text: str
    """The prompt text given to the engine (it tokenizes)."""
    answer: Any = None
    """Whatever the reward needs to check a response (the expected answer, test cases, ...)."""
    token_ids: list[int] | None = None
    """Token ids the engine feeds as they are, when the task tokenized the prompt itself (a chat
    template applied with the model's tokenizer: its special tokens are already in place, so
    the engine adds none). None: the engine tokenizes :attr:`text`."""
    columns: dict[str, Any] = field(default_factory=dict)
    """Every other field of the prompt's dataset row (verl's ``data_source``, ``reward_model``,
    ``extra_info``; a TRL dataset's extra columns), by name: rewards receive them."""


@dataclass
class Sample:
    """One generated response with everything training and accounting need."""

    uid: str
    """Unique id: ``<prompt uid>-<k>``."""
    prompt: Prompt
    prompt_ids: list[int]
    """Prompt token ids as the engine fed them (BOS included)."""
    response_ids: list[int]
    """Generated token ids (EOS included when the model stopped by itself)."""
    logprobs: list[float]
    """Log-probability of each response token under the policy that generated it."""
    response_text: str = ""
    """Decoded response, special tokens removed."""
    policy_version: int = 0
    """Version of the weights that generated this sample (0 = the initial model); for a served
    sample whose weights changed mid-response, the oldest of :attr:`token_versions`."""
    token_versions: list[int] = field(default_factory=list)
    """The version that generated each response token, where the engine tracks it (served
    requests); empty: every token is :attr:`policy_version`'s."""
    loss_mask: list[int] = field(default_factory=list)
    """1 for each response token the policy generated (trained), 0 for one it did not (a tool's
    output or a user turn that an agent's chat template put between two model calls: it is part
    of the context, not of the policy's actions); its log-prob is 0 and its version the one
    before it. Empty: every response token is trained (one model call)."""
    reward: float | None = None
    """Filled by the reward task."""
    reward_info: dict[str, float] = field(default_factory=dict)
    """Named values the reward reported beside the score (each function of a weighted sum, the
    other keys of a verl-style dict result); each is logged per step as ``reward/<name>/mean``."""
    worker: str = ""
    """Name of the generate worker (engine instance) that made it."""
    reward_error: str = ""
    """What the reward raised (``"ValueError: ..."``) or why its value was not a score, when it
    failed for this sample (scored 0); empty otherwise."""
    times: dict[str, float] = field(default_factory=dict)
    """Wall-clock timestamps: ``gen_start``, ``gen_end``, ``reward_end``; and ``clock_shift``, the
    seconds Dask added to the generate worker's clock in its task stream when the sample was made
    (the trace puts ``gen_start`` and ``gen_end`` in that frame); ``reward_clock_shift``, the same
    for the reward worker that scored it (``reward_end`` in its frame)."""


Group = list[Sample]
