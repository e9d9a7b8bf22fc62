"""``mlflow`` metric sink: an MLflow run. Needs ``pip install 'streamrl[mlflow]'``, and SQLAlchemy
and Alembic for a local database (the default)."""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from pathlib import Path

from pydantic import model_validator

from streamrl.telemetry.trackers import TrackerConfig, TrackerSink, flat_params, require, run_recipe

#: MLflow's limits on one ``log_batch`` call and on a parameter's value
PARAMS_PER_BATCH, METRICS_PER_BATCH, PARAM_CHARS = 100, 1000, 6000


class MLflowConfig(TrackerConfig):
    """``[[metrics]] name = "mlflow"``."""

    sink, packages = "mlflow", ("mlflow",)
    tracking_uri: str | None = None
    """Where the run goes: a tracking server (``http://127.0.0.1:5000``), ``databricks`` or a
    database (``sqlite:///mlflow.db``, relative to the working folder). Default:
    ``MLFLOW_TRACKING_URI`` if set, else a SQLite database in the run folder (``mlflow.db``)."""
    experiment: str | None = None
    """Experiment name; default: ``MLFLOW_EXPERIMENT_NAME`` if set, else ``streamrl``."""
    run_name: str | None = None
    """Run name; default: the run folder's name (``addition-grpo-20250101-120000``)."""
    tags: dict[str, str] = {}
    """Run tags."""

    @model_validator(mode="after")
    def _database_installed(self):
        uri = self.resolved_uri()
        if uri is None or uri.startswith("sqlite:"):  # MLflow's database store; mlflow-skinny lacks it
            require("sqlalchemy", "alembic", sink=self.sink,
                    install="pip install sqlalchemy alembic (or set tracking_uri to an MLflow server)")
        return self

    def resolved_uri(self) -> str | None:
        """The tracking URI given or in the environment; None: the default database."""
        return self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None


class MLflowSink(TrackerSink):
    """Logs each step's metrics to an MLflow run whose parameters are the recipe's settings."""

    def __init__(self, config: MLflowConfig):
        self.config = config
        self.client = self.run_id = None

    def open(self, run_dir: Path) -> None:
        """Start the MLflow run (in a new experiment if there is none of that name)."""
        from mlflow import MlflowClient
        from mlflow.entities import Param

        c, run_dir = self.config, Path(run_dir).resolve()
        uri = c.resolved_uri()
        local = uri is None
        if local:
            uri = f"sqlite:///{run_dir / 'mlflow.db'}"
        with _quiet("mlflow.store.db.utils", "alembic"):  # creating a database logs each migration
            self.client = MlflowClient(uri)
            name = c.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "streamrl"
            found = self.client.get_experiment_by_name(name)
        if found is not None:
            experiment = found.experiment_id
        else:  # artifacts of the run folder's own database stay in the run folder, not ./mlruns
            experiment = self.client.create_experiment(
                name, artifact_location=(run_dir / "mlartifacts").as_uri() if local else None)
        run = self.client.create_run(experiment, run_name=c.run_name or run_dir.name,
                                     tags={"streamrl.run_dir": str(run_dir), **c.tags})
        self.run_id = run.info.run_id
        params = [Param(k, str(v)[:PARAM_CHARS]) for k, v in flat_params(run_recipe(run_dir)).items()]
        for i in range(0, len(params), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + PARAMS_PER_BATCH])

    def log(self, metrics: dict[str, float], step: int, wall_time: float) -> None:
        """Log ``metrics`` at ``step``, stamped with the step's end."""
        from mlflow.entities import Metric

        ms = int(wall_time * 1000)
        batch = [Metric(k, v, ms, step) for k, v in metrics.items()]
        for i in range(0, len(batch), METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=batch[i:i + METRICS_PER_BATCH])

    def close(self) -> None:
        """Mark the run finished."""
        if self.run_id is not None:
            self.client.set_terminated(self.run_id)
            self.run_id = None


@contextmanager
def _quiet(*names: str):
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
