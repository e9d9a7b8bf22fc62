"""Step extensions: how a feature plugs into the controller's step loop (``run/controller.py``)
without a branch in it.

The loop itself draws prompts, submits generation, scoring and training, publishes the weights
and takes the step's record. A feature that needs to act at one of those moments -- the elastic
generate pool, the side learners, held-out evaluation, served traffic -- is a
:class:`StepExtension`: the controller calls every extension's method of that moment on its own
thread, in the extensions' declared :attr:`~StepExtension.order`. Every method here does nothing,
so an extension overrides only the moments it needs. What an extension sees of the run is a
:class:`RunContext`, never the controller. A sketch::

    class CountGroups(StepExtension):
        order = 100  # after the built-ins

        def __init__(self, context):
            self.groups = 0

        def trained(self, step, scored):
            self.groups += len(scored)

        def record(self, step, record):
            record.extra["groups_so_far"] = self.groups

A plugin adds one with the ``add_step_extensions(context)`` hook (``plugins/hookspecs.py``).
An extension that raises stops the run, as a failure of the loop would: extensions are part of
the loop (a plugin's, in one line naming its class and the moment). (What only watches the step's record is an observer: ``run/observers.py``.)
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # (types only: the context is built above these layers; no Dask import for plugins)
    from distributed import Client, Future

    from streamrl.contracts.dispatch import Scheduler
    from streamrl.contracts.inputs import Task


class RunContext:
    """What a step extension sees of the run: what the run is made of, fixed when it starts, and
    what a step changes, kept current by the controller (it assigns the fields below; nothing
    else does). It holds no reference to the controller and only weak ones to the extensions, so
    an extension that keeps it makes no cycle: a finished run's futures go when the run does (a
    run that starts over on the same cluster submits the same task keys and must not be answered
    with them)."""

    def __init__(self, client: "Client", resolved: Any, task: "Task", topology: Any, repeatable: bool,
                 feeds_ahead: bool):
        self.client = client
        """The run's Dask client (submit tasks, run on workers, register worker plugins)."""
        self.resolved = resolved
        """The resolved recipe (``plugins/resolve.py``'s ``Resolved``): its components, their
        validated configs, the learners' plans and the plugin registry."""
        self.recipe = resolved.recipe
        """The validated recipe."""
        self.task = task
        """The run's task, built in this process (its prompts, held-out prompts, limits)."""
        self.topology = topology
        """Where the workers are (``flow/topology.py``'s ``Topology``: names, pins, the train
        group, incarnations); an elastic pool changes it between steps."""
        self.repeatable = repeatable
        """The engine repeats its samples for a seed: the run keeps every step's policy version
        and training order fixed, and so must an extension that submits generation or training."""
        self.feeds_ahead = feeds_ahead
        """The mode runs ahead (``async``): the next step's generation is admitted, and its groups
        may go to the trainer, before this step's record; an extension that must act between
        publication and training sets :attr:`StepExtension.holds_boundary`."""
        self.publishes = True
        """False when the engines keep the policy they started with (an extension's
        :attr:`StepExtension.publishes`): :attr:`version` then counts trained steps while every
        engine still holds version 0."""
        self.version = 0
        """The policy version of the last step trained: the one published last, which the engines
        hold or are loading (unless :attr:`publishes` is False)."""
        self.scheduler: "Scheduler | None" = None
        """The recipe's scheduler as built for this run (None: none, or not placed yet)."""
        self.last_optimizer_step: "list[Future] | None" = None
        """Every rank's last optimizer step while a step's training runs (None between steps): a
        task that must see the newest weights depends on it."""
        self._extensions: list[weakref.ref] = []

    @property
    def extensions(self) -> "list[StepExtension]":
        """The run's extensions, in the order they are called."""
        return [e for e in (ref() for ref in self._extensions) if e is not None]

    @extensions.setter
    def extensions(self, extensions: "list[StepExtension]") -> None:
        self._extensions = [weakref.ref(e) for e in extensions]

    def extension(self, kind: type) -> "StepExtension | None":
        """The run's extension of class ``kind`` (None: the run has none)."""
        return next((e for e in self.extensions if isinstance(e, kind)), None)


class StepExtension:
    """A feature of the step loop; every method is named for the moment it runs."""

    order: int = 100
    """When it is called relative to the others, lowest first (ties: in the order they were
    made). The built-ins: what supplies the samples (agent rollouts, served traffic) 10, the
    policy kept at its start 15, the elastic pool 20, held-out evaluation 30, the side learners
    40 (their record repeats evaluation's), the mover of running samples 50, the side learners'
    policies served 60 (it serves what they trained). A plugin's comes after them unless it says."""

    holds_boundary: bool = False
    """True when the extension must act between one step's publication and the next step's
    training (the elastic pool brings a joining worker up to date there): the controller then
    never hands the next step's groups to the trainer early (``async`` mode's feed)."""

    publishes: bool = True
    """False when the generate pool must keep the weights it started with (``run.serve =
    "initial"``: the engines serve the starting policy while the learners train): the controller
    then publishes no new policy and generation asks for version 0."""

    def placing(self, context: RunContext) -> None:
        """Before the engines, trainer and rewards are placed (again when the run starts over
        from its initial weights): start what is built beside them."""

    def placed(self, context: RunContext) -> None:
        """After placement: the scheduler is built, the train group is formed, the clocks run."""

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
        """The last step is done; the policy is saved to ``policy_dir`` next (a folder beside the
        run's ``policy/``, renamed to it once every save into it is done: write into it, but keep
        no path to it)."""

    def close(self) -> None:
        """The run ends, however it ends: cancel what was submitted ahead."""
