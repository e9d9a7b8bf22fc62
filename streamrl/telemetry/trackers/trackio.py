"""``trackio`` metric sink: a Trackio run, in Trackio's local database (``TRACKIO_DIR``, default
``~/.cache/huggingface/trackio``; ``trackio show`` opens it). Needs
``pip install 'streamrl[trackio]'``."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from streamrl.telemetry.trackers import TrackerConfig, TrackerSink, run_recipe


class TrackioConfig(TrackerConfig):
    """``[[metrics]] name = "trackio"``."""

    sink, packages = "trackio", ("trackio",)
    project: str = "streamrl"
    """Trackio project."""
    run_name: str | None = None
    """Run name; default: the run folder's name (``addition-grpo-20250101-120000``). (Not
    ``name``: in a ``[[metrics]]`` table that is the sink's.)"""
    group: str | None = None
    """Group the run belongs to."""
    space_id: str | None = None
    """A Hugging Face Space (``user/space``) to log to instead of the local database (needs the
    network and ``hf auth login``); default: local only."""


class TrackioSink(TrackerSink):
    """Logs each step's metrics to a Trackio run whose config is the recipe."""

    def __init__(self, config: TrackioConfig):
        self.config = config
        self.run = None

    def open(self, run_dir: Path) -> None:
        """Start the Trackio run."""
        import trackio

        c = self.config
        # trackio prints half a dozen lines of set-up (and of finishing) to stdout, between
        # streamrl's own; where the data is, is in the docs
        with contextlib.redirect_stdout(io.StringIO()):
            self.run = trackio.init(project=c.project, name=c.run_name or Path(run_dir).name, group=c.group,
                                    space_id=c.space_id, config=run_recipe(run_dir), embed=False)

    def log(self, metrics: dict[str, float], step: int, wall_time: float) -> None:
        """Log ``metrics`` at ``step``."""
        self.run.log(metrics, step=step)

    def close(self) -> None:
        """Finish the run (its last metrics reach the database)."""
        if self.run is not None:
            import trackio

            with contextlib.redirect_stdout(io.StringIO()):
                trackio.finish()  # (not run.finish(): that leaves it current, finished again at exit)
            self.run = None
