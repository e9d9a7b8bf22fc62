"""Dispatch: the ranker's scores and the scheduler's placement of each step's prompt groups, and
what the run learns about output lengths after the step.

The ranker is a resident on the rank worker (its state survives across steps); the scheduler
runs here, in the ``streamrl`` process. A :class:`Dispatcher` owns everything both need
between steps: the prompts and predictions of steps in flight, the observed lengths, the
engine's decode-latency model.
"""

from __future__ import annotations

import json
import math
import numbers
import time
import warnings
from pathlib import Path

from distributed import Client, Future

from streamrl.api import Assignment, DispatchContext, Prompt, Scheduler
from streamrl.errors import RunStopped, RunWarning, UserError
from streamrl.on_worker import ranker_tasks, task_functions
from streamrl.flow.topology import Topology
from streamrl.ranking.recall import top_recall
from streamrl.telemetry.text import message_line


#: How long a ranking, a lesson or the ranker's state may take before the run goes on without
#: it (the step placed without scores; the checkpoint without the ranker's state): its worker may
#: be gone, and a lesson Dask would recompute there may never run.
RANKER_WAIT_S = 120.0


class Dispatcher:
    """Ranks and places prompts before a step; teaches the ranker after it."""

    def __init__(self, client: Client, topology: Topology, samples_per_prompt: int, scheduler: Scheduler | None):
        """``topology``: where the generate workers (read at every placement: an elastic pool
        changes them) and the ranker are."""
        self.client = client
        self.topology = topology
        self.samples_per_prompt = samples_per_prompt
        self.scheduler = scheduler
        self.movable = bool(scheduler is not None and getattr(scheduler, "moves_samples", False))
        """The scheduler moves running samples between instances: chunks are generated to let them."""
        self.rank_worker = topology.rank
        """Name of the worker holding the ranker; None: no ranker."""
        self.step_latency = None
        if scheduler is not None:  # the engines are alike: one instance's profile stands for all
            self.step_latency = client.submit(task_functions.engine_latency, key="engine-latency", pure=False,
                                              workers=[topology.generate[0]]).result()
        self.step_prompts: dict[int, list[Prompt]] = {}
        self.predicted: dict[int, list[float]] = {}
        self.scheduler_metrics: dict[int, dict] = {}
        self.observed_lengths: list[int] = []
        self.prompt_tokens = 0.0
        self.last_observe: Future | None = None
        self.observe_failed = False
        self.ranker_problems: set[str] = set()  # what the ranker got wrong, each said once
        self.scheduler_problems: set[str] = set()  # and the scheduler

    def place(self, step: int, prompts: list[Prompt]) -> dict[int, list[tuple[str, float, tuple[int, ...]]]]:
        """``{prompt index: [(worker name, priority, samples)]}``, one entry per chunk of the
        group (``samples`` empty: the whole group); empty without a scheduler (Dask places the
        tasks)."""
        self.step_prompts[step] = prompts
        scores = [0.0] * len(prompts)
        # (copies: a scheduler that sorts or trims what it is given must not change the run's own lists)
        ctx = DispatchContext(self.samples_per_prompt, list(self.observed_lengths), self.prompt_tokens, self.step_latency)
        workers = list(self.topology.generate)
        if self.rank_worker is not None and (self.scheduler is None or self._needs_scores(workers, ctx)):
            try:
                ranked = self.client.submit(ranker_tasks.rank_prompts, prompts, after=self._pending_lesson(),
                                            key=f"rank-{step}", **self._on_ranker()).result(timeout=RANKER_WAIT_S)
            except RunStopped:  # (the step's deadline)
                raise
            except Exception as exc:  # (its worker lost, or silent): placed without scores, the ranker starts over
                self.last_observe = None
                ranked = f"rank() did not answer ({type(exc).__name__}: {exc})"
            if isinstance(ranked, str):  # the ranker failed: this step is placed without its scores
                self._ranker_failed(ranked)
            else:
                scores = ranked
                self.predicted[step] = scores
        if self.scheduler is None:
            return {}
        try:
            placed = self.scheduler.dispatch(list(prompts), list(scores), list(workers), ctx)
        except UserError:
            raise
        except RunStopped:  # the step's deadline, landing in a plugin's call: the run's, not the plugin's
            raise
        except Exception as exc:  # this step's groups go where Dask puts them: the run goes on, said once
            self._scheduler_failed("dispatch()", _raised(exc), "this step's groups are placed by Dask")
            return {}
        self.scheduler_metrics[step] = self._metrics()
        return placement(placed, workers, self.samples_per_prompt, len(prompts))

    # -- a scheduler plugin's mistakes: each kind said once; placement goes on without it -------
    def _needs_scores(self, workers: list[str], ctx: DispatchContext) -> bool:
        try:
            return bool(self.scheduler.needs_scores(workers, ctx))
        except RunStopped:  # (the step's deadline)
            raise
        except Exception as exc:
            self._scheduler_failed("needs_scores()", _raised(exc), "the ranker scores every step")
            return True

    def _metrics(self) -> dict[str, float]:
        """The scheduler's ``metrics()``: its numbers (a value that is not a number is left out, a
        failure leaves them all out: a record field must not end a run)."""
        try:
            got = self.scheduler.metrics()
            got = dict(got) if got is not None else {}
        except RunStopped:  # (the step's deadline)
            raise
        except Exception as exc:
            self._scheduler_failed("metrics()", _raised(exc), "its numbers are left out of the record")
            return {}
        out = {}
        for key, value in got.items():
            try:  # (a numpy or one-element torch number is a number; text is not, though float() reads it)
                if isinstance(value, (str, bytes, bool)):
                    raise TypeError
                out[str(key)] = float(value)
            except RunStopped:  # (the step's deadline)
                raise
            except Exception:
                self._scheduler_failed("metrics()", f"gave {key!r} as a {type(value).__name__}, not a number",
                                       "that field is left out of the record")
        return out

    def _scheduler_failed(self, where: str, what: str, meanwhile: str) -> None:
        kind = f"{where} {what.split(':')[0]}"  # (once per method and kind of problem)
        if kind not in self.scheduler_problems:
            self.scheduler_problems.add(kind)
            warnings.warn(f"scheduler {type(self.scheduler).__name__}: {where} {what}; {meanwhile}; the run goes on",
                          RunWarning, stacklevel=3)

    def learn(self, step: int, sample_log: list[dict]) -> dict:
        """After a step: feed the observed lengths to the ranker; returns the record's dispatch
        fields (``generate_makespan_s``, ``ranker_recall``, ``first_sample_recall``: the same
        recall for the estimate each group gives of itself when its first sample finishes, the
        scheduler's metrics)."""
        # what was kept for the step goes, whatever comes of it (a long run kept it all)
        prompts, predicted = self.step_prompts.pop(step, None), self.predicted.pop(step, None)
        placed_metrics = self.scheduler_metrics.pop(step, {})
        if prompts is None or not sample_log:
            # the step's samples were not the task's prompts (served traffic), or there were none
            # (a stop): nothing to learn
            return {}
        by_prompt: dict[str, list[int]] = {}
        for x in sample_log:
            by_prompt.setdefault(x["uid"].rsplit("-", 1)[0], []).append(x["response_len"])
        lengths = [by_prompt.get(p.uid, []) for p in prompts]
        self.observed_lengths = (self.observed_lengths + [x["response_len"] for x in sample_log])[-8192:]
        self.prompt_tokens = sum(x["prompt_len"] for x in sample_log) / max(len(sample_log), 1)
        out = {"generate_makespan_s": max(x["gen_end"] for x in sample_log) - min(x["submitted"] for x in sample_log)}
        out.update(placed_metrics)
        actual = [sum(math.log(max(n, 1)) for n in ls) / max(len(ls), 1) for ls in lengths]
        # the estimate a group gives of itself once its first sample is done: that sample's length
        first: dict[str, tuple[float, int]] = {}
        for x in sample_log:
            g = x["uid"].rsplit("-", 1)[0]
            if g not in first or x["gen_end"] < first[g][0]:
                first[g] = (x["gen_end"], x["response_len"])
        if len(prompts) > 1 and all(p.uid in first for p in prompts):
            out["first_sample_recall"] = top_recall([math.log(max(first[p.uid][1], 1)) for p in prompts], actual, 0.2)
        if self.scheduler is not None and not self.observe_failed:
            try:
                self.scheduler.observe(prompts, lengths)
            except RunStopped:  # (the step's deadline)
                raise
            except Exception as exc:  # it only tunes placement: the run goes on, said once
                self.observe_failed = True
                warnings.warn(f"scheduler: observe() raised {type(exc).__name__}: {exc}; its lessons are "
                              "skipped from now on", RunWarning, stacklevel=2)
        if predicted is not None:  # a step placed without the ranker's scores teaches it nothing
            out["ranker_recall"] = top_recall(predicted, actual, 0.2)
            self._check_lesson()
            self.last_observe = self.client.submit(
                ranker_tasks.observe_lengths, prompts, lengths, after=self._pending_lesson(), key=f"observe-{step}",
                **self._on_ranker())
        return out

    def _pending_lesson(self) -> Future | None:
        """The last lesson while it runs, for the next ranker task to wait for; None once done:
        a finished lesson made a dependency would keep every lesson before it in the scheduler
        (each the next's dependency), the whole run's prompts, replayed whole if the worker died."""
        last = self.last_observe
        return last if last is not None and not last.done() else None

    def finish(self) -> None:
        """Wait for the ranker's last lesson."""
        if self.last_observe is not None:
            try:
                self.last_observe.result(timeout=RANKER_WAIT_S)
            except RunStopped:  # (the step's deadline)
                raise
            except Exception as exc:  # (its worker lost): the run's steps are done, the lesson only ordered work
                self._ranker_failed(f"its last lesson did not end ({type(exc).__name__}: {exc})")
                return
            self._check_lesson()

    def _check_lesson(self) -> None:
        # the last lesson, when it is done: one that failed is said once (the ranker goes on
        # with what it learned before; its scores still order work)
        done = self.last_observe
        if done is not None and done.done() and done.status == "finished" and isinstance(done.result(), str):
            self._ranker_failed(done.result())

    def _on_ranker(self) -> dict:
        """Where the ranker's tasks run: its worker by its ``worker:<name>`` resource, which a
        worker its nanny restarted still offers (a worker's name is an address to Dask's
        scheduler once a task is submitted, and a restarted worker has another: a task pinned
        by name waited for the old one for ever)."""
        return dict(self.topology.pins.get(self.rank_worker) or {"workers": [self.rank_worker],
                                                                 "allow_other_workers": False})

    def _ranker_failed(self, what: str) -> None:
        kind = what.split(":")[0]  # ("predict() raised ZeroDivisionError"): once per kind of problem
        if kind not in self.ranker_problems:
            self.ranker_problems.add(kind)
            warnings.warn(f"ranker: {what}; the run goes on (a step without its scores is placed as if every "
                          "prompt were alike)", RunWarning, stacklevel=3)

    # -- checkpoints: what was learned about output lengths survives a resume ------------------
    def checkpoint_files(self, tag: str) -> dict[str, bytes]:
        """``dispatch.json`` (the lengths the scheduler has seen) and, with a ranker,
        ``ranker.pt`` (its state after the lessons submitted so far)."""
        state = {"observed_lengths": self.observed_lengths, "prompt_tokens": self.prompt_tokens}
        if self.scheduler is not None and hasattr(self.scheduler, "state_dict"):
            try:  # (what a scheduler learned across steps: the longtail one's length spreads)
                learned = self.scheduler.state_dict()
                if not isinstance(learned, dict):
                    raise TypeError(f"it gave a {type(learned).__name__}, not a dict")
                json.dumps(learned)
                state["scheduler"] = learned
            except Exception as exc:  # a plugin's mistake: the checkpoint is still written
                self._scheduler_failed("state_dict()", _raised(exc), "a resumed run's scheduler learns again")
        files = {"dispatch.json": json.dumps(state).encode()}
        if self.rank_worker is not None:
            try:
                files["ranker.pt"] = self.client.submit(
                    ranker_tasks.ranker_state, after=self.last_observe, key=f"ranker-state-{tag}", pure=False,
                    **self._on_ranker()).result(timeout=RANKER_WAIT_S)
            except RunStopped:  # (the step's deadline)
                raise
            except Exception as exc:  # the checkpoint is still written: a resume's ranker learns again
                self.last_observe = None  # (a lesson that never ends must not hold the next ranking)
                warnings.warn(f"ranker: its state could not be saved ({type(exc).__name__}: {exc}); "
                              "a resumed run's ranker learns again", RunWarning, stacklevel=2)
        return files

    def restore(self, checkpoint: Path) -> None:
        """Take back what :meth:`checkpoint_files` wrote (a checkpoint without them -- an older
        one -- leaves everything as it starts). The next ranking waits for the ranker's load."""
        saved = checkpoint / "dispatch.json"
        if saved.exists():
            state = json.loads(saved.read_text())
            self.observed_lengths, self.prompt_tokens = state["observed_lengths"], state["prompt_tokens"]
            if "scheduler" in state and self.scheduler is not None and hasattr(self.scheduler, "load_state_dict"):
                try:
                    self.scheduler.load_state_dict(state["scheduler"])
                except Exception as exc:  # a plugin's mistake must not end a resume: it only places work
                    self._scheduler_failed("load_state_dict()", _raised(exc), "it learns again from this run's samples")
        blob = checkpoint / "ranker.pt"
        if self.rank_worker is not None and blob.exists():
            self.last_observe = self.client.submit(
                ranker_tasks.load_ranker_state, blob.read_bytes(), key=f"ranker-restore-{time.time_ns()}", pure=False,
                **self._on_ranker())
            try:
                self.last_observe.result(timeout=RANKER_WAIT_S)
            except RunStopped:  # (the step's deadline)
                raise
            except Exception as exc:  # a ranker plugin's mistake must not end a resume: it only orders work
                self.last_observe = None
                warnings.warn(f"ranker: could not take back its state from {blob} ({type(exc).__name__}: {exc}); "
                              "it learns again from this run's samples", RunWarning, stacklevel=2)


