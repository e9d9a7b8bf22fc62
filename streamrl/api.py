"""Everything a plugin touches, in one import: ``from streamrl.api import ...``.

A *component* is a named, configurable piece a recipe picks by name. There are ten kinds; each
has a base class here with its contract in typed methods, documented optional methods (with the
default streamrl uses when you do not override them) and ``close()``. Engines and trainers also
declare what they can do before they are built, in one place: the classmethod
``capabilities(config)`` returning an :class:`EngineCapabilities` or a
:class:`TrainerCapabilities`. Subclass the base class of your kind: streamrl calls the optional
methods it documents, so the defaults come from there (a few flags, such as a scheduler's
``moves_samples``, are also read with their default from an object that lacks them).

================  =====================  ==============================  ======================
kind              recipe section         base class                      lives on
================  =====================  ==============================  ======================
``task``          ``[task]``             :class:`Task`                   the ``streamrl`` process
``engine``        ``[engine]``           :class:`Engine`                 each generate worker
``reward``        ``[reward]``           :class:`Reward`                 each reward worker
``algorithm``     ``[algorithm]``        :class:`Algorithm`              inside the trainer
``trainer``       ``[trainer]``          :class:`Trainer`                the train worker
``transfer``      ``[transfer]``         :class:`Transfer`               train and generate workers
``metric_sink``   ``[[metrics]]``        :class:`MetricSink`             the ``streamrl`` process
``ranker``        ``[ranker]``           :class:`Ranker`                 the rank worker
``scheduler``     ``[scheduler]``        :class:`Scheduler`              the ``streamrl`` process
``tool_parser``   ``serve.tool_parser``  :class:`ToolParser`             the serving generate worker
================  =====================  ==============================  ======================

Besides the base classes, a few pieces the built-ins are made of, for plugins to build on:
:class:`ClippedSurrogate` (with :class:`ClippedConfig`), the PPO clipped loss an algorithm gets by
giving only ``advantages``; :func:`fit_decode_latency`, the affine decode-step profile an engine
returns from ``decode_latency``; :class:`Environment`, the gym-style shape of an agent task.
A feature of the step loop that is not a component is a :class:`StepExtension`, added by the
``add_step_extensions`` hook and handed the run's :class:`RunContext`.

Components built on workers are shipped there by value (cloudpickle), so a component defined
in a file next to the recipe works without installing anything; an installed package must be
installed wherever workers run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from pydantic import BaseModel

from streamrl import hookimpl
from streamrl.sample import Group, Prompt, Sample

#: The kinds of component, each with the hook that registers it and the recipe section naming it.
KINDS = {
    "algorithm": "register_algorithms",
    "engine": "register_engines",
    "reward": "register_rewards",
    "task": "register_tasks",
    "trainer": "register_trainers",
    "transfer": "register_transfers",
    "metric_sink": "register_metric_sinks",
    "ranker": "register_rankers",
    "scheduler": "register_schedulers",
    "tool_parser": "register_tool_parsers",
}


@dataclass(frozen=True)
class Component:
    """A named, configurable piece handed over by a plugin's ``register_*`` hook.

    ``config`` is a pydantic model validating the component's recipe section (every key but
    ``name``); ``factory(config)`` builds the object (a trainer's factory also gets a
    :class:`TrainerContext`). ``plugin`` is filled in by streamrl.
    """

    kind: str
    name: str
    config: type[BaseModel]
    factory: Callable[..., Any]
    plugin: str = field(default="", compare=False)

    def validate(self, section: dict, path: str) -> BaseModel:
        """The recipe table at TOML ``path`` validated by :attr:`config` (one-line errors)."""
        from streamrl.recipe.recipe import validate_section

        return validate_section(self.config, section, path)

    def capabilities(self, config: BaseModel) -> Any:
        """What the component declares for its validated ``config`` before it is built: an
        :class:`EngineCapabilities` for an engine, a :class:`TrainerCapabilities` for a trainer
        (the only kinds that declare any). The factory's own ``capabilities(config)`` when it is
        a subclass of the kind's base class; a factory that is a plain function declares
        nothing, so it gets the kind's defaults."""
        base = DECLARING.get(self.kind)
        if base is None:
            raise TypeError(f"{self.kind} components declare no capabilities (only {', '.join(DECLARING)} do)")
        f = self.factory
        return (f if isinstance(f, type) and issubclass(f, base) else base).capabilities(config)

    def build(self, section: dict, path: str, *args) -> Any:
        """Validate ``section`` and build the component (``args`` follow the config)."""
        return self.factory(self.validate(section, path), *args)

def close_component(obj: Any) -> None:
    """Close a built component. Every base class here has ``close()``; an object from a
    plain-function factory need not subclass one, so this is the one place that allows it to
    have none (the counterpart of :meth:`Component.capabilities` for built objects)."""
    close = getattr(obj, "close", None)
    if close is not None:
        close()


from streamrl.recipe.paths import PathOrHubId, RecipePath  # noqa: E402  (config field types for paths)
from streamrl.algorithms.clipped import ClippedConfig, ClippedSurrogate
from streamrl.contracts.agents import Environment, ToolParser
from streamrl.contracts.dispatch import Assignment, DispatchContext, Ranker, Scheduler
from streamrl.contracts.generation import (Engine, EngineCapabilities, ReceiveMissed, RequestsNow, Transfer,
                                          fit_decode_latency)
from streamrl.contracts.inputs import Reward, Task
from streamrl.contracts.learning import Algorithm, Trainer, TrainerCapabilities, TrainerContext, TrainerFootprint
from streamrl.contracts.observing import MetricSink
from streamrl.contracts.step_extension import RunContext, StepExtension

#: The kinds that declare capabilities before they are built, with the base class declaring
#: their defaults (:meth:`Component.capabilities`).
DECLARING = {"engine": Engine, "trainer": Trainer}

__all__ = [
    "KINDS", "Component", "close_component", "hookimpl", "RecipePath", "PathOrHubId", "Prompt", "Sample", "Group",
    "Task", "Reward", "Engine", "EngineCapabilities", "RequestsNow", "Transfer", "ReceiveMissed", "Algorithm", "Trainer",
    "TrainerCapabilities", "TrainerContext", "TrainerFootprint",
    "Ranker", "Scheduler", "Assignment", "DispatchContext", "MetricSink", "ToolParser", "Environment",
    "StepExtension", "RunContext",
    # helpers a plugin builds on: the clipped policy-gradient loss, an engine's decode profile
    "ClippedSurrogate", "ClippedConfig", "fit_decode_latency",
]
