"""Phase two of validation, done once: every component a recipe names is found and its section
validated, giving a :class:`Resolved` that the controller builds from. Needs no cluster."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from streamrl.recipe.learners import INITIAL, main_learner, served_name
from streamrl.api import Algorithm, Component, EngineCapabilities, TrainerCapabilities
from streamrl.algorithms.dr_grpo import DrGRPO
from streamrl.errors import RunWarning, UserError
from streamrl.models.fetch import KNOWN
from streamrl.plugins.model_folder import check_positions, model_positions, say_sampling
from streamrl.plugins.registry import Registry, build_registry
from streamrl.recipe.recipe import SECTIONS, LoadedRecipe, Recipe, check_pools, validate_section, with_run_defaults
from streamrl.recipe.serve import ServeConfig
from streamrl.tasks.agent import AgentTask
from streamrl.telemetry.text import error_line, message_line


@dataclass
class Chosen:
    """A component picked by the recipe, with its validated config."""

    component: Component
    config: BaseModel

    def build(self, *args) -> Any:
        """Build the object (``args`` after the config, e.g. a trainer's context)."""
        return self.component.factory(self.config, *args)

    def build_here(self, *args) -> Any:
        """:meth:`build` in this process, where a constructor that raises (a task whose data is
        missing, a scheduler given a wrong value) is one line naming the component:
        :class:`UserError`, not a traceback through streamrl. (On a worker,
        ``on_worker/resident.py`` does the same with a :class:`ComponentError`.)"""
        try:
            return self.build(*args)
        except (Exception, SystemExit) as exc:  # (a constructor that exits, as argparse does, too)
            where = f", from plugin {self.component.plugin}" if self.component.plugin else ""
            raise UserError(f"{self.component.kind} {self.component.name!r} could not be built{where}: "
                            f"{error_line(exc, 300)}") from exc

    def capabilities(self) -> Any:
        """What the component declares for this config (an engine's or a trainer's:
        :meth:`Component.capabilities`). A plugin's ``capabilities()`` that raises, or returns
        what is not the kind's capabilities, is one line naming it (:class:`UserError`)."""
        c = self.component
        where = f", from plugin {c.plugin}" if c.plugin else ""
        try:
            can = c.capabilities(self.config)
        except (Exception, SystemExit) as exc:
            raise UserError(f"{c.kind} {c.name!r}{where}: capabilities() raised {type(exc).__name__}: "
                            f"{message_line(exc)}") from None
        expected = {"engine": EngineCapabilities, "trainer": TrainerCapabilities}.get(c.kind)
        if expected is not None and not isinstance(can, expected):
            raise UserError(f"{c.kind} {c.name!r}{where}: capabilities() returned {type(can).__name__}; expected "
                            f"{expected.__name__} (from streamrl.api import {expected.__name__})")
        return can


@dataclass
class LearnerPlan:
    """A learner with its components found and configured."""

    name: str
    algorithm: Chosen
    trainer: Chosen
    queue: int = 2
    when_full: str = "skip"
    served: bool = False
    """The generate pool serves this learner's weights."""
    added: bool = False
    """Added while the run went on (``streamrl learners add``)."""
    table: dict = None
    """Its ``[[learners]]`` table as written (a checkpoint keeps it, to place it again)."""

    @property
    def resident(self) -> str:
        """The name its trainer is held under on its worker."""
        return f"streamrl-trainer-{self.name}"

    @property
    def worker(self) -> str:
        """The name of the worker it trains on: ``learner-<name>``, or ``learner-<worker>`` when
        its table shares one (``worker``)."""
        return f"learner-{(self.table or {}).get('worker') or self.name}"


@dataclass
class Resolved:
    """A recipe whose components are all found and configured."""

    loaded: LoadedRecipe
    registry: Registry
    task: Chosen
    engine: Chosen
    reward: Chosen
    algorithm: Chosen
    trainer: Chosen
    transfer: Chosen
    ranker: Chosen | None
    scheduler: Chosen | None
    sinks: list[Chosen]
    learners: list[LearnerPlan] = None
    """Every learner, the main one (which ``algorithm`` and ``trainer`` above are) first; one
    for a recipe without ``[[learners]]``."""

    @property
    def side_learners(self) -> list[LearnerPlan]:
        """The learners that train on their own workers (all but the first)."""
        return self.learners[1:]

    @property
    def serves_initial(self) -> bool:
        """The generate pool keeps the starting model (``run.serve = "initial"``)."""
        return self.recipe.run.serve == INITIAL

    def build_scheduler(self) -> Any:
        """The recipe's scheduler built in this process (schedulers are pure policy: light), or
        None when the recipe names none."""
        return self.scheduler.build_here() if self.scheduler is not None else None

    @property
    def recipe(self) -> Recipe:
        """The validated recipe."""
        return self.loaded.recipe

    @property
    def model_path(self) -> str | None:
        """Absolute path of the policy model folder, or None."""
        path = self.loaded.model_path()
        return str(path) if path else None


def resolve(loaded: LoadedRecipe) -> Resolved:
    """Load the plugins, find every named component and validate its section, check the pools
    and the model."""
    r = loaded.recipe
    registry = build_registry(r.plugins.modules, loaded.base)
    tables = dict(r)  # section name -> its table
    # (TOML path, kind, table) of every component the recipe names, the metric sinks last
    named = [(section, kind, tables[section]) for section, kind in SECTIONS.items() if tables[section] is not None]
    named += [(f"metrics[{i}]", "metric_sink", sec) for i, sec in enumerate(r.metrics)]
    found = [registry.get(kind, sec.name, f"{path}.name") for path, kind, sec in named]
    model = loaded.model_path()
    chosen: dict[str, Chosen] = {}
    prompt_limit = positions = None
    # the engine first: the longest prompt it takes is the task's default limit, and without
    # one, the model's positions less the engine's max_new_tokens the longest a prompt can be
    for comp, (path, _, sec) in sorted(zip(found, named), key=lambda c: c[1][0] != "engine"):
        options = with_run_defaults(comp.config, sec.options(), r.run.seed, model,
                                    (r.scheduler is not None) if path == "engine" else None,
                                    prompt_limit if path == "task" else None, positions if path == "task" else None)
        chosen[path] = Chosen(comp, validate_section(comp.config, options, path, loaded.base))
        if path == "engine":
            can = chosen[path].capabilities()
            prompt_limit = can.max_prompt_tokens
            found_positions = model_positions(model) if model is not None and model.is_absolute() else None
            if found_positions and isinstance(can.max_new_tokens, int) and found_positions[1] > can.max_new_tokens:
                room = found_positions[1] - can.max_new_tokens
                if prompt_limit is None:
                    positions = room
                elif isinstance(prompt_limit, int) and room < prompt_limit:
                    # (a slot of max_prompt_tokens + max_new_tokens past the model's positions: a
                    # prompt longer than they leave would decode where the model never was)
                    prompt_limit = room
    check_pools(r)
    sinks = [chosen.pop(path) for path, kind, _ in named if kind == "metric_sink"]
    out = Resolved(loaded, registry, sinks=sinks, **{section: chosen.get(section) for section in SECTIONS})
    out.learners = _learners(out, model)
    out.algorithm, out.trainer = out.learners[0].algorithm, out.learners[0].trainer
    for plan in out.learners:
        check_algorithm(out, plan)
    _check_engine_can(out)
    _check_trainer_can(out)
    needs_model = [f'{s}.name = "{tables[s].name}"' for s, c in (("engine", out.engine), ("trainer", out.trainer))
                   if c.capabilities().needs_model]
    if needs_model:
        path = loaded.model_path()
        if path is not None and not path.is_absolute():  # a Hub id: checked where it is downloaded
            return out
        if path is None:
            raise UserError(f'model: missing; {needs_model[0]} needs one: '
                            'add a [model] table with path = "<folder of a transformers model>"')
        if not (path / "config.json").is_file():
            shown = os.path.relpath(path) if path.is_relative_to(Path.cwd()) else str(path)
            from streamrl.tasks.arch import ARCHS

            # (only a folder named for the shapes alone: "qwen2.5-0.5b-instruct" is a trained model)
            arch = next((a for a in ARCHS if path.name in (a, f"{a}-random")), None)
            how = (f"get it with: streamrl model fetch {path.name} --out {shown}" if path.name in KNOWN else
                   f"make one with random weights and its shapes: streamrl model init --arch {arch} --random "
                   f"--out {shown}" if arch else
                   f"make one with: streamrl model init --task {r.task.name} --out {shown}, or with a known "
                   "architecture's shapes: --arch qwen2.5-0.5b --random; a GGUF file: streamrl model import FILE --out DIR")
            raise UserError(f"model.path: no transformers model at {path} ({how})")
        weights = [*path.glob("*.safetensors"), *path.glob("pytorch_model*.bin"), *path.glob("*.safetensors.index.json")]
        if not weights:
            raise UserError(f"model.path: {path} has a config.json but no weights "
                            "(expected model.safetensors or pytorch_model.bin)")
        if out.engine.capabilities().needs_model:
            check_positions(out, path)
            say_sampling(out, path)
    return out


def _learners(out: Resolved, model: Path | None) -> list[LearnerPlan]:
    """The run's learners, the main one first (``recipe/learners.main_learner``): the recipe's
    ``[algorithm]`` and ``[trainer]`` alone, or each ``[[learners]]`` table over them."""
    r = out.recipe
    if not r.learners:
        return [LearnerPlan("main", out.algorithm, out.trainer, served=True)]
    served = served_name(r.learners, r.run.serve)
    main = main_learner(r.learners, r.run.serve)
    plans = [learner_plan(out, i, lr.model_dump(), served == lr.name, model)
             for i, lr in enumerate(r.learners)]
    return sorted(plans, key=lambda p: p.name != main)


def learner_plan(out: Resolved, index: int | str, table: dict, served: bool, model: Path | None = None) -> LearnerPlan:
    """One ``[[learners]]`` table (``recipe/learners.LearnerConfig`` as a dict) resolved against
    the recipe: its algorithm table over nothing (or the recipe's ``[algorithm]``), its trainer
    options over ``[trainer]``'s."""
    r, where = out.recipe, f"learners[{index}]"
    algo = dict(table.get("algorithm") or {"name": r.algorithm.name, **r.algorithm.options()})
    name = algo.pop("name", None)
    comp = out.registry.get("algorithm", name, f"{where}.algorithm.name")
    algorithm = Chosen(comp, validate_section(comp.config, with_run_defaults(comp.config, algo, r.run.seed, model),
                                              f"{where}.algorithm", out.loaded.base))
    tcomp = out.trainer.component
    options = {**r.trainer.options(), **(table.get("trainer") or {})}
    trainer = Chosen(tcomp, validate_section(tcomp.config, with_run_defaults(tcomp.config, options, r.run.seed, model),
                                             f"{where}.trainer", out.loaded.base))
    return LearnerPlan(table["name"], algorithm, trainer, queue=table.get("queue", 2),
                       when_full=table.get("when_full", "skip"), served=served, table=dict(table))


def check_algorithm(out: Resolved, plan: LearnerPlan) -> None:
    """What the trainer asks of an algorithm, checked before any cluster starts: a whole number
    of passes over each batch, and groups big enough for a group baseline (one that learns from
    the differences between a prompt's samples learns nothing from groups of one)."""
    r = out.recipe
    built = plan.algorithm.build_here()  # (algorithms are light: the controller builds one to ask, too)
    field = "algorithm" if plan.name == "main" else f"learner {plan.name!r}'s algorithm"
    epochs = getattr(built, "epochs", 1)  # (an object not built on Algorithm may leave it out: one pass)
    if isinstance(epochs, bool) or not isinstance(epochs, int) or not 1 <= epochs <= 1000:
        raise UserError(f"{field} {plan.algorithm.component.name!r}: its epochs is {epochs!r}; expected a whole number "
                        "of passes over each batch, 1 to 1000")
    need = built.min_group_size if isinstance(built, Algorithm) else 1  # (an object not built on it: no baseline)
    if r.trainer.samples_per_prompt < need:
        field = "algorithm.name" if plan.name == "main" else f"learner {plan.name!r}'s algorithm"
        raise UserError(f"trainer.samples_per_prompt: {r.trainer.samples_per_prompt} with {field} = "
                        f'"{plan.algorithm.component.name}", which learns from the differences between a prompt\'s samples '
                        f"(a group baseline, or a preference pair): a sample alone gets advantage 0 and nothing is "
                        f"learned; use {need} or more (8 is usual)")
    # an algorithm with running statistics (REINFORCE++'s normaliser) keeps them per trainer: on
    # several ranks each would normalise its own groups with its own, and a checkpoint keeps rank 0's
    ranks = r.pools.train.workers if r.pools.train is not None and not r.cluster.address else 1
    stateful = isinstance(built, Algorithm) and type(built).state_dict is not Algorithm.state_dict
    if stateful and ranks > 1 and out.learners and plan is out.learners[0]:
        raise UserError(f"pools.train.workers: {ranks} with {field}.name = \"{plan.algorithm.component.name}\", whose running "
                        "statistics are each trainer's own (every rank would normalise with its own, and a "
                        "checkpoint keeps one); use one train worker")
    # Dr. GRPO divides every sample's token sum by L_max, the generation budget: another
    # constant scales the whole loss (the learning rate against the gradient clip) without a word
    budget = out.engine.capabilities().max_new_tokens
    l_max = getattr(getattr(built, "config", None), "max_tokens", None) if isinstance(built, DrGRPO) else None
    if isinstance(l_max, int) and isinstance(budget, int) and l_max != budget:
        warnings.warn(RunWarning(f"{field} 'dr_grpo': max_tokens = {l_max} (L_max, each sample's token sum is "
                                 f"divided by it) is not the engine's max_new_tokens = {budget}; the loss is "
                                 f"{budget / l_max:.2g}x what the paper's would be (set max_tokens = {budget})"),
                      stacklevel=2)


def _check_engine_can(out: Resolved) -> None:
    """What the run asks of its engine, checked against what the engine declares
    (:class:`~streamrl.api.EngineCapabilities`) before any cluster starts: an endpoint (``[serve]``,
    an agent task) needs an engine that streams; a scheduler that moves running samples needs one
    that can hand a sample over."""
    r = out.recipe
    can = out.engine.capabilities()
    factory = out.task.component.factory
    agent = isinstance(factory, type) and issubclass(factory, AgentTask)
    wanted = "[serve]" if r.serve is not None else f'task.name = "{r.task.name}"' if agent else ""
    if wanted and not can.streams:
        raise UserError(f"engine: {wanted} serves from an endpoint, which needs an engine that streams each response's "
                        f"tokens; engine {r.engine.name!r} with these settings does not (its capabilities lack streams): "
                        'use [engine] name = "hf" with batching = "slots" (and reproducible = false)')
    if wanted:  # the run builds the tool parser as it starts: a name nobody registered, or bad options, found here
        (r.serve or ServeConfig()).build_tool_parser(out.registry)
    if getattr(out.build_scheduler(), "moves_samples", False) and not can.moves_samples:
        raise UserError(f"scheduler: {r.scheduler.name!r} moves running samples between instances, but engine "
                        f"{r.engine.name!r} with these settings cannot hand a sample over (its capabilities lack "
                        'moves_samples; the sim engine and hf with batching = "slots" can): set scheduler.migrate = '
                        "false or change the engine")


def _check_trainer_can(out: Resolved) -> None:
    """The train pool the recipe asks for, checked against what its trainer declares
    (:class:`~streamrl.api.TrainerCapabilities`) before any cluster starts: several train
    workers need a data-parallel trainer, and ``fsdp`` over them one that can shard. (The pool
    of a cluster someone else started is known once its workers are: ``flow/topology.py``.)"""
    r = out.recipe
    if r.cluster.address or r.pools.train is None:
        return
    refused = out.trainer.capabilities().refuses(r.trainer.name, r.pools.train.workers, r.trainer.strategy)
    if refused:
        raise UserError(refused)
