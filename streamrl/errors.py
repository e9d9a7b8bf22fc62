"""The one exception type that means "the user got something wrong".

The CLI prints its message on one line and exits with status 2, without a traceback. Anything
else that escapes is a bug in streamrl (or a plugin) and keeps its traceback.
"""


class UserError(Exception):
    """A mistake in a recipe, a command line or a cluster set-up, phrased for the user."""


class PluginWarning(UserWarning):
    """A plugin could not be loaded; the others still are. The CLI prints it on one line."""


class RunWarning(PluginWarning):
    """Something went wrong that the run got around (a damaged checkpoint passed over for the
    one before it, a torn last line of ``metrics.jsonl`` dropped). A :class:`PluginWarning`
    only so that the CLI prints it on one line as it prints those."""


class Interrupted(Exception):
    """The run was stopped by a signal after writing a checkpoint (the message says how to resume)."""


class RunFailed(Exception):
    """The run could not go on (e.g. the train worker died); the message says what to do."""


class RunStopped(RunFailed):
    """The run stopped on purpose before anything wrong was published or checkpointed: a step
    that must not be applied (raised on a train worker; Dask hands it to the controller as it
    is, and the runner lets a :class:`RunFailed` through), or a checkpoint that could not be
    written. The run folder adds which checkpoint the run can go on from (``RunFolder.failed``
    calls :meth:`resume_from`), since where it was raised that is not known."""

    def resume_from(self, where: str) -> None:
        """Append ``where`` (the last checkpoint and the resume command) to the message."""
        self.args = (f"{self.args[0] if self.args else ''}; {where}",) + self.args[1:]


class NonFiniteStep(RunStopped):
    """The loss or a gradient of a step was not finite (NaN or inf): the update was not applied."""


class UpdateBroke(NonFiniteStep):
    """An update was applied and left the weights unusable (not finite, moved past
    ``trainer.max_weight_change``, log-probabilities not finite): the trainer's weights in memory
    are the broken ones; its last checkpoint holds the last good state."""


class RewardFailed(RunStopped):
    """The reward raised (or gave no number) for every sample of a step: a reward that always
    fails is a bug, not a learning signal, and training on its zeros would be silent."""


class CheckpointFailed(RunStopped):
    """A checkpoint could not be written (the disk is full, ...): its partial folder is removed
    and the older checkpoints are kept."""


class WeightShapeMismatch(ValueError):
    """Published weights whose shapes are not the engine's: nothing of them was loaded. The
    message names the first parameter that differs, both shapes, and (added on the generate
    worker) the transfer that carried them."""
