"""The side learners as a step extension (``extensions/step_extension.py``): built beside the residents,
handed every step's scored groups, recorded, checkpointed, restored and finished with the run,
and added or removed between steps on request (``streamrl learners add|remove``)."""

from __future__ import annotations

import weakref
from pathlib import Path

from distributed import Future

from streamrl.extensions.step_extension import StepExtension
from streamrl.learners import control, runtime
from streamrl.learners.fanout import Fanout


class SideLearners(StepExtension):
    """Every learner of the run but the main one: ``[[learners]]`` and those added while it runs."""

    def __init__(self, ctl):
        # a weak reference: the controller holds its extensions, and a cycle would keep a finished
        # run's controller -- and the futures it holds -- alive until the garbage collector ran;
        # a controller that starts over on the same cluster would then be answered with them
        self.ctl = weakref.proxy(ctl)
        """The controller (its client, topology, resolved recipe, task, last step)."""
        self.fanout: Fanout | None = None
        """The side learners, once placed (None: none so far)."""
        self._placing: list[runtime.Placing] = []

    def placing(self, ctl) -> None:
        """Start building the recipe's side learners on their workers, beside the residents."""
        self._placing = runtime.begin(ctl.client, ctl.resolved, ctl.topology.pins, ctl.task)

    def placed(self, ctl) -> None:
        """Wait for them; from here they take the stream."""
        self.fanout = runtime.start(ctl.client, ctl.resolved, ctl.repeatable, self._placing, ctl.task)
        self._placing = []

    def trained(self, step: int, scored: list[Future]) -> None:
        """The same groups to every side learner."""
        if self.fanout:
            self.fanout.hand_over(step, scored)

    def record(self, step: int, record) -> None:
        """Every learner's figures by name (``learners``), after evaluation's metrics are in."""
        if self.fanout:
            record.extra["learners"] = runtime.record(self.fanout, self.ctl.resolved, record)

    def between_steps(self, done: int, run_dir: Path) -> list[str]:
        """Carry out ``streamrl learners add|remove`` requests waiting."""
        return control.serve(self, run_dir, done)

    def checkpoint(self, next_step: int, previous: Path | None):
        """Each side learner's trainer and state into the checkpoint."""
        return runtime.checkpoint(self.fanout, next_step, previous) if self.fanout else None

    def resume(self, checkpoint: Path) -> None:
        """Restore every side learner of ``checkpoint`` (those added while running placed again)."""
        ctl = self.ctl
        self.fanout = runtime.resume(self.fanout, ctl.client, ctl.resolved, ctl.topology, checkpoint)

    def finish(self, policy_dir: Path) -> None:
        """Their queued steps, policies (``policy_dir/<name>``) and final evaluations."""
        runtime.finish(self.fanout, policy_dir)
