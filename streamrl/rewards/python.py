"""``python``: a reward written as plain Python functions in a ``.py`` file, in verl's or TRL's
convention, so reward code written for either runs unchanged.

The parameters of a function decide how it is called:

- ``(data_source, solution_str, ground_truth, extra_info=None)``, verl's ``compute_score``:
  once per response; returns a number, or a dict with ``"score"`` and other values to log.
- ``(prompts, completions, **kwargs)``, a TRL reward function: once per group (one prompt's
  samples), with lists; returns one number (or None: no reward from this function) per response.
- ``(prompt, response)``: streamrl's own :meth:`Reward.score` as a function (a
  :class:`~streamrl.sample.Prompt` and the decoded text).

Several functions (``[[reward.functions]]``) are summed with their weights. The file is read
when the recipe is validated (so a missing file or function is a one-line error before any
worker starts) and its text travels with the reward to the workers, where it is imported once
per reward worker: the file only has to exist where ``streamrl`` runs.
"""

from __future__ import annotations

import copy
import inspect
import math
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any, Callable

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from streamrl.api import RecipePath, Reward
from streamrl.errors import UserError
from streamrl.recipe.user_files import exec_user_source, load_user_file
from streamrl.rewards.scoring import reward_value
from streamrl.sample import Prompt

#: the calling conventions a function's parameters select (see the module's docstring)
VERL, TRL, PLAIN = "verl", "trl", "plain"

#: what verl's reward managers pass a ``compute_score``, by keyword
VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")

#: what TRL passes but streamrl cannot (no token ids or trainer state reach a reward)
TRL_NOT_PASSED = ("completion_ids", "trainer_state")

_KEYWORDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


class _NotDefined(ValueError):
    """The file has no function of that name."""


class RewardFunctionError(Exception):
    """A reward function raised, or returned something that is not a score (the message names
    the function)."""


def convention(fn: Callable) -> str:
    """How ``fn`` is called, from its parameters: :data:`VERL`, :data:`TRL` or :data:`PLAIN`
    (``ValueError``: none of them, or a parameter streamrl cannot fill)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        raise ValueError(f"cannot read the parameters of {fn!r}") from None
    names = [p.name for p in params.values() if p.kind is not inspect.Parameter.VAR_KEYWORD
             and p.kind is not inspect.Parameter.VAR_POSITIONAL]
    required = [p.name for p in params.values() if p.default is inspect.Parameter.empty
                and p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)]
    # (a required one: one with a default is left to its default by a call by name)
    positional = [p.name for p in params.values()
                  if p.kind is inspect.Parameter.POSITIONAL_ONLY and p.default is inspect.Parameter.empty]
    if positional and ("solution_str" in names or names[:2] == ["prompts", "completions"]):
        # (verl's and TRL's conventions pass every argument by name: each call would fail)
        raise ValueError(f"takes {', '.join(positional)} positionally only (before '/'); verl's and TRL's "
                         "conventions pass arguments by name: remove the '/'")
    if "solution_str" in names:
        extra = [n for n in required if n not in VERL_ARGS]
        if extra:
            raise ValueError(f"needs {', '.join(extra)}, which verl's convention does not pass "
                             f"(it passes {', '.join(VERL_ARGS)})")
        return VERL
    if names[:2] == ["prompts", "completions"]:
        missing = [n for n in required if n in TRL_NOT_PASSED]
        if missing:
            raise ValueError(f"needs {', '.join(missing)}, which streamrl does not pass (give it a default)")
        return TRL
    if names[:2] == ["prompt", "response"]:
        return PLAIN
    raise ValueError(f"cannot tell how to call it from its parameters ({', '.join(names) or 'none'}): expected "
                     "(data_source, solution_str, ground_truth, extra_info=None) as verl, "
                     "(prompts, completions, **kwargs) as TRL, or (prompt, response)")


def _find(path: str, name: str) -> str:
    """The convention of function ``name`` of the file at ``path`` (``ValueError`` if it has none)."""
    module = load_user_file(path).module
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        defined = sorted(k for k, v in vars(module).items()
                         if inspect.isfunction(v) and v.__module__ == module.__name__)
        raise _NotDefined(f"{Path(path).name} defines no function {name!r} "
                         f"(it defines: {', '.join(defined) or 'none'})")
    return convention(fn)


def _loads(path: str | None) -> str | None:
    """A reward file must import: it is run at validation, so a typo in it is one line then."""
    if path is not None:
        load_user_file(path)
    return path


#: A reward file's path (relative to the recipe's folder), imported when the recipe is validated.
RewardFile = Annotated[RecipePath | None, AfterValidator(_loads)]


class FunctionConfig(BaseModel):
    """One function of a weighted sum (a ``[[reward.functions]]`` table)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    path: RewardFile = None
    """The ``.py`` file defining it (relative to the recipe's folder); default: ``reward.path``."""
    function: str
    """The function's name in that file."""
    weight: float = 1.0
    """Its weight in the sum that is the sample's reward."""
    name: str = ""
    """The name its values are logged under (``reward/<name>/mean``); default: the function's."""

    @field_validator("function")
    @classmethod
    def _defined(cls, function: str, info) -> str:
        if "path" not in info.data:  # (the path itself is wrong: that error is reported)
            return function
        path = info.data["path"]
        if path is None:
            raise ValueError("no file: give path here or reward.path")
        _find(path, function)
        return function


