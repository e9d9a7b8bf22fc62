"""Fan-out: every scored group of the stream goes to every learner.

The main learner (the served one) trains on the train pool in the controller's step loop, as in a
run with one learner. Each other learner -- a *side learner* -- holds its own trainer (model,
optimizer, critic) on its own worker, ``learner-<name>``, under its own resident name, and gets
the step's scored-group futures once the main learner's training of them is submitted. Dask moves
each group to every worker that trains on it: generation and scoring happen once.

A side learner is its own failure domain. Its tasks run on its worker only; the controller looks
at them without waiting (:meth:`Fanout.harvest`), so a learner that raises, refuses a non-finite
step or loses its worker (a fresh trainer there fails the incarnation check) is marked failed in
one line and the stream goes on. A slow learner has a bounded queue of steps
(``queue``): when it is full the step is skipped for it, counted (``when_full = "skip"``), or the
controller waits for it (``"pace"``). Its steps are chained (each after its last optimizer step),
so none is trained twice or out of order.
"""

from __future__ import annotations

import time
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from distributed import Client, Future, wait

from streamrl.errors import RunWarning, UpdateBroke
from streamrl.flow import submit
from streamrl.on_worker import task_functions
from streamrl.extensions.evaluate import Evaluator
from streamrl.plugins.resolve import LearnerPlan
from streamrl.cluster import lifecycle
from streamrl.cluster.pool_workers import LEARN
from streamrl.recipe.recipe import Recipe
from streamrl.telemetry.record import algorithm_stats
from streamrl.telemetry.stats import StepStats, TrainTaskStats
from streamrl.telemetry.text import error_line


class LearnerView:
    """What submission (``flow/submit.training``) reads of a topology, for one side learner: one
    rank, its worker's pin, its own resource, resident name and key tag."""

    sharded = False
    train_resource = LEARN

    def __init__(self, client: Client, plan: LearnerPlan, pins: dict[str, dict]):
        self.client = client
        self.train = [plan.worker]
        self.pins = {plan.worker: pins[plan.worker]}
        self.trainer_resident = plan.resident
        self.key_tag = f"-{plan.name}"
        self.incarnations: dict[str, str] = {}

    @property
    def train_pin(self) -> dict:
        """Where the learner's tasks run."""
        return self.pins[self.train[0]]


@dataclass
class InFlight:
    """One step submitted to a side learner."""

    step: int
    last: list[Future]
    trains: list[Future]
    submitted: float


@dataclass
class SideLearner:
    """A learner training on its own worker, and what it has done so far."""

    plan: LearnerPlan
    view: LearnerView
    epochs: int = 1
    state: str = "training"
    """``training``, ``failed`` or ``removed``."""
    failure: str | None = None
    broken: bool = False
    """It failed with an update applied that broke its weights (:class:`UpdateBroke`): what its
    worker holds is not its policy (not saved as one; its last checkpoint is)."""
    lost: bool = False
    """It failed for its worker, gone for good: nothing is asked of that worker any more."""
    inflight: list[InFlight] = field(default_factory=list)
    steps_trained: int = 0
    skipped_steps: int = 0
    samples_trained: int = 0
    last_step: int | None = None
    """The last stream step it trained on."""
    last: dict = field(default_factory=dict)
    """The last trained step's figures (``metrics.jsonl`` ``learners.<name>``)."""
    joined_at: int = 0
    """The first step handed to it."""
    start: str | None = None
    """The model folder it was built from when not the recipe's, relative to the run folder
    (``learners add`` from the served policy: a policy saved then, also its reference): a resume
    builds it from the same one."""
    trained: list = field(default_factory=list)
    """``[step, samples, crc32 of its sorted sample uids]`` of each step trained since the last
    record (``metrics.jsonl`` ``learners.<name>.trained``: none lost, none twice)."""
    gone_since: float | None = None
    """When its worker was first seen gone (None: up at the last look)."""
    evaluator: Evaluator | None = None
    """Its policy on the held-out prompts (``learners/evaluate.py``), None without ``[eval]``."""
    evaluated: dict = field(default_factory=dict)
    """The newest evaluation's ``eval/*`` figures."""
    unrecorded: list = field(default_factory=list)
    """Evaluations finished since the last record, oldest first: all but the newest go into the
    next record's ``eval_unrecorded`` (a learner behind the stream may finish two at once)."""
    eval_versions: list[int] = field(default_factory=list)
    """The versions (its steps trained) evaluations were asked for."""

    @property
    def name(self) -> str:
        """The learner's name."""
        return self.plan.name

    def summary(self) -> dict:
        """What ``metrics.jsonl`` and ``learners.json`` say of it."""
        return {"state": self.state, "served": self.plan.served, "worker": self.plan.worker,
                "algorithm": self.plan.algorithm.component.name, "steps_trained": self.steps_trained,
                "skipped_steps": self.skipped_steps, "samples_trained": self.samples_trained,
                "queued_steps": len(self.inflight), "last_step": self.last_step, "joined_at": self.joined_at,
                **({"failure": self.failure} if self.failure else {}), **self.last, **self.evaluated}

    def evaluate(self, version: int, after=None) -> None:
        """Evaluate its policy as of ``version`` steps trained (after the futures ``after``)."""
        if self.evaluator is not None and version not in self.eval_versions:
            self.eval_versions.append(version)
            self.evaluator.submit(version, after=after)


