"""The side learners as a step extension (``contracts/step_extension.py``): built beside the residents,
handed every step's scored groups, recorded, checkpointed, restored and finished with the run,
and added or removed between steps on request (``streamrl learners add|remove``)."""

from __future__ import annotations

from pathlib import Path

from distributed import Future

from streamrl.contracts.step_extension import StepExtension
from streamrl.learners import control, runtime
from streamrl.learners.fanout import Fanout


class SideLearners(StepExtension):
    """Every learner of the run but the main one: ``[[learners]]`` and those added while it runs."""

    order = 40

    def __init__(self, context):
        self.context = context
        """The run (its client, topology, resolved recipe, task, last optimizer step)."""
        self.fanout: Fanout | None = None
        """The side learners, once placed (None: none so far)."""
        self._placing: list[runtime.Placing] = []

    def placing(self, context) -> None:
        """Start building the recipe's side learners on their workers, beside the residents."""
        self._placing = runtime.begin(context.client, context.resolved, context.topology.pins, context.task)

    def placed(self, context) -> None:
        """Wait for them; from here they take the stream."""
        self.fanout = runtime.start(context.client, context.resolved, context.repeatable, self._placing, context.task)
        self._placing = []

    def trained(self, step: int, scored: list[Future]) -> None:
        """The same groups to every side learner."""
        if self.fanout:
            self.fanout.hand_over(step, scored)

    def record(self, step: int, record) -> None:
        """Every learner's figures by name (``learners``), after evaluation's metrics are in."""
        if self.fanout:
            record.extra["learners"] = runtime.record(self.fanout, self.context.resolved, record)

    def between_steps(self, done: int, run_dir: Path) -> list[str]:
        """Carry out ``streamrl learners add|remove`` requests waiting."""
        return control.serve(self, run_dir, done)

    def checkpoint(self, next_step: int, previous: Path | None):
        """Each side learner's trainer and state into the checkpoint."""
        return runtime.checkpoint(self.fanout, next_step, previous) if self.fanout else None

    def resume(self, checkpoint: Path) -> None:
        """Restore every side learner of ``checkpoint`` (those added while running placed again)."""
        c = self.context
        self.fanout = runtime.resume(self.fanout, c.client, c.resolved, c.topology, checkpoint, c.repeatable, c.task)

    def add(self, learner) -> None:
        """A learner placed while the run goes on (``streamrl learners add``) takes the stream
        from the next step."""
        if self.fanout is None:
            self.fanout = Fanout(self.context.client, self.context.recipe, [], self.context.repeatable)
            self.fanout.task = self.context.task
        self.fanout.add(learner)

    def finish(self, policy_dir: Path) -> None:
        """Their queued steps, policies (``policy_dir/<name>``) and final evaluations."""
        runtime.finish(self.fanout, policy_dir)