class PythonRewardConfig(BaseModel):
    """``[reward] name = "python"``: one function (``path``, ``function``) or a weighted sum of
    several (``[[reward.functions]]``, each file defaulting to ``path``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    path: RewardFile = None
    """The ``.py`` file defining the reward function (relative to the recipe's folder); with
    ``[[reward.functions]]``, the file of those that name none."""
    function: str | None = None
    """The function's name; default ``compute_score`` (verl's name). Not with ``[[reward.functions]]``."""
    functions: list[FunctionConfig] = Field(default_factory=list)
    """Several functions whose weighted sum is the reward; each one's mean is logged per step as
    ``reward/<name>/mean``."""
    _sources: dict[str, str] = PrivateAttr(default_factory=dict)
    # the text of each file, read at validation: it travels to the workers with the config

    @model_validator(mode="before")
    @classmethod
    def _shape(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        functions = data.get("functions")
        if functions and data.get("function") is not None:
            raise UserError("reward.function: give either function or [[reward.functions]] tables, not both")
        if not functions and data.get("path") is None:
            raise UserError('reward.path: required key missing; expected the .py file defining the reward '
                            '(path = "my_reward.py", with function = "<name>" unless it is compute_score)')
        if isinstance(functions, list) and "path" in data:  # each table's file defaults to reward.path
            data = {**data, "functions": [{"path": data["path"], **f} if isinstance(f, dict) else f
                                          for f in functions]}
        return data

    @field_validator("function")
    @classmethod
    def _defined(cls, function: str | None, info) -> str | None:
        if function is not None and info.data.get("path") is not None:
            _find(info.data["path"], function)
        return function

    @model_validator(mode="after")
    def _read(self) -> PythonRewardConfig:
        if not self.functions:
            function = self.function or "compute_score"
            try:
                _find(self.path, function)
            except ValueError as exc:
                missing = isinstance(exc, _NotDefined) and not self.function
                hint = '; name it with function = "<name>"' if missing else ""
                raise UserError(f"reward.function: {exc}{hint}") from None
        names = [f.name or f.function for f in self.functions]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise UserError(f"reward.functions: {', '.join(twice)} named twice; give each a distinct name = \"...\"")
        if len(names) > 1 and "score" in names:  # (its value would be logged over the weighted sum's)
            raise UserError('reward.functions: a function named "score" would hide the weighted sum, the reward '
                            'itself; give it another name = "..."')
        for path in {self.path, *(f.path for f in self.functions)} - {None}:
            self._sources[path] = load_user_file(path).source
        return self

    def chosen(self) -> list[tuple[str, str, str, float]]:
        """``(path, function, name, weight)`` of every function summed."""
        if not self.functions:
            function = self.function or "compute_score"
            return [(self.path, function, function, 1.0)]
        return [(f.path, f.function, f.name or f.function, f.weight) for f in self.functions]


@dataclass
class _Function:
    name: str
    fn: Callable
    convention: str
    weight: float
    params: frozenset[str]
    """Keyword parameters it names (what it is given beyond those is left out)."""
    any_keyword: bool
    """It takes ``**kwargs`` (everything is passed)."""


def _original_prompt(prompt: Prompt) -> Any:
    # the dataset's own prompt (a string, or chat messages) when the task kept it; else the text
    return prompt.columns.get("prompt", prompt.text)


def _ground_truth(prompt: Prompt) -> Any:
    reward_model = prompt.columns.get("reward_model")
    if isinstance(reward_model, dict) and "ground_truth" in reward_model:
        return reward_model["ground_truth"]
    return prompt.answer


def _value(raw: Any, conv: str) -> tuple[float | None, dict[str, float]]:
    """(score or None, named values) of one function's result for one response."""
    if raw is None:
        if conv == TRL:  # TRL's "this function gives this sample no reward"
            return None, {}
        raise TypeError("returned None; expected a number or a dict with 'score'")
    if isinstance(raw, (str, bytes)) or (not isinstance(raw, dict) and not hasattr(type(raw), "__float__")):
        raise TypeError(f"returned {type(raw).__name__}; expected a number or a dict with 'score'")
    # finite here; the weighted total is held to the run's ``reward.limit`` where it is scored
    return reward_value(raw, limit=math.inf)


