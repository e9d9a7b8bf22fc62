"""The ``agent`` task: rows of a dataset, each rolled out by the user's own agent code.

``[task] name = "agent"`` names a Python file (``path``) and in it either an async function
``function = "rollout"`` -- ``async def rollout(client, row) -> float | dict`` -- or a gym-style
class ``environment = "MyEnv"`` (:class:`streamrl.api.Environment`). The rows come from
``[task.data]``, read as the ``dataset`` task reads its files (the same layouts and keys); a row
reaches the agent as the dict it is in the file. The file is imported when the recipe is
validated (a typo is one line then) and its text travels to the agent workers.
"""

from __future__ import annotations

import inspect
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from streamrl.api import PathOrHubId, Prompt, RecipePath, Task
from streamrl.contracts.agents import Environment
from streamrl.recipe.user_files import load_user_file
from streamrl.tasks.dataset import DatasetConfig, DatasetTask


class AgentConfig(BaseModel):
    """``[task] name = "agent"``."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    path: RecipePath
    """The ``.py`` file holding the agent (relative to the recipe's folder)."""
    function: str | None = None
    """The rollout: ``async def <function>(client, row)`` returning the reward (a number, or a
    dict with ``"score"`` and other values to log, as rewards return). ``client`` is an
    ``openai.AsyncOpenAI`` pointed at the run's endpoint and tied to this rollout; ``row`` the
    dataset row. Exactly one of ``function`` and ``environment``."""
    environment: str | None = None
    """A class of the file subclassing :class:`streamrl.api.Environment`, run by streamrl's own
    rollout (``reset``, then a model reply and ``step`` per turn, up to ``max_turns``)."""
    data: DatasetConfig
    """``[task.data]``: the rows, as the ``dataset`` task reads them (``path``, ``prompt_key``,
    ``answer_key``...). The prompt field only has to exist; the agent reads what it needs."""
    rollout_timeout_s: float = Field(120.0, gt=0, le=3000)
    """A rollout still running after this many seconds is abandoned (a hung tool or agent loop):
    scored 0, counted with its error; its worker goes on with the others. At most 3000: the
    endpoint drops a rollout that made no call for an hour (its worker died), and a tool that ran
    longer would lose its rollout's first turns."""
    max_turns: int = Field(8, ge=1)
    """The most model replies of an ``environment`` rollout (a function rollout runs its own loop)."""
    max_tokens: int | None = Field(None, ge=1)
    """``max_tokens`` of each model call of an ``environment`` rollout (default: the engine's
    ``max_new_tokens``)."""
    seed: int = 0
    """Seed of the rows' shuffle (default: ``run.seed``), unless ``[task.data] seed`` is set."""
    model_path: PathOrHubId | None = None
    """The tokenizer the rows' chat prompts are read with (default: the recipe's model)."""
    _source: str = PrivateAttr(default="")

    @field_validator("function", "environment")
    @classmethod
    def _empty_is_unset(cls, value: str | None) -> str | None:
        return value or None  # (``--set task.function=""`` switches a recipe to its environment)

    @model_validator(mode="after")
    def _agent_defined(self) -> "AgentConfig":
        if (self.function is None) == (self.environment is None):
            raise ValueError("set exactly one of function (an async rollout function) and environment (a class)")
        try:
            loaded = load_user_file(self.path)
        except ValueError as e:
            raise ValueError(f"path: {e}") from None
        name = self.function or self.environment
        obj = getattr(loaded.module, name, None)
        if self.function is not None and not inspect.iscoroutinefunction(obj):
            raise ValueError(f"{self.path} defines no async function {name!r} "
                             "(expected: async def rollout(client, row) -> float | dict)")
        if self.environment is not None and not (isinstance(obj, type) and issubclass(obj, Environment)):
            raise ValueError(f"{self.path} defines no class {name!r} subclassing streamrl.api.Environment")
        self._source = loaded.source
        return self

    def spec(self) -> dict[str, Any]:
        """What an agent worker needs to run a rollout: the file's text and what to call in it."""
        return {"path": self.path, "source": self._source, "function": self.function,
                "environment": self.environment, "timeout_s": self.rollout_timeout_s,
                "max_turns": self.max_turns, "max_tokens": self.max_tokens}


class AgentTask(Task):
    """The rows of ``[task.data]``, handed out as the ``dataset`` task hands out its prompts (the
    same order, resumable by step); the agent workers roll each one out."""

    def __init__(self, config: AgentConfig):
        self.config = config
        data = config.data
        unset = {k: v for k, v in (("seed", config.seed), ("model_path", config.model_path))
                 if k not in data.model_fields_set and v is not None}
        self.rows = DatasetTask(data.model_copy(update=unset), where="task.data")

    def prompts(self, step: int, n: int) -> list[Prompt]:
        """Rows ``step * n .. step * n + n - 1`` of the shuffled data; ``Prompt.columns`` is the row."""
        return self.rows.prompts(step, n)

    def eval_prompts(self) -> list[Prompt]:
        """None: an agent is evaluated by its rollouts' rewards, which every step records."""
        return []
