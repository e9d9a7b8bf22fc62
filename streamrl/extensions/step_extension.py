"""Step extensions: how a feature plugs into the controller's step loop (``run/controller.py``)
without a branch in it.

The loop itself draws prompts, submits generation, scoring and training, publishes the weights
and takes the step's record. A feature that needs to act at one of those moments -- the elastic
generate pool, the side learners, held-out evaluation -- is a :class:`StepExtension`: the
controller calls every extension's method of that moment, in the order the extensions were
given, on the controller's thread. Every method here does nothing, so an extension overrides
only the moments it needs. A sketch::

    class CountGroups(StepExtension):
        def __init__(self):
            self.groups = 0

        def trained(self, step, scored):
            self.groups += len(scored)

        def record(self, step, record):
            record.extra["groups_so_far"] = self.groups

An extension that raises stops the run, as a failure of the loop would: extensions are part of
the loop. An extension keeps what it needs from the controller, or a weak reference to it: the
controller holds its extensions, and a cycle keeps a finished run's futures alive (a run that
starts over on the same cluster submits the same task keys and would be answered with them). (What only watches the step's record is an observer: ``run/observers.py``.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from distributed import Future


class StepExtension:
    """A feature of the step loop; every method is named for the moment it runs."""

    holds_boundary: bool = False
    """True when the extension must act between one step's publication and the next step's
    training (the elastic pool brings a joining worker up to date there): the controller then
    never hands the next step's groups to the trainer early (``async`` mode's feed)."""

    def placing(self, ctl) -> None:
        """Before the engines, trainer and rewards are placed (again when the run starts over
        from its initial weights): start what is built beside them. ``ctl``: the controller."""

    def placed(self, ctl) -> None:
        """After placement: the dispatcher exists, the train group is formed, the clocks run."""

    def started(self, run_dir: Path) -> list[str]:
        """The run is placed and its folder exists, before the first step: lines for the console
        (an endpoint's address, say)."""
        return []

    def samples(self, step: int, min_version: int) -> list[Future] | None:
        """Where step ``step``'s samples come from when not from the task's prompts: the futures
        of its scored groups (bundles, as generation makes them), or None to leave it to the
        prompts. ``min_version``: the policy every engine holds by now."""
        return None

    def pinned(self, worker: str | None, future: Future) -> None:
        """A task pinned to generate worker ``worker`` was submitted: a group's generation or a
        weight load (``worker`` None: generation placed by Dask, on no worker in particular)."""

    def trained(self, step: int, scored: list[Future]) -> None:
        """Step ``step``'s training was submitted; ``scored``: its scored groups' futures."""

    def before_publish(self, version: int, step_future: Future) -> None:
        """Before policy ``version`` is published; ``step_future``: the optimizer step that makes
        it (not waited for: an extension that needs it done waits itself)."""

    def published(self, version: int, loads: list[Future]) -> None:
        """Policy ``version``'s publication was submitted: one load per generate worker."""

    def record(self, step: int, record) -> None:
        """Step ``step``'s record is being taken (``telemetry.record.StepRecord``): add to
        ``record.extra`` what this extension has to say."""

    def between_steps(self, done: int, run_dir: Path) -> list[str]:
        """After step ``done``'s record is written and before the next step: act on requests
        from outside the run. Returns lines for the console."""
        return []

    def checkpoint(self, next_step: int, previous: Path | None) -> Callable[[Path], None] | None:
        """A checkpoint of the run is being written (``previous``: the newest before it): a
        function that writes this extension's state into the checkpoint's folder, or None."""
        return None

    def resume(self, checkpoint: Path) -> None:
        """After placement, when the run goes on from ``checkpoint``: restore this extension."""

    def stopping(self) -> None:
        """The user asked the run to stop (from another thread, while a step may be waiting):
        stop waiting for the outside world, so the step ends with what it has."""

    def finish(self, policy_dir: Path) -> None:
        """The last step is done; the policy is saved to ``policy_dir`` next."""

    def close(self) -> None:
        """The run ends, however it ends: cancel what was submitted ahead."""
