"""The controller: the step loop of a run, in the ``streamrl`` process. Read this first (or,
without Dask, ``streamrl/reference.py``: the same algorithm in one process).

Per step it draws the step's prompts, has them placed (``flow/dispatch.py``) and submits
one generate and one reward task per bundle of groups, train tasks on micro-batches of scored
groups, one optimizer step, and the publication of the new weights to every generate worker
(``flow/submit.py``, ``flow/weights.py``). It passes *futures* from task to task, so Dask moves
samples and weights worker to worker; the controller only sees small stats. How a step overlaps
with the next is the mode's business (``flow/modes.py``); where workers are, the topology's
(``flow/topology.py``). With ``algorithm.epochs = E`` the weights are published after the last
pass, so the policy version counts steps (batches).

Features that act inside a step -- the elastic generate pool, the side learners, held-out
evaluation, served traffic -- are step extensions (``contracts/step_extension.py``): the step calls
each extension at its moments (placed, pinned, trained, before_publish, published, record, ...)
and has no branch on any of them. They see the run through a ``RunContext``, which the
controller keeps current; never the controller itself.
"""

from __future__ import annotations

import threading
import warnings
import time
from dataclasses import replace
from pathlib import Path

from distributed import Client, Future, SpecCluster, wait

from streamrl.flow import modes, placement, submit
from streamrl.checkpoints import folders
from streamrl.errors import Interrupted, RunFailed, RunStopped, RunWarning, UserError
from streamrl.contracts.step_extension import RunContext, StepExtension
from streamrl.flow.feed import Feed
from streamrl.plugins.resolve import Resolved
from streamrl.flow.topology import Topology
from streamrl.flow.weights import publish, relay_sites, wait_loaded
from streamrl.flow.dispatch import Dispatcher
from streamrl.run import extensions
from streamrl.telemetry import bubbles
from streamrl.telemetry.record import last_epoch_stats, summarize
from streamrl.telemetry.stats import StepStats
from streamrl.telemetry.text import message_line

#: Seconds a closing run waits for the scheduler to cancel what was submitted ahead.
CANCEL_S = 30.0


