"""Recipes: TOML files that say what to run, validated before anything starts.

A recipe is parsed with ``tomllib``, ``--set a.b=value`` overrides are applied, and the result is
validated in two phases: first the core tables below (``extra="forbid"``, so a typo is an error),
then each component section (``[task]``, ``[engine]``, ``[reward]``, ``[algorithm]``,
``[transfer]``) by the config model of the plugin it names. Every error names the TOML path and
what was expected, on one line (:class:`streamrl.errors.UserError`).

Paths to inputs (``model.path``, ``plugins.modules``) are relative to the recipe file; the output
folder ``run.out_dir`` is relative to the current directory.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from streamrl.errors import UserError


class Strict(BaseModel):
    """Base for recipe tables: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class RunConfig(Strict):
    name: str = "run"
    """Name of the run; the run folder is ``<out_dir>/<name>-<timestamp>``."""
    mode: Literal["stream", "batch"] = "stream"
    """``stream``: samples flow into micro-batches as they finish (StreamRL). ``batch``: the trainer
    waits for the whole batch first (the disaggregated baseline). Both give the same update."""
    steps: int = Field(20, ge=1)
    """Number of optimizer steps (one per batch of ``trainer.prompts_per_step`` prompts)."""
    seed: int = 0
    """Seed for prompt sampling and model initialisation."""
    out_dir: str = "runs"
    """Folder (relative to the current directory) where run folders are created."""


class ClusterConfig(Strict):
    address: str = ""
    """Scheduler address (``tcp://host:8786``) of an existing Dask cluster. Empty: start an
    embedded local cluster from the ``[pools.*]`` tables."""
    host: str = "127.0.0.1"
    """Interface the embedded cluster (scheduler, workers, dashboard) listens on. The default keeps
    everything on this machine."""
    dashboard_port: int = Field(8787, ge=0, le=65535)
    """Port of the Dask dashboard of the embedded cluster (0 picks a free one)."""
    startup_timeout: float = Field(120.0, gt=0)
    """Seconds to wait for the workers of every pool to come up."""


class PoolConfig(Strict):
    workers: int = Field(1, ge=1)
    """Number of worker processes in this pool (one per GPU on a GPU machine)."""
    threads: int = Field(1, ge=1)
    """Task slots per worker. A generate worker needs several: each running generate task holds
    one prompt group inside the engine, which batches all of them together."""
    torch_threads: int = Field(1, ge=1)
    """``torch.set_num_threads`` inside the worker (Nanny workers start with OMP_NUM_THREADS=1)."""
    memory_limit: str = "auto"
    """Dask memory limit per worker (``"4GiB"``, ``"auto"``, or ``"0"`` for none)."""
    cuda_visible_devices: list[str] = []
    """GPU ids, one per worker, exported as CUDA_VISIBLE_DEVICES. Empty: CPU or inherited."""
    env: dict[str, str] = {}
    """Extra environment variables for this pool's workers."""


class PoolsConfig(Strict):
    generate: PoolConfig | None = None
    """Workers holding an inference engine; run generate tasks."""
    train: PoolConfig | None = None
    """Workers holding the policy being trained and its optimizer; run train tasks."""
    reward: PoolConfig | None = None
    """Workers that score responses; run reward tasks."""


class ModelConfig(Strict):
    path: str
    """Folder of a transformers model + tokenizer (``from_pretrained``), relative to the recipe."""