def _raised(exc: Exception) -> str:
    return f"raised {type(exc).__name__}: {message_line(exc, 300)}"


def placement(placed: list[Assignment], workers: list[str], samples_per_prompt: int,
              prompts: int | None = None) -> dict[int, list[tuple[str, float, tuple[int, ...]]]]:
    """A scheduler's assignments as ``{prompt index: [(worker, priority, samples)]}``, checked:
    a list (or any iterable) of :class:`Assignment`, every index one of the ``prompts`` it was
    given, every worker one of ``workers``, every priority a number (numpy's too), every
    group's samples covered exactly once. A plugin's mistake is one line naming it
    (:class:`UserError`)."""
    said = "scheduler: dispatch()"
    try:
        placed = list(placed)  # (once: a generator would be used up by the first check)
    except TypeError:
        raise UserError(f"{said} returned {type(placed).__name__}; expected a list of Assignment") from None
    wrong = [a for a in placed if not isinstance(a, Assignment)]
    if wrong:
        raise UserError(f"{said} returned a {type(wrong[0]).__name__} among its assignments; expected Assignment")
    outside = [a for a in placed if isinstance(a.index, bool) or not isinstance(a.index, numbers.Integral)
               or (prompts is not None and not 0 <= a.index < prompts)]
    if outside:
        raise UserError(f"{said} placed prompt index {outside[0].index!r}; expected a position in the list of "
                        f"{prompts if prompts is not None else 'the'} prompts it was given")
    unknown = sorted({str(a.worker) for a in placed} - set(workers))
    if unknown:
        raise UserError(f"{said} placed a prompt on {unknown[0]!r}, which is not one of the "
                        f"generate workers it was given ({', '.join(workers)})")
    odd = [a for a in placed if isinstance(a.priority, bool) or not isinstance(a.priority, numbers.Real)
           or math.isnan(a.priority)]
    if odd:
        raise UserError(f"{said} gave prompt {odd[0].index} the priority {odd[0].priority!r}; "
                        "expected a number (higher is admitted first)")
    bad = [a for a in placed if not isinstance(a.samples, (list, tuple, range))
           or not all(isinstance(k, numbers.Integral) and not isinstance(k, bool) for k in a.samples)]
    if bad:
        raise UserError(f"{said} gave prompt {bad[0].index} the samples {bad[0].samples!r}; expected a tuple of "
                        "sample numbers (empty: the whole group)")
    out: dict[int, list[tuple[str, float, tuple[int, ...]]]] = {}
    for a in placed:
        out.setdefault(int(a.index), []).append((a.worker, float(a.priority), tuple(int(k) for k in a.samples)))
    for i, pieces in out.items():
        covered = sorted(k for p in pieces for k in (p[2] or range(samples_per_prompt)))
        if covered != list(range(samples_per_prompt)):
            raise UserError(f"scheduler: dispatch() placed prompt {i}'s samples as {covered}; a group's chunks must "
                            f"cover its {samples_per_prompt} samples exactly once")
    return out
