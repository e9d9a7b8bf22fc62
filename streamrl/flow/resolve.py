"""Phase two of validation, done once: every component a recipe names is found and its section
validated, giving a :class:`Resolved` that the controller builds from. Needs no cluster."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from streamrl.api import Component
from streamrl.errors import UserError
from streamrl.plugins import Registry, build_registry
from streamrl.recipe import SECTIONS, LoadedRecipe, Recipe, check_pools, validate_section, with_run_defaults


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
    chosen = {path: Chosen(comp, validate_section(comp.config, with_run_defaults(comp.config, sec.options(), r.run.seed,
                                                                                 model), path, loaded.base))
              for comp, (path, _, sec) in zip(found, named)}
    check_pools(r)
    sinks = [chosen.pop(path) for path, kind, _ in named if kind == "metric_sink"]
    out = Resolved(loaded, registry, sinks=sinks, **{section: chosen.get(section) for section in SECTIONS})
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
            raise UserError(f"model.path: no transformers model at {path} "
                            f"(make one with: streamrl model init --task {r.task.name} --out {r.model.path}, "
                            "or with a known architecture's shapes: --arch qwen2.5-0.5b --random)")
        weights = [*path.glob("*.safetensors"), *path.glob("pytorch_model*.bin"), *path.glob("*.safetensors.index.json")]
        if not weights:
            raise UserError(f"model.path: {path} has a config.json but no weights "
                            "(expected model.safetensors or pytorch_model.bin)")
    return out