class TrainerConfig(Strict):
    lr: float = Field(1e-4, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps over which the learning rate rises linearly from ~0 to ``lr``. Adam's first
    steps move every weight by about ``lr`` whatever the gradient's size; a warm-up keeps noisy
    early RL gradients from wrecking a small policy."""
    max_grad_norm: float = Field(1.0, ge=0)
    """Gradient clipping norm before each optimizer step (0 disables)."""
    prompts_per_step: int = Field(16, ge=1)
    """Prompts (groups) per optimizer step."""
    samples_per_prompt: int = Field(8, ge=1)
    """Samples generated per prompt (the group size of GRPO)."""
    groups_per_micro_batch: int = Field(4, ge=1)
    """Prompt groups per forward/backward micro-batch; gradients accumulate across micro-batches."""


class PluginsConfig(Strict):
    modules: list[str] = []
    """Plugin modules loaded from files for this recipe only, relative to the recipe file."""


class Section(BaseModel):
    """A component section: ``name`` picks the component, the other keys belong to its plugin."""

    model_config = ConfigDict(extra="allow")
    name: str
    """Name of the registered component (see ``streamrl plugins list``)."""

    def options(self) -> dict[str, Any]:
        """The plugin-owned keys of this section."""
        return dict(self.model_extra or {})


class Recipe(Strict):
    run: RunConfig = RunConfig()
    """What to run and for how long."""
    cluster: ClusterConfig = ClusterConfig()
    """Where to run it."""
    pools: PoolsConfig = PoolsConfig()
    """The labelled pools of the embedded cluster."""
    model: ModelConfig
    """The policy model."""
    trainer: TrainerConfig = TrainerConfig()
    """Optimizer and batch shape."""
    task: Section
    """Prompt source (a ``task`` component)."""
    engine: Section = Section(name="hf")
    """Inference engine on the generate pool (an ``engine`` component)."""
    reward: Section
    """Reward function (a ``reward`` component)."""
    algorithm: Section = Section(name="grpo")
    """RL algorithm (an ``algorithm`` component)."""
    transfer: Section = Section(name="dask")
    """Weight transport from trainer to generators (a ``transport`` component)."""
    plugins: PluginsConfig = PluginsConfig()
    """Recipe-local plugins."""
    metrics: list[Section] = []
    """Extra metric sinks (``[[metrics]]`` tables, each a ``metric_sink`` component);
    ``metrics.jsonl`` is always written."""


#: The pools every run needs, with what they are for (used in error messages).
REQUIRED_POOLS = {"generate": "runs generate tasks", "train": "runs train tasks", "reward": "runs reward tasks"}

#: Component sections and the kind of component each names.
SECTIONS = {"task": "task", "engine": "engine", "reward": "reward", "algorithm": "algorithm",
            "transfer": "transport"}


def _describe(err: dict) -> str:
    loc = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        return f"{loc}: unknown key"
    if err["type"] == "missing":
        return f"{loc}: required key missing"
    msg = err["msg"].replace("Input should be", "expected")
    return f"{loc}: {msg} (got {err.get('input')!r})"


def validate_section(model: type[BaseModel], data: dict, path: str = "") -> BaseModel:
    """Validate ``data`` with ``model``; errors name the TOML path (``path.key``) in one line."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = _describe(exc.errors()[0])
        more = len(exc.errors()) - 1
        suffix = f" (and {more} more error{'s' if more > 1 else ''})" if more else ""
        raise UserError(f"{path + '.' if path else ''}{first}{suffix}") from None


def parse_override(item: str) -> tuple[list[str], Any]:
    """Parse ``a.b=value``; the value is read as TOML (``1e-5``, ``true``, ``"x"``), else a string."""
    if "=" not in item:
        raise UserError(f"--set {item!r}: expected KEY=VALUE, e.g. trainer.lr=1e-5")
    key, raw = item.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``--set`` overrides to the raw TOML dict (tables are created as needed)."""
    for item in overrides:
        keys, value = parse_override(item)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise UserError(f"--set {item!r}: {k} is not a table")
        node[keys[-1]] = value
    return data


@dataclass
class LoadedRecipe:
    """A validated recipe with where it came from (inputs are resolved against ``base``)."""

    recipe: Recipe
    file: Path

    @property
    def base(self) -> Path:
        """The folder relative paths in the recipe are resolved against."""
        return self.file.parent

    def model_path(self) -> Path:
        """Absolute path of the policy model folder."""
        return (self.base / self.recipe.model.path).resolve()


def load_recipe(file: str | Path, overrides: list[str] = ()) -> LoadedRecipe:
    """Read, override and validate the core tables of a recipe file (phase one)."""
    file = Path(file)
    try:
        data = tomllib.loads(file.read_text())
    except FileNotFoundError:
        raise UserError(f"{file}: recipe file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{file}: not valid TOML: {exc}") from None
    data = apply_overrides(data, list(overrides))
    try:
        recipe = validate_section(Recipe, data)
    except UserError as exc:
        raise UserError(f"{file}: {exc}") from None
    return LoadedRecipe(recipe, file)


def check_pools(recipe: Recipe) -> None:
    """An embedded cluster needs a ``[pools.<name>]`` table for every pool the run uses."""
    if recipe.cluster.address:
        return  # an existing cluster is checked against its workers instead (cluster.py)
    for pool, what in REQUIRED_POOLS.items():
        if getattr(recipe.pools, pool) is None:
            raise UserError(f"pools.{pool}: missing; add a [pools.{pool}] table (this pool {what})")


def to_toml(recipe: Recipe) -> str:
    """The resolved recipe as TOML text (what ``recipe show`` prints and the run folder keeps)."""
    return tomli_w.dumps(recipe.model_dump(mode="json", exclude_none=True))
