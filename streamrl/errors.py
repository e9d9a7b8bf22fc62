"""The one exception type that means "the user got something wrong".

The CLI prints its message on one line and exits with status 2, without a traceback. Anything
else that escapes is a bug in streamrl (or a plugin) and keeps its traceback.
"""


class UserError(Exception):
    """A mistake in a recipe, a command line or a cluster set-up, phrased for the user."""


class PluginWarning(UserWarning):
    """A plugin could not be loaded; the others still are. The CLI prints it on one line."""


class Interrupted(Exception):
    """The run was stopped by a signal after writing a checkpoint (the message says how to resume)."""


class RunFailed(Exception):
    """The run could not go on (e.g. the train worker died); the message says what to do."""