#: Seconds a side learner's worker may be gone (its nanny restarting it, a cluster that lends it
#: back) before the learner is failed: its tasks are pinned there and would wait for it for good,
#: and a pacing stream, a checkpoint or a removal with them.
LOST_AFTER_S = 120.0

#: Seconds between two looks at a side learner's worker while the controller waits for its steps.
LOOK_EVERY_S = 5.0


class Fanout:
    """The side learners of a run: hands them each step's groups and reads what they did."""

    def __init__(self, client: Client, recipe: Recipe, learners: list[SideLearner] = (), repeatable: bool = False):
        self.client, self.recipe, self.repeatable = client, recipe, repeatable
        self.learners: dict[str, SideLearner] = {lr.name: lr for lr in learners}
        self.task = None
        """The run's task object, once the run has one (learners added later evaluate on it)."""

    def add(self, learner: SideLearner) -> None:
        """A learner placed while the run goes on takes part from the next step handed over (one
        that replaces a failed or removed learner of its name reports what that one trained and
        evaluated since the last record, in the next record: none of it unsaid)."""
        old = self.learners.get(learner.name)
        if old is not None and old is not learner:
            self._harvest(old)
            learner.trained = old.trained + learner.trained
            learner.unrecorded = old.unrecorded + learner.unrecorded
        self.learners[learner.name] = learner

    def training(self) -> list[SideLearner]:
        """The learners still training."""
        return [lr for lr in self.learners.values() if lr.state == "training"]

    def hand_over(self, step: int, scored: list[Future]) -> None:
        """Give step ``step``'s scored-group futures to every learner still training (see the
        module docstring for a full queue)."""
        if any(len(lr.inflight) >= lr.plan.queue for lr in self.training()):
            self.look(step)  # (a learner whose worker is gone fills its queue: only then is it asked after)
        for lr in self.training():
            self._harvest(lr)
            if lr.state != "training" or step < lr.joined_at:  # (started from weights that hold this step)
                continue
            if len(lr.inflight) >= lr.plan.queue:
                if lr.plan.when_full == "skip":
                    lr.skipped_steps += 1
                    continue
                self._wait_for([lr], step, one=True)  # pace: the stream waits for this learner's oldest step
                if lr.state != "training":
                    continue
            # after its last step (none trained twice, none out of order); a chain of steps only
            # as long as its queue, since finished ones are harvested
            after = lr.inflight[-1].last if lr.inflight else None
            last, passes = submit.epochs(lr.view, self.recipe, lr.epochs, step, scored, False, after,
                                         ordered=self.repeatable)
            lr.inflight.append(InFlight(step, last, passes[0], time.time()))
            version = lr.steps_trained + len(lr.inflight)  # its steps trained once this one is
            if lr.evaluator is not None and lr.evaluator.due(version, self.recipe.run.steps):
                lr.evaluate(version, after=last)

    def harvest(self) -> dict[str, dict]:
        """Read every finished step of every learner, without waiting; ``{name: summary}`` with
        the steps trained since the last call (``trained``)."""
        out = {}
        for name, lr in self.learners.items():
            self._harvest(lr)
            out[name] = {**lr.summary(), "trained": lr.trained}
            if len(lr.unrecorded) > 1:  # (the newest is the summary's own eval/*)
                out[name]["eval_unrecorded"] = lr.unrecorded[:-1]
            lr.trained, lr.unrecorded = [], []
        return out

    def _harvest(self, lr: SideLearner) -> None:
        if lr.evaluator is not None:
            while ready := lr.evaluator.ready():
                lr.evaluated.update(ready)
                lr.unrecorded.append(ready)
        while lr.inflight and lr.inflight[0].last[0].done():
            entry = lr.inflight.pop(0)
            try:
                stats: StepStats = entry.last[0].result()
                trains: list[TrainTaskStats] = [f.result() for f in entry.trains]
            except Exception as exc:  # contained: the learner stops, the stream goes on
                self.fail(lr, entry.step, exc)
                return
            samples = sum(t.samples for t in trains)
            uids = sorted(x["uid"] for t in trains for x in t.sample_log)
            lr.trained.append([entry.step, samples, zlib.crc32("\n".join(uids).encode())])
            lr.steps_trained += 1
            lr.samples_trained += samples
            lr.last_step = entry.step
            n = max(1, samples)
            lr.last = {"step": entry.step, "policy_version": lr.steps_trained,
                       "reward_mean": round(sum(t.reward_sum for t in trains) / n, 6),
                       "loss": round(sum(t.loss_sum for t in trains) / n, 6), "grad_norm": round(stats.grad_norm, 6),
                       "train_s": round(sum(t.seconds for t in trains) + stats.seconds, 4),
                       "lag_s": round(time.time() - entry.submitted, 4),
                       **{k: round(v, 6) for k, v in algorithm_stats(trains, n).items()}}

    def fail(self, lr: SideLearner, step: int, exc: BaseException) -> None:
        """Mark ``lr`` failed (one line, naming it), drop its queued steps; the others go on."""
        # (its first line, printable: the text may quote a user's reward or the model's output)
        lr.state, lr.failure = "failed", f"step {step}: {error_line(exc, 290, first_line=True)}"
        lr.broken = isinstance(exc, UpdateBroke)
        self.client.cancel([f for e in lr.inflight for f in (*e.last, *e.trains)])
        lr.inflight.clear()
        if lr.evaluator is not None:
            lr.evaluator.cancel()
        warnings.warn(RunWarning(f"learner {lr.name!r} failed at {lr.failure}; generation and the other learners "
                                 f"go on (its last checkpoint and policy stay)"), stacklevel=2)

    def look(self, step: int) -> None:
        """Fail each learner still training whose worker has been gone for :data:`LOST_AFTER_S`
        (``step``: the stream's step, for its failure line)."""
        if not self.training():
            return
        try:
            up = lifecycle.addresses(self.client)
        except Exception:  # noqa: BLE001 -- the scheduler did not answer: look again later
            return
        now = time.time()
        for lr in self.training():
            if lr.plan.worker in up:
                lr.gone_since = None
                continue
            lr.gone_since = lr.gone_since or now
            if now - lr.gone_since >= LOST_AFTER_S:
                lr.lost = True
                self.fail(lr, step, RuntimeError(f"its worker {lr.plan.worker} has been gone for "
                                                 f"{now - lr.gone_since:.0f}s"))

    def _wait_for(self, learners: list[SideLearner], step: int, timeout: float | None = None,
                  one: bool = False) -> None:
        # until every queued step of each is done (``one``: its oldest), each that lost its
        # worker failed (looked at every LOOK_EVERY_S), or ``timeout`` passes
        deadline = None if timeout is None else time.time() + timeout
        first = {lr.name: lr.inflight[0] for lr in learners if lr.inflight}
        while True:
            pending = [lr.inflight[0].last[0] for lr in learners if lr.state == "training" and lr.inflight
                       and not (one and lr.inflight[0] is not first.get(lr.name))]
            if not pending or (deadline is not None and time.time() >= deadline):
                break
            try:
                wait(pending, timeout=LOOK_EVERY_S if deadline is None else
                     max(0.0, min(LOOK_EVERY_S, deadline - time.time())))
            except TimeoutError:
                pass
            for lr in learners:
                self._harvest(lr)
            self.look(step)

    def drain(self, timeout: float = 600.0, only: list[str] | None = None) -> None:
        """Wait for every queued step of every learner (or those named in ``only``) (the end of
        the run, a checkpoint, a removal), then read them; a learner whose worker is gone for
        good is failed instead of waited for."""
        chosen = [lr for lr in self.training() if only is None or lr.name in only]
        self._wait_for(chosen, max((lr.inflight[-1].step for lr in chosen if lr.inflight), default=0), timeout)
        for lr in self.learners.values():
            self._harvest(lr)  # (what they trained stays for the next record)

    def finish_evaluations(self) -> None:
        """At the end: evaluate each learner still training as it ends (unless that version was
        evaluated) and wait for every evaluation (the last :meth:`harvest` hands them over)."""
        for lr in self.training():
            lr.evaluate(lr.steps_trained)
            if lr.evaluator is not None:
                done = lr.evaluator.finish()
                if done:
                    lr.evaluated.update(done[-1])
                    lr.unrecorded += done

    def save_policies(self, out: Path, only: list[str] | None = None) -> dict[str, str]:
        """Write each learner's policy (or those named in ``only``) to ``out/<name>`` (failed ones
        too: their last good weights, unless the failed update broke them; removed ones were
        saved when they left); ``{name: folder}`` of those written."""
        saved = {}
        for lr in self.learners.values():
            if (only is not None and lr.name not in only) or (only is None and lr.state == "removed"):
                continue
            if lr.broken or lr.lost:
                why = ("its failed update broke the weights its worker holds" if lr.broken else
                       f"its worker {lr.plan.worker} is gone")
                warnings.warn(RunWarning(f"learner {lr.name!r}: policy not saved ({why}; its last checkpoint holds "
                                         "its last good state)"), stacklevel=2)
                continue
            target = out / lr.name
            try:
                # (its incarnation: a worker restarted since holds the base weights, not the learner's)
                saved[lr.name] = self.client.submit(
                    task_functions.save_policy, str(target), trainer=lr.plan.resident,
                    trainer_id=lr.view.incarnations, key=f"save-policy-{lr.name}-{time.time_ns()}",
                    **lr.view.train_pin).result(timeout=600)
            except Exception as exc:  # its worker is gone or restarted: say so, save the others
                warnings.warn(RunWarning(f"learner {lr.name!r}: policy not saved ({type(exc).__name__}: {exc})"),
                              stacklevel=2)
        return saved
