"""Experiment trackers as metric sinks: ``[[metrics]] name = "tensorboard" | "wandb" | "mlflow" |
"trackio"``.

Each sink logs every step's record under the names of
:func:`streamrl.telemetry.names.tracker_metrics`, at the record's step, and the run's recipe as
the tracker's config (or parameters). Each library is an optional extra, imported only when a run
opens its sink, so streamrl imports without it; a recipe naming one that is not installed is a
one-line error when the recipe is validated, before anything starts.
"""

from __future__ import annotations

import importlib.util
import json
import time
import tomllib
from pathlib import Path
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

from streamrl.contracts.observing import MetricSink
from streamrl.errors import UserError
from streamrl.telemetry.names import tracker_metrics


def require(*modules: str, sink: str, install: str | None = None) -> None:
    """A one-line :class:`UserError` unless every one of ``modules`` is installed; it says what
    to install (default: the sink's extra, ``pip install 'streamrl[<sink>]'``)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        install = install or f"pip install 'streamrl[{sink}]'"
        raise UserError(f'metrics: name = "{sink}" needs the {" and ".join(missing)} package'
                        f'{"s" if len(missing) > 1 else ""}: {install}')


class TrackerConfig(BaseModel):
    """A tracker sink's settings; validating them checks its library is installed."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    sink: ClassVar[str]
    """The sink's name, which is also its extra's."""
    packages: ClassVar[tuple[str, ...]]
    """The modules it imports."""

    @model_validator(mode="after")
    def _installed(self):
        # (a UserError is no ValueError: pydantic lets it through as it is, one line)
        require(*self.packages, sink=self.sink)
        return self


class TrackerSink(MetricSink):
    """A metric sink that logs each record's :func:`tracker_metrics` at the record's step."""

    def write(self, record: dict) -> None:
        """Log one step's record."""
        self.log(tracker_metrics(record), int(record["step"]), float(record.get("time", time.time())))

    def log(self, metrics: dict[str, float], step: int, wall_time: float) -> None:
        """Send ``metrics`` at ``step``; ``wall_time``: when the step ended (epoch seconds)."""
        raise NotImplementedError


def run_recipe(run_dir: Path) -> dict:
    """The run's recipe (``recipe.toml`` in its folder), as nested tables; empty if there is none."""
    path = Path(run_dir) / "recipe.toml"
    return tomllib.loads(path.read_text()) if path.is_file() else {}


def flat_params(table: dict, prefix: str = "") -> dict[str, str | int | float | bool]:
    """``table`` as ``section.key`` -> value, for trackers whose parameters are flat: a list of
    tables by index (``metrics.0.name``), any other list as JSON."""
    out: dict[str, str | int | float | bool] = {}
    for key, value in table.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_params(value, f"{name}."))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for i, v in enumerate(value):
                out.update(flat_params(v, f"{name}.{i}."))
        elif isinstance(value, (str, int, float, bool)):
            out[name] = value
        else:
            out[name] = json.dumps(value, default=str)
    return out


def inside(run_dir: Path, path: str) -> Path:
    """``path``, relative ones inside the run folder."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else Path(run_dir) / p