class Controller:
    """Runs the steps of one run on a cluster; see the module docstring."""

    def __init__(self, resolved: Resolved, client: Client, pools: dict[str, dict[str, str]],
                 spec_cluster: SpecCluster | None = None):
        """``pools``: ``lifecycle.check_pools``; ``spec_cluster``: the embedded cluster, which an
        elastic generate pool grows and shrinks."""
        r = self.recipe = resolved.recipe
        self.resolved, self.client = resolved, client
        can = resolved.trainer.capabilities()
        self.topology = Topology.of(client, pools, r.trainer.name, r.trainer.strategy, can,
                                    ranker=resolved.ranker is not None, spec_cluster=spec_cluster)
        # an engine whose samples depend only on weights, seed and prompt: make the run repeat
        # (each step's generation sees a fixed version, training takes a fixed order)
        self.repeatable = resolved.engine.capabilities().repeatable
        self.task = resolved.task.build_here()
        self.epochs = resolved.algorithm.build().epochs  # algorithms are light; built here only to ask
        # a feed admits generation from its thread while this one writes the record: the
        # dispatcher (placement and lessons) and the submission counters are shared
        self.lock = threading.Lock()
        # (a mode is a small strategy object: made here only to ask, as _start_over makes the run's)
        self.context = RunContext(client, resolved, self.task, self.topology, self.repeatable,
                                  feeds_ahead=modes.make(r.run.mode, r.run.max_staleness, r.run.steps).feeds)
        """What the extensions see of the run, and the one record of its version and last
        optimizer step (kept current here)."""
        self.extensions: list[StepExtension] = extensions.for_run(self.context)
        """The features that plug into the step, in the order they are called."""
        self.context.extensions = self.extensions
        # False: the engines keep the policy they started with (run.serve = "initial")
        self.context.publishes = all(e.publishes for e in self.extensions)
        self.clashes_said: set[str] = set()  # record fields a plugin tried to replace, each said once
        self._start_over()

    def _start_over(self) -> None:
        """The state of a run at its first step (no dispatcher until residents are placed)."""
        r = self.recipe
        self.mode = modes.make(r.run.mode, r.run.max_staleness, r.run.steps)
        self.dispatcher: Dispatcher | None = None
        self.context.version = 0
        self.context.last_optimizer_step = self.context.scheduler = None
        # the next step's training, handed over early (step(start_next_training=True)), and its groups
        self.next_training: Feed | None = None
        self.next_training_groups: list[Future] = []
        self.boundary: float | None = None  # when the last step's record was taken
        self.clock = None
        self.seen_uids: set[str] = set()
        self.generating: dict[int, list[Future]] = {}  # repeatable: generate tasks by the version they need
        self.submit_s, self.submitted_groups = 0.0, 0  # submitting generation, since the last record

    def place_residents(self) -> None:
        """Build the engines, trainer, reward, transfer and ranker on their workers, form the
        train group and start the clocks. Calling it again starts over from the initial weights."""
        topo, r = self.topology, self.recipe
        self._start_over()
        self._call("placing", self.context)  # (what is built beside the residents starts now)
        placement.place(self.client, self.resolved, {n: n for n in topo.generate}, topo.trainer, topo.rank,
                        topo.sharded)
        scheduler = self.resolved.build_scheduler()
        self.dispatcher = Dispatcher(self.client, topo, r.trainer.samples_per_prompt, scheduler)
        self.context.scheduler = scheduler
        self.clock = bubbles.snapshot(self.client)  # busy clocks at the last step boundary
        topo.form_train_group(r.trainer.strategy, r.cluster.startup_timeout)
        self._call("placed", self.context)

    # -- one step -------------------------------------------------------------------------
    def generate(self, step: int, min_version: int | None = None) -> list[Future]:
        """Draw ``step``'s prompts, place them and submit their generation (``submit.generation``);
        what the modes call. ``min_version`` defaults to the current policy version."""
        version = self.version if min_version is None else min_version
        for ext in self.extensions:  # a source of samples other than the task's prompts (served traffic)
            supplied = _called(ext, "samples", step, version)
            if supplied is not None:
                return supplied
        t0, t = time.time(), self.recipe.trainer
        try:
            prompts = self.task.prompts(step, t.prompts_per_step)
        except (UserError, RunFailed):
            raise
        except Exception as exc:  # the task's code (a plugin's, a dataset's), not streamrl's: one line
            raise RunStopped(f"task {self.recipe.task.name!r}: prompts() for step {step + 1} raised "
                            f"{type(exc).__name__}: {_text(exc)}") from None
        submit.check_prompts(self.recipe.task.name, step, prompts, t.prompts_per_step, self.seen_uids)
        with self.lock:
            placed = self.dispatcher.place(step, prompts)
        version = version if self.context.publishes else 0  # (the engines keep the starting model)

        def submitted(name: str | None, gen: Future) -> None:
            self._call("pinned", name, gen)
            if self.repeatable and self.context.publishes:  # the next version's loads wait for it
                # (nothing published: no load to wait, and no publication to let them go)
                self.generating.setdefault(version, []).append(gen)

        scored = submit.generation(self.topology, self.recipe, step, prompts, placed, version, submitted,
                                   movable=self.dispatcher.movable)
        with self.lock:
            self.submit_s += time.time() - t0
            self.submitted_groups += len(prompts)
        return scored

    def step(self, step: int, start_next_training: bool = False) -> dict:
        """Run one full step in the recipe's mode and return its ``metrics.jsonl`` record.

        ``start_next_training`` (``async`` mode): once this step's weights are published, hand
        the train pool the next step's groups (from a thread, as they are scored) before this
        step's result and bookkeeping, so the trainer goes from one step to the next without waiting
        for the controller. The caller must then run the next step before a checkpoint."""
        # A step runs boundary to boundary (what the runner does between two steps included), so
        # step times add up to the run's wall time; a step whose training was started early (by
        # the step before) began before this call.
        t0 = self.boundary if self.boundary is not None else time.time()
        early, self.next_training = self.next_training, None
        if early is not None and early.step == step:
            last, passes = early.result()
            # (taken: held past its step, a lost reward worker's groups were made and scored again)
            scored, self.next_training_groups = self.next_training_groups, []
        else:
            scored = self.mode.scored(self.generate, step)
            last, passes = submit.epochs(self.topology, self.recipe, self.epochs, step, scored,
                                         self.mode.streams, self.last_step, ordered=self.repeatable)
        admitted = time.time()
        self._call("trained", step, scored)
        self.context.last_optimizer_step = last
        step_fut = last[0]
        trained_at: list[float] = []
        step_fut.add_done_callback(lambda _: trained_at.append(time.time()))
        version = step + 1  # one published policy per step, however many optimizer steps
        generate_workers = len(self.topology.generate)  # those that generated this step's groups
        self._call("before_publish", version, step_fut)
        # Published before the step is done: the export depends on the optimizer step and runs
        # right after it on the train worker (its priority is above any train task), without
        # waiting for the controller to hear of the step and come back.
        loads = self._publish(step_fut, version) if self.context.publishes else []
        self._call("published", version, loads)
        self.mode.published(version, loads)
        held = any(e.holds_boundary for e in self.extensions)
        feeding = start_next_training and self.mode.feeds and not held and self.mode.ahead(step + 1)
        if feeding:
            self.next_training = Feed(step + 1, self._feed, step + 1, step_fut)
        step_stats = step_fut.result()
        if feeding:  # meanwhile, here: the next step's admission (it waits for the weights just published)
            self.mode.admit(self.generate, step + 1)
        t_trained = trained_at[0] if trained_at else time.time()
        self.context.version = version
        if self.epochs > 1:
            last_epoch = last_epoch_stats([f.result() for f in passes[-1]], self.epochs)
            step_stats = replace(step_stats, extra={**step_stats.extra, **last_epoch})
        # The step is done: later tasks need not depend on it. Holding it would make Dask, if the
        # train worker died, replay the whole run's lineage to recompute a result nobody needs.
        # (A next step started early holds its own optimizer steps.)
        if self.next_training is None:
            self.context.last_optimizer_step = None
        return self._record(step, passes[0], step_stats, t0, t_trained, admitted, generate_workers)

    def _publish(self, after: Future | None, version: int, tag: str = "") -> list[Future]:
        topo = self.topology
        with self.lock:  # repeatable: generation admitted under older versions finishes with them
            older = [f for v in sorted(self.generating) if v < version for f in self.generating.pop(v)]
        pins = topo.live_generate_pins()  # (a lost worker is no member of this version's group)
        loads = publish(self.client, after, version, topo.train_pin, pins, tag=tag,
                        trainer_id=topo.incarnations, loads_after=[f for f in older if not f.done()] or None,
                        sites=relay_sites(self.resolved.transfer.config, topo.generate), sender=topo.sender)
        for name, load in zip(pins, loads):
            self._call("pinned", name, load)
        return loads

    def _record(self, step: int, trains: list[Future], step_stats: StepStats, t0: float, t_trained: float,
                admitted: float, generate_workers: int) -> dict:
        """The step's record: the train tasks' stats, the pools' busy clocks, dispatch lessons."""
        before, self.clock = self.clock, bubbles.snapshot(self.client)
        self.boundary = self.clock[0]
        pools = bubbles.pool_bubbles(before, self.clock, self.topology.pools)
        record = summarize(step, self.version, [f.result() for f in trains], step_stats, t0, t_trained, self.clock[0])
        record.pools = pools
        # the accounting window runs boundary to boundary, so it includes the controller's own
        # time between steps (writing metrics), which is idle time for every pool too
        record.accounting_window_s = round(self.clock[0] - before[0], 4)
        record.controller_s = round(admitted - before[0], 4)
        with self.lock:
            record.submit_s, record.submitted_groups = round(self.submit_s, 4), self.submitted_groups
            self.submit_s, self.submitted_groups = 0.0, 0
            record.extra = self.dispatcher.learn(step, record.sample_log)
        record.generate_workers = generate_workers
        self._call("record", step, record)
        for name in record.clashes():  # (said once: the same plugin says it every step)
            if name not in self.clashes_said:
                self.clashes_said.add(name)
                warnings.warn(f"the step record's field {name!r} is streamrl's own: the value an algorithm, reward "
                              "or plugin gave under that name is left out (name it differently)", RunWarning,
                              stacklevel=2)
        return record.as_dict()

    def _feed(self, step: int, previous: Future) -> tuple[list[Future], list[list[Future]]]:
        # (in the Feed's thread) once the step before is done -- waited for here, not passed
        # as a dependency: a chain of steps each depending on the last would keep the whole
        # run's lineage in the scheduler -- the step's groups to the trainer as they are scored
        wait([previous])
        scored = self.next_training_groups = self.mode.take(step)
        return submit.epochs(self.topology, self.recipe, self.epochs, step, scored, True, after=[],
                             ordered=self.repeatable)

    # -- checkpoints (written by ``checkpoints/saving.py``) ---------------------------------
    def resume(self, checkpoint: Path) -> int:
        """After :meth:`place_residents`: restore the trainer, put its weights on every engine
        (so nothing generates with the base weights), and continue the mode; returns the next step."""
        state = folders.read(checkpoint)
        # every rank starts from the same state
        folders.restore_trainer(self.client, self.topology.train_pins(), checkpoint)
        self.dispatcher.restore(checkpoint)  # what was learned about lengths, ranker included
        self.context.version = state["policy_version"]
        self._call("resume", checkpoint)
        if self.context.publishes:
            wait_loaded(self._publish(None, self.version, tag=f"-resume-{time.time_ns()}"))
        self.mode.resume(state["next_step"], self.version)
        return state["next_step"]

    def _cancel(self, futures: list[Future]) -> None:
        # Dask's cancel waits on the scheduler without a bound, and the run is closing because a
        # step timed out, often as its scheduler stopped answering: the close must end
        if not futures:
            return
        done, failed = threading.Event(), []

        def cancel() -> None:
            try:
                self.client.cancel(futures)
            except Exception as exc:  # noqa: BLE001 -- said below, from the closing thread
                failed.append(exc)
            finally:
                done.set()
        threading.Thread(target=cancel, name="streamrl-cancel", daemon=True).start()
        if not done.wait(CANCEL_S):
            warnings.warn(f"cancelling {len(futures)} tasks submitted ahead got no answer from the scheduler "
                          f"within {CANCEL_S:.0f} s; the run goes on closing", RunWarning, stacklevel=2)
        elif failed:
            warnings.warn(f"cancelling {len(futures)} tasks submitted ahead failed: {type(failed[0]).__name__}: "
                          f"{message_line(failed[0])}; the run goes on closing", RunWarning, stacklevel=2)

    def close(self) -> None:
        """Cancel generation submitted ahead (``async``): a controller that resumes on the same
        cluster submits the same keys and must not be handed the old, stale samples."""
        ahead = [f for fs in self.mode.pending() for f in fs]
        if self.next_training is not None:  # the next step's generation, taken by a feed in flight
            ahead += self.next_training_groups
        self._cancel(ahead)
        self._call("close")
        # what the task and the scheduler hold (a dataset's files, a plugin's connections) goes
        # with the run; a close that fails is a warning, the run's own outcome is what must show
        for what, part in (("task", self.task), ("scheduler", self.context.scheduler)):
            try:
                if part is not None:
                    part.close()
            except Exception as exc:  # noqa: BLE001
                warnings.warn(f"{what} {type(part).__name__}: close() raised {type(exc).__name__}: {_text(exc)}",
                              RunWarning, stacklevel=2)

    # -- the extensions ---------------------------------------------------------------------
    def _call(self, moment: str, *args) -> None:
        for ext in self.extensions:
            _called(ext, moment, *args)

    def extension(self, kind: type) -> StepExtension | None:
        """The run's extension of class ``kind`` (None: the run has none)."""
        return self.context.extension(kind)

    @property
    def version(self) -> int:
        """The policy version of the last step trained (the one published last)."""
        return self.context.version

    @property
    def last_step(self) -> list[Future] | None:
        """Every rank's last optimizer step while a step's training runs (None between steps)."""
        return self.context.last_optimizer_step

    @property
    def training_ahead(self) -> bool:
        """Whether the next step's training began before this step's record (``async``'s feed):
        the next step must run before a checkpoint."""
        return self.next_training is not None

    def started(self, run_dir: Path) -> list[str]:
        """After placement, before the first step: every extension's lines for the console."""
        return [line for ext in self.extensions for line in _lines(_called(ext, "started", run_dir))]

    def begin(self, checkpoint: Path | None, run_dir: Path) -> tuple[int, list[str]]:
        """Everything before the first step, in order: the residents placed, the run's state
        restored from ``checkpoint`` (None: a new run), the extensions started. Returns the first
        step to run and the lines for the console."""
        self.place_residents()
        first = self.resume(checkpoint) if checkpoint is not None else 0
        lines = [f"resumed from {checkpoint.name}: step {first + 1}, policy v{self.version}"] if checkpoint else []
        return first, lines + self.started(run_dir)

    def between_steps(self, done: int, run_dir: Path) -> list[str]:
        """After step ``done``'s record: every extension's work between steps (requests from
        outside the run); lines for the console."""
        return [line for ext in self.extensions for line in _lines(_called(ext, "between_steps", done, run_dir))]

    def checkpoint_writer(self, next_step: int, previous: Path | None):
        """What the extensions add to a checkpoint: one function writing all of it into the
        checkpoint's folder, or None."""
        writers = [w for w in (_called(e, "checkpoint", next_step, previous) for e in self.extensions) if w is not None]
        if not writers:
            return None
        return lambda folder: [write(folder) for write in writers]

    def stopping(self) -> None:
        """A stop was requested (called from another thread): the extensions stop waiting."""
        self._call("stopping")

    def finish(self, policy_dir: Path) -> None:
        """The last step is done: the extensions finish before the policy is saved."""
        self._call("finish", policy_dir)



def _called(ext: StepExtension, moment: str, *args):
    """``ext``'s method of ``moment``, called. A plugin's extension that raises stops the run (it
    is part of the loop), in one line naming it and the moment, not in a traceback from inside
    the controller; a built-in's exception is a bug of streamrl and goes up as it was raised."""
    try:
        return getattr(ext, moment)(*args)
    except (UserError, RunFailed, Interrupted):  # (said for the user already)
        raise
    except Exception as exc:
        kind = type(ext)
        if kind.__module__.split(".")[0] == "streamrl":
            raise
        raise RunStopped(f"step extension {kind.__qualname__} (module {kind.__module__}): {moment}() raised "
                        f"{type(exc).__name__}: {_text(exc)}; the run stopped (a step extension is part of "
                        "the step loop)") from None


def _lines(got) -> list[str]:
    """An extension's console lines as text: None is none, one string is one line."""
    if got is None:
        return []
    if isinstance(got, str):
        return [got]
    try:
        return [str(line) for line in got]
    except TypeError:  # (not a list of lines: one line of whatever it is)
        return [str(got)]


def _text(exc: BaseException) -> str:
    return message_line(exc, 300)