class PythonReward(Reward):
    """Scores with the recipe's Python functions (see the module's docstring for how each is
    called). Thread-safe as far as the functions are: a reward worker calls them from several
    threads at once."""

    def __init__(self, config: PythonRewardConfig):
        self.config = config
        modules: dict[str, ModuleType] = {}
        self.functions: list[_Function] = []
        for path, function, name, weight in config.chosen():
            if path not in modules:
                source = config._sources.get(path)
                modules[path] = exec_user_source(path, source) if source is not None else load_user_file(path).module
            fn = getattr(modules[path], function)
            params = inspect.signature(fn).parameters.values()
            self.functions.append(_Function(
                name, fn, convention(fn), weight, frozenset(p.name for p in params if p.kind in _KEYWORDS),
                any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)))

    def __reduce__(self):
        # rebuilt from the config (which carries the files' text), never from the loaded modules
        return PythonReward, (self.config,)

    def scores_groups(self) -> bool:
        """Whether a group is scored in one call: only when a TRL function (which takes the
        whole list) is among the functions. verl's and plain functions score one response at a
        time, so streamrl calls them response by response, each within ``reward.score_timeout_s``:
        one that loops costs its own allowance once, not the group's and then its own again."""
        return any(f.convention == TRL for f in self.functions)

    def score(self, prompt: Prompt, response: str) -> dict[str, float]:
        """The weighted sum of the functions' scores, with the named values beside it."""
        (value,) = self.score_group([prompt], [response])
        if isinstance(value, Exception):
            raise value
        return value

    def score_group(self, prompts: list[Prompt], responses: list[str]) -> list:
        """Every response's score dict (or the exception it failed with): TRL functions are
        called once for the whole list, the others once per response."""
        n = len(responses)
        totals: list[float] = [0.0] * n
        infos: list[dict[str, float]] = [{} for _ in range(n)]
        failed: list[Exception | None] = [None] * n
        several = len(self.functions) > 1
        for f in self.functions:
            for i, result in enumerate(self._call(f, prompts, responses)):
                if failed[i] is not None:
                    continue
                try:
                    if isinstance(result, Exception):
                        raise result
                    score, extra = _value(result, f.convention)
                except Exception as exc:
                    failed[i] = exc if isinstance(exc, RewardFunctionError) else RewardFunctionError(
                        f"{f.name}: {type(exc).__name__}: {exc}")
                    continue
                totals[i] += f.weight * (score or 0.0)
                prefix = f"{f.name}/" if several else ""
                if several and score is not None:
                    infos[i][f.name] = score
                if f.convention == TRL:  # how often it gave no reward (an unchecked sample scores 0)
                    infos[i][f"{prefix}none"] = float(score is None)
                infos[i].update({f"{prefix}{k}": v for k, v in extra.items()})
        return [failed[i] if failed[i] is not None else {"score": totals[i], **infos[i]} for i in range(n)]

    def _call(self, f: _Function, prompts: list[Prompt], responses: list[str]) -> list:
        """One result (or exception) per response from function ``f``."""
        if f.convention != TRL:
            out = []
            for prompt, response in zip(prompts, responses):
                try:
                    out.append(f.fn(prompt, response) if f.convention == PLAIN
                               else f.fn(**self._verl(f, prompt, response)))
                except Exception as exc:
                    out.append(exc)
            return out
        try:
            return self._trl(f, prompts, responses)
        except Exception:  # (the batch failed) each response alone, so one bad one fails alone
            out = []
            for prompt, response in zip(prompts, responses):
                try:
                    out.extend(self._trl(f, [prompt], [response]))
                except Exception as exc:
                    out.append(exc)
            return out

    @staticmethod
    def _verl(f: _Function, prompt: Prompt, response: str) -> dict[str, Any]:
        # as verl's reward managers: extra_info is the row's (a copy: a group's samples share the
        # row), an empty dict where the row has none, and what the row holds where it is not a
        # dict (a CSV's text): the function, not the call, decides what to make of it
        extra_info = prompt.columns.get("extra_info")
        extra_info = {} if extra_info is None else copy.deepcopy(extra_info)
        args = {"data_source": prompt.columns.get("data_source"), "solution_str": response,
                "ground_truth": _ground_truth(prompt), "extra_info": extra_info}
        return args if f.any_keyword else {k: v for k, v in args.items() if k in f.params}

    @staticmethod
    def _trl(f: _Function, prompts: list[Prompt], responses: list[str]) -> list:
        originals = [_original_prompt(p) for p in prompts]
        # as TRL: a chat prompt (a list of messages) gets its completion as messages too
        completions = [[{"role": "assistant", "content": r}] if isinstance(o, list) else r
                       for o, r in zip(originals, responses)]
        columns = {k for p in prompts for k in p.columns} - {"prompt", "prompts", "completions"}
        kwargs = {k: [p.columns.get(k) for p in prompts] for k in sorted(columns)}
        if "answer" not in kwargs and any(p.answer is not None for p in prompts):
            kwargs["answer"] = [p.answer for p in prompts]  # a task's own answer, when its rows have none
        if not f.any_keyword:
            kwargs = {k: v for k, v in kwargs.items() if k in f.params}
        out = f.fn(prompts=originals, completions=completions, **kwargs)
        if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__"):
            raise TypeError(f"returned {type(out).__name__}; expected a list of one score per completion")
        out = list(out)
        if len(out) != len(responses):
            raise ValueError(f"returned {len(out)} scores for {len(responses)} completions")
        return out
