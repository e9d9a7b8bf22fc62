"""``tensorboard`` metric sink: TensorBoard event files (``tensorboard --logdir runs`` shows every
run). Needs ``pip install 'streamrl[tensorboard]'``."""

from __future__ import annotations

from pathlib import Path

from streamrl.telemetry.trackers import TrackerConfig, TrackerSink, flat_params, inside, run_recipe

#: the metrics the HParams tab shows beside each run's recipe
HPARAM_METRICS = ("reward/mean", "response_length/mean", "eval/pass_at_1")


class TensorBoardConfig(TrackerConfig):
    """``[[metrics]] name = "tensorboard"``."""

    sink, packages = "tensorboard", ("tensorboard",)
    log_dir: str = "tensorboard"
    """Folder of this run's event files; a relative one is inside the run folder."""


class TensorBoardSink(TrackerSink):
    """Writes each step's metrics as scalars, the recipe as text and as HParams."""

    def __init__(self, config: TensorBoardConfig):
        self.config = config
        self.writer = None

    def open(self, run_dir: Path) -> None:
        """Start the event file, with the recipe in it."""
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.writer = SummaryWriter(log_dir=str(inside(run_dir, self.config.log_dir)))
        recipe = run_recipe(run_dir)
        text = (Path(run_dir) / "recipe.toml").read_text() if recipe else ""
        # indented: the text tab renders markdown, and a TOML table header is no heading
        self.writer.add_text("recipe", "\n".join("    " + line for line in text.splitlines()), 0)
        # the three summaries SummaryWriter.add_hparams writes, but into this run's own file
        # (add_hparams makes a new sub-run per call)
        for summary in hparams(flat_params(recipe), dict.fromkeys(HPARAM_METRICS, 0.0)):
            self.writer.file_writer.add_summary(summary)

    def log(self, metrics: dict[str, float], step: int, wall_time: float) -> None:
        """One scalar per metric at ``step``, stamped with the step's end."""
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step, walltime=wall_time)
        self.writer.flush()  # a step is seconds long: TensorBoard shows it now, not in 2 minutes

    def close(self) -> None:
        """Flush and close the event file."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
