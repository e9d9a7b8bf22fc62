"""A recipe's ``[[learners]]`` tables: several algorithms learning from one stream of generated samples.

A recipe without ``[[learners]]`` has one learner, made of its ``[algorithm]`` and ``[trainer]``.
With them, each table is a learner: a name, an algorithm table (default: the recipe's
``[algorithm]``) and the trainer options that differ (over ``[trainer]``'s). ``run.serve`` picks
the learner whose weights the generate pool serves; it trains on the train pool exactly as a
single-learner run does. Every other learner trains on its own worker (``learner-<name>``) from
the same scored groups, off-policy: the samples carry the served policy's per-token log-probs
(the behaviour policy), and the clipped surrogate takes its ratio to them,

    ratio_t = pi_learner(y_t) / pi_behaviour(y_t),  loss_t = -min(ratio_t * A, clip(ratio_t, 1-e, 1+e) * A)

a per-token importance ratio whose gradient is cut off outside ``[1-e, 1+e]`` (PPO's clip as a
trust region around the behaviour policy). The other corrections of ``[algorithm.off_policy]``
(``algorithms/off_policy.py``; ``off_policy_cap > 0`` is token-level truncated IS, which takes the
ratio to the learner's own previous weights and weights tokens by the capped ratio) are left to
the recipe: on the addition workload a GRPO learner beside a served PPO one lost held-out reward
with it, while one with the clip to the behaviour policy gained it (docs/learners.md has the
figures).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

#: The serve value that keeps the starting model on the generate pool for the whole run.
INITIAL = "initial"

#: ``[trainer]`` keys that shape the stream itself: every learner sees the same batches.
STREAM_KEYS = ("name", "prompts_per_step", "samples_per_prompt", "groups_per_micro_batch", "micro_batch_tokens",
               "strategy")


#: Names a learner cannot take: the engine's name for the served policy's adapter (a learner
#: named so had its adapter loaded over the policy's, every step), ``run.serve``'s for the
#: starting model, and peft's for an adapter given no name.
RESERVED_NAMES = ("policy", "initial", "default")


class LearnerConfig(BaseModel):
    """One ``[[learners]]`` table."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_]{0,31}$")
    """The learner's name: lower-case letters, digits and ``_`` (it names its worker,
    ``learner-<name>``, its metrics, checkpoints and saved policy); not one of
    :data:`RESERVED_NAMES`."""
    algorithm: dict[str, Any] | None = None
    """Its algorithm, a table like ``[algorithm]`` (``name`` and options); none: the recipe's."""
    trainer: dict[str, Any] = {}
    """Trainer options that differ for this learner (``lr``, ``weight_decay``, ``critic_lr``, ...),
    over ``[trainer]``'s; the batch shape (``prompts_per_step``, ...) is the stream's and cannot."""
    queue: int = Field(2, ge=1, le=64)
    """Steps of scored groups that may wait for this learner (not the served one) while it trains
    an earlier one. A slow learner never holds generation back by more than this."""
    when_full: Literal["skip", "pace"] = "skip"
    """What a full queue does: ``skip`` -- this learner does not train on the step (counted in
    its ``skipped_steps``; generation goes on); ``pace`` -- the run waits for the learner before
    the step's groups are handed over (every learner sees every step; generation slows to it)."""
    worker: str = Field("", pattern=r"^([a-z0-9][a-z0-9_]{0,31})?$")
    """The worker it trains on, shared with the other learners naming the same one
    (``learner-<worker>``); empty: a worker of its own (``learner-<name>``). LoRA learners on one
    worker share one copy of the base weights there, each with its own adapter and AdamW state;
    their tasks take turns on it."""
    nice: int = Field(10, ge=0, le=19)
    """How much lower the CPU priority (Unix ``nice``) of this learner's worker is, on the
    embedded cluster (a worker you start yourself keeps its own). On one machine the learners
    share the CPUs, and the served learner's training is the step loop's critical path: a learner
    that is not served runs on the CPU the stream leaves (measured in docs/learners.md). 0: the
    same priority as the stream's workers."""


    @field_validator("name")
    @classmethod
    def _not_reserved(cls, name: str) -> str:
        if name in RESERVED_NAMES:
            raise ValueError(f"{name!r} is a name streamrl gives to something else; choose another (not one of "
                             f"{', '.join(RESERVED_NAMES)})")
        return name


def check(learners: list[LearnerConfig], serve: str) -> None:
    """Names are unique, ``serve`` names one of them (or ``initial``), and no learner changes the
    stream's batch shape; ``ValueError`` (the recipe loader turns it into one line)."""
    names = [lr.name for lr in learners]
    again = sorted({n for n in names if names.count(n) > 1})
    if again:
        raise ValueError(f"learners: name {again[0]!r} is used twice; each learner needs its own")
    if not learners:
        if serve:
            raise ValueError(f"run.serve = {serve!r} needs [[learners]] tables; remove it or add learners")
        return
    if serve and serve != INITIAL and serve not in names:
        raise ValueError(f"run.serve: {serve!r} is not a learner; expected one of {', '.join(names)} or {INITIAL!r}")
    for i, lr in enumerate(learners):
        check_stream_keys(lr.trainer, f"learners[{i}]")
        if lr.algorithm is not None and "name" not in lr.algorithm:
            raise ValueError(f"learners[{i}].algorithm.name: required key missing")


def check_stream_keys(trainer: dict, where: str) -> None:
    """A learner's ``trainer`` table (``where``: how errors name the learner) sets none of the
    stream's batch-shape keys: every learner sees the same batches. ``ValueError`` otherwise."""
    fixed = sorted(set(trainer or {}) & set(STREAM_KEYS))
    if fixed:
        raise ValueError(f"{where}.trainer.{fixed[0]}: the batch shape is the stream's, set it in the run's "
                         "[trainer] (every learner sees the same batches)")


def served_name(learners: list[LearnerConfig], serve: str) -> str:
    """The learner the generate pool serves (the first when ``serve`` is unset), or ``initial``."""
    return serve or learners[0].name


def main_learner(learners: list[LearnerConfig], serve: str) -> str:
    """The learner that trains on the train pool and drives the steps: the served one, or the
    first when the starting model is served."""
    name = served_name(learners, serve)
    return learners[0].name if name == INITIAL else name
