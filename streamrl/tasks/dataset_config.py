"""The ``dataset`` task's recipe table (``[task] name = "dataset"``): where the rows are, which
fields hold the prompt and the answer, how chat prompts are rendered, what is held out."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from streamrl.api import PathOrHubId

#: Keyword arguments of ``apply_chat_template`` the task sets itself: given again in
#: ``chat_template_kwargs`` they would fail every row (a keyword given twice) or make no prompt.
TASK_TEMPLATE_ARGUMENTS = ("conversation", "tokenize", "add_generation_prompt", "continue_final_message",
                           "return_dict", "return_tensors", "return_assistant_tokens_mask")


class DatasetConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    path: PathOrHubId
    """A parquet / JSON / JSONL / CSV file, a ``save_to_disk`` folder, a folder of such files,
    or a hub id. Relative paths are resolved against the recipe's folder."""
    split: str = "train"
    """The split to train on (a ``save_to_disk`` DatasetDict or a hub dataset; a single file is
    one split)."""
    prompt_key: str = "prompt"
    """The field holding the prompt: a string, or a list of ``{"role", "content"}`` messages."""
    answer_key: str | None = None
    """The field holding the answer (``Prompt.answer``), dotted for a nested one. Default:
    verl's ``reward_model.ground_truth``, else the first of ``answer``, ``solution``,
    ``ground_truth`` the rows have; none: no answer."""
    system_prompt: str | None = None
    """A system message put before each prompt (turns a plain-string prompt into a chat)."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments to ``apply_chat_template`` (e.g. ``{enable_thinking = false}``);
    not those the task sets itself (``tokenize``, ``add_generation_prompt``, ...)."""
    max_prompt_tokens: int | None = Field(None, ge=1)
    """Drop rows whose prompt is longer than this many tokens (counted once, printed). Default:
    the longest prompt the engine takes when it has a fixed one (slot batching's
    ``engine.max_prompt_tokens``), else none."""
    prompt_positions: int | None = Field(None, ge=1)
    """The longest prompt the model can take: its positions less the engine's
    ``max_new_tokens`` (filled in by the run when ``max_prompt_tokens`` is not). A row past it is
    passed over when it is handed out, with a warning, and left out of the evaluation: checked
    then, not when the task is built, which would tokenize every row of a large dataset. (A
    prompt of a megabyte sent to the engine asked it for a cache of a hundred gigabytes and
    ended the run.)"""
    epochs: int | None = Field(None, ge=1)
    """Passes over the data; the run fails with a one-line error when it needs more. None: as
    many as ``run.steps`` takes."""
    eval_path: PathOrHubId | None = None
    """A held-out file or dataset for evaluation (``[eval]``)."""
    eval_split: str | None = None
    """A held-out split: of ``eval_path``, or of ``path`` when ``eval_path`` is not set."""
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    """Without ``eval_path`` / ``eval_split``: hold this share of the training rows out for
    evaluation (chosen from ``seed``, never trained on)."""
    eval_max: int | None = Field(None, ge=1)
    """Evaluate on at most this many held-out rows (the first ones, in a fixed order)."""
    model_path: PathOrHubId | None = None
    """The tokenizer for chat templates and ``max_prompt_tokens``; default: the recipe's model."""
    seed: int = 0
    """Seed of the per-epoch shuffle and the held-out choice (default: ``run.seed``)."""

    @model_validator(mode="after")
    def _one_held_out_source(self) -> "DatasetConfig":
        if self.eval_fraction and (self.eval_path or self.eval_split):
            raise ValueError("set eval_fraction, or eval_path / eval_split, not both")
        return self

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_the_tasks_own(cls, value: dict[str, Any]) -> dict[str, Any]:
        taken = sorted(set(value) & set(TASK_TEMPLATE_ARGUMENTS))
        if taken:
            raise ValueError(f"{', '.join(taken)} {'is' if len(taken) == 1 else 'are'} set by the task itself "
                             "(a prompt is rendered as text, ending where the model's reply starts)")
        return value
