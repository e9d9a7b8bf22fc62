"""``wandb`` metric sink: a Weights & Biases run. Needs ``pip install 'streamrl[wandb]'``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from streamrl.errors import UserError
from streamrl.telemetry.trackers import TrackerConfig, TrackerSink, inside, run_recipe


class WandbConfig(TrackerConfig):
    """``[[metrics]] name = "wandb"``."""

    sink, packages = "wandb", ("wandb",)
    project: str | None = None
    """W&B project; default: ``WANDB_PROJECT`` if set, else ``streamrl``."""
    entity: str | None = None
    """Team or user the run belongs to; default: ``WANDB_ENTITY`` if set, else your default entity."""
    run_name: str | None = None
    """Run name; default: the run folder's name (``addition-grpo-20250101-120000``). (Not
    ``name``: in a ``[[metrics]]`` table that is the sink's.)"""
    group: str | None = None
    """Group the run belongs to (e.g. the runs of one sweep)."""
    tags: list[str] = []
    """Run tags."""
    mode: Literal["online", "offline", "disabled"] | None = None
    """``online``: to the W&B server as the run goes (``wandb login`` first); ``offline``: only
    local files, no network (``wandb sync`` uploads them later); ``disabled``: nothing. Default:
    ``WANDB_MODE`` if set, else ``online``."""
    dir: str = "."
    """Folder W&B writes its ``wandb/`` files in; a relative one is inside the run folder."""


class WandbSink(TrackerSink):
    """Logs each step's metrics to a W&B run whose config is the recipe."""

    def __init__(self, config: WandbConfig):
        self.config = config
        self.run = None

    def open(self, run_dir: Path) -> None:
        """Start the W&B run."""
        import wandb

        c = self.config
        folder = inside(run_dir, c.dir)
        folder.mkdir(parents=True, exist_ok=True)
        # quiet: where the run is and its link, not W&B's banner and end-of-run summary;
        # console off: streamrl's live display is no output worth capturing into the run
        settings = wandb.Settings(quiet=True, console="off")
        try:
            self.run = wandb.init(project=c.project or os.environ.get("WANDB_PROJECT") or "streamrl",
                                  entity=c.entity, name=c.run_name or Path(run_dir).name, group=c.group,
                                  tags=c.tags or None, mode=c.mode, dir=str(folder), config=run_recipe(run_dir),
                                  settings=settings)
        except wandb.errors.Error as exc:  # not logged in, no network, no such entity: the user's to fix
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(f'metrics: name = "wandb": {first} (to keep the run local, with no account: '
                            'mode = "offline")') from None

    def log(self, metrics: dict[str, float], step: int, wall_time: float) -> None:
        """Log ``metrics`` at ``step``."""
        self.run.log(metrics, step=step)

    def close(self) -> None:
        """Finish the W&B run (offline: its files are complete)."""
        if self.run is not None:
            self.run.finish()
            self.run = None
