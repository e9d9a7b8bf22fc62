"""Phase two of validation, done once: every component a recipe names is found and its section
validated, giving a :class:`Resolved` that the controller builds from. Needs no cluster."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from streamrl.api import Component
from streamrl.errors import UserError
from streamrl.plugins import Registry, build_registry
from streamrl.recipe import SECTIONS, LoadedRecipe, Recipe, check_pools, validate_section


@dataclass
class Chosen:
    """A component picked by the recipe, with its validated config."""

    component: Component
    config: BaseModel

    def build(self, *args) -> Any:
        """Build the object (``args`` after the config, e.g. a trainer's context)."""
        return self.component.factory(self.config, *args)

    def capabilities(self) -> Any:
        """What the component declares for this config (an engine's or a trainer's:
        :meth:`Component.capabilities`)."""
        return self.component.capabilities(self.config)


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

    @property
    def recipe(self) -> Recipe:
        """The validated recipe."""
        return self.loaded.recipe

    @property
    def model_path(self) -> str | None:
        """Absolute path of the policy model folder, or None."""
        path = self.loaded.model_path()
        return str(path) if path else None


def with_seed(config: type[BaseModel], section: dict, seed: int) -> dict:
    """``section`` with ``seed`` filled in from ``run.seed`` when the config has a ``seed`` field
    the recipe left unset."""
    if "seed" in config.model_fields and "seed" not in section:
        return {**section, "seed": seed}
    return section


def choose(registry: Registry, kind: str, name: str, options: dict, path: str, seed: int) -> Chosen:
    """Find component ``name`` of ``kind`` and validate its section (TOML ``path``)."""
    comp = registry.get(kind, name, f"{path}.name")
    return Chosen(comp, validate_section(comp.config, with_seed(comp.config, options, seed), path))


def resolve(loaded: LoadedRecipe) -> Resolved:
    """Load the plugins, find every named component and validate its section, check the model."""
    r = loaded.recipe
    check_pools(r)
    registry = build_registry(r.plugins.modules, loaded.base)
    chosen: dict[str, Chosen | None] = {}
    tables = dict(r)  # section name -> its table
    for section, kind in SECTIONS.items():
        sec = tables[section]
        chosen[section] = None if sec is None else choose(registry, kind, sec.name, sec.options(), section, r.run.seed)
    sinks = [choose(registry, "metric_sink", sec.name, sec.options(), f"metrics[{i}]", r.run.seed)
             for i, sec in enumerate(r.metrics)]
    out = Resolved(loaded, registry, sinks=sinks, **chosen)
    needs_model = [f'{s}.name = "{tables[s].name}"' for s, c in (("engine", out.engine), ("trainer", out.trainer))
                   if c.capabilities().needs_model]
    if needs_model:
        path = loaded.model_path()
        if path is None:
            raise UserError(f'model: missing; {needs_model[0]} needs one: '
                            'add a [model] table with path = "<folder of a transformers model>"')
        if not (path / "config.json").is_file():
            raise UserError(f"model.path: no transformers model at {path} "
                            f"(make one with: streamrl model init --task {r.task.name} --out {r.model.path}, "
                            "or with a known architecture's shapes: --arch qwen2.5-0.5b --random)")
        weights = [*path.glob("*.safetensors"), *path.glob("pytorch_model*.bin"), *path.glob("*.safetensors.index.json")]
        if not weights:
            raise UserError(f"model.path: {path} has a config.json but no weights "
                            "(expected model.safetensors or pytorch_model.bin)")
    return out
