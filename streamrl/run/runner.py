"""``streamrl recipe run`` and ``resume``: validate, bring up the cluster, run the controller
(checkpointing as ``run.checkpoint_every`` says), save the result, and keep the run folder
(``run/run_folder.py``) true whatever happens."""

from __future__ import annotations

import os
import random
import sysconfig
import time
import traceback
from contextlib import ExitStack, nullcontext
from pathlib import Path

from distributed import KilledWorker, performance_report, span
from rich.console import Console
from rich.markup import escape

from streamrl.cluster import lifecycle, quiet
from streamrl.errors import Interrupted, RunFailed, UserError
from streamrl.flow import submit
from streamrl.checkpoints import folders
from streamrl.checkpoints import saving
from streamrl.run.controller import Controller
from streamrl.run.observers import Called, Observers, plugin_observers, run_end, run_start, sink_observers
from streamrl.on_worker.resident import ComponentError, ResidentLost
from streamrl.plugins.resolve import Resolved, resolve
from streamrl.run.run_folder import RunFolder
from streamrl.run.stopping import StopRequest
from streamrl.run.watchdog import Watchdog
from streamrl.recipe.recipe import LoadedRecipe
from streamrl.telemetry import dashboard
from streamrl.telemetry.console import RunDisplay, StepNotes, reward_errors_line, summary_table, warning
from streamrl.telemetry.warnings_log import WarningsLog
from streamrl.telemetry.report import write_report
from streamrl.telemetry.trace import TraceRecorder
from streamrl.telemetry.text import message_line, printable

__all__ = ["resolve", "run", "load_for_resume", "validate"]


def validate(loaded: LoadedRecipe) -> Resolved:
    """``streamrl recipe validate``: both phases of validation, then what the run does first on
    the client -- build the task and draw the first step's prompts (a dataset read, its fields
    found) -- so a recipe that validates does not stop at its first step; no cluster."""
    resolved = resolve(loaded)
    r = loaded.recipe
    task = resolved.task.build_here()
    try:
        prompts = task.prompts(0, r.trainer.prompts_per_step)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"task {r.task.name!r}: drawing the first step's prompts failed: {type(exc).__name__}: "
                        f"{message_line(exc, 300)}") from None
    submit.check_prompts(r.task.name, 0, prompts, r.trainer.prompts_per_step, set())
    return resolved


def load_for_resume(run_dir: str | Path, overrides: list[str] = ()) -> tuple[LoadedRecipe, Path]:
    """The recipe a run folder was started with (``--set`` overrides on top) and the folder."""
    loaded, folder = RunFolder.for_resume(run_dir, overrides)
    return loaded, folder.path

def _steps(r, controller: Controller, folder: RunFolder, first: int, stop: StopRequest, observers: Observers,
           warn, watchdog: Watchdog, console_line=print) -> None:
    """The run's steps from ``first``: each step's record to the folder, then to the observers
    (``run/observers.py``); checkpoints as ``run.checkpoint_every`` says, and after a stop
    request (then :class:`Interrupted`)."""
    every = r.run.checkpoint_every

    def checkpoint_after(done: int) -> bool:
        return done == r.run.steps or bool(every and done % every == 0)

    notes = StepNotes()
    for step in range(first, r.run.steps):
        # (the first step loads models and compiles: it gets twice as long)
        with watchdog.watching(f"step {step + 1}", r.run.step_timeout_s * (2 if step == first else 1)):
            # The next step's training may start before this step's record is written, unless a
            # checkpoint must capture the weights right after this step.
            m = controller.step(step, start_next_training=not (stop.requested or checkpoint_after(step + 1)))
            folder.record(m)
            observers.step(m)
            for note in notes.of(m):
                warn(note)
            done = step + 1
            for line in controller.between_steps(done, folder.path):  # e.g. ``streamrl learners add|remove``
                console_line(line)
            stop.stop_now_if_asked_twice()
        if stop.requested and controller.training_ahead:
            continue  # the next step is already training: stop after it
        # a run stops only on a checkpoint it wrote after the stop was asked for: a signal
        # that comes later is seen at the next step
        stopping = stop.requested and done < r.run.steps
        if stopping or checkpoint_after(done):
            # (a deadline of its own: a step that ended near its deadline must not fail in the
            # checkpoint after it, a stop asked for losing every step since the last one)
            with watchdog.watching(f"the checkpoint after step {done}", r.run.step_timeout_s), span("checkpoint"):
                folder.metrics.sync()  # (the records it counts on the disk before it is)
                saved = saving.checkpoint(controller, folder.path, done, len(folder.records))
            stopping = stop.requested and done < r.run.steps  # (asked while it was written: stop on it)
            folder.mark("interrupted" if stopping else "running", step=done, checkpoint=str(saved))
        stop.stop_now_if_asked_twice()  # (a second signal lost while the checkpoint was written)
        if stopping:
            raise Interrupted(f"stopped after step {done} of {r.run.steps}; checkpoint {saved.name} written. "
                              f"Resume with: {folder.resume_command()}")


def _killed(exc: KilledWorker, r, folder: RunFolder) -> str:
    """The line for a task that took down every worker it was tried on: which task, whose code
    it runs, and how to go on."""
    key = str(exc.task)
    whose = (f"the agent code of task.path ({r.task.options().get('path', '?')}) runs in it" if key.startswith("agent-")
             else "the code it runs (a reward, a plugin, the model) ended its process")
    return (f"task {key} took down every worker it ran on ({exc.allowed_failures + 1} tries, os._exit, a crash or "
            f"memory); {whose}; the run stopped, {folder.go_on()}")


def _not_saved(exc: Exception, folder: RunFolder) -> str:
    """The line for a run whose steps all ran and whose trained policy could not be written
    (a model transformers refuses to save, a full disk): what failed, and what is kept."""
    ckpt = folder.latest_checkpoint()
    kept = (f"the last checkpoint is {ckpt.name} (its trainer state holds the policy it trained)" if ckpt is not None
            else "no checkpoint was written (run.checkpoint_every)")
    return (f"every step ran, but the trained policy could not be saved to {folder.path / 'policy'} "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}); {kept}; "
            "metrics.jsonl has every step")


def _as_said(exc: BaseException, r, folder: RunFolder, controller: Controller | None) -> BaseException:
    """The run's one failure policy: the folder marks the failure, and what the user is shown
    is one line for what is not a bug of streamrl (a component that cannot be built, a task
    that kills its workers, a resident lost with its worker); anything else as it was raised."""
    folder.failed(exc)
    if isinstance(exc, ComponentError):  # a component that cannot be built on a worker
        return UserError(str(exc))
    if isinstance(exc, KilledWorker):  # a task whose code ends its process, wherever it runs
        return RunFailed(_killed(exc, r, folder))
    if isinstance(exc, ResidentLost):  # the trainer's state (or the endpoint) died with its worker
        return RunFailed(f"{_who_was_lost(exc, controller)}; the run stopped, {folder.go_on()}")
    frame = _plugin_frame(exc) if isinstance(exc, Exception) else None
    if frame is not None:  # a plugin's code (an engine's, a trainer's, a transfer's) raised, here or on a worker
        text = message_line(exc, 300)
        return RunFailed(f"{type(exc).__name__}: {text} (raised in a plugin's code: {frame}); the run stopped, "
                         f"{folder.go_on()}")
    return exc


#: Top-level packages streamrl is built on: a frame in them is not a plugin's (an error raised
#: there was called from somewhere, and that somewhere is what names the culprit).
LIBRARIES = {"torch", "transformers", "tokenizers", "safetensors", "accelerate", "peft", "numpy", "distributed",
             "dask", "tornado", "cloudpickle", "msgpack", "pydantic", "pydantic_core", "pluggy", "datasets",
             "pyarrow", "fastapi", "starlette", "uvicorn", "anyio", "httpx", "triton", "_pytest", "pytest"}


def _plugin_frame(exc: Exception) -> str | None:
    """Where ``exc`` was raised when that is a plugin's code ("file:line, in function"): the
    innermost frame of its traceback (Dask keeps a worker's) that is neither streamrl's, nor
    the standard library's, nor in :data:`LIBRARIES`. None when it is streamrl's own: a bug of
    streamrl is shown as it was raised."""
    own = str(Path(__file__).resolve().parents[1]) + os.sep
    stdlib = sysconfig.get_paths()["stdlib"] + os.sep
    for f in reversed(traceback.extract_tb(exc.__traceback__)):
        path = f.filename
        if path.startswith("<"):  # a recipe-local plugin's code, sent by value (no file name)
            return f"a recipe-local module, line {f.lineno}, in {f.name}"
        if path.startswith(own):
            return None
        if path.startswith(stdlib) and "site-packages" not in path:
            continue  # (the standard library raised for whoever called it)
        parts = Path(path).parts
        top = parts[parts.index("site-packages") + 1].removesuffix(".py") if "site-packages" in parts[:-1] else None
        if top not in LIBRARIES:
            return f"{Path(path).name}:{f.lineno}, in {f.name}"
    return None


def _who_was_lost(exc: ResidentLost, controller: Controller | None) -> str:
    """``exc``'s text, led by the train workers that are gone or restarted when a surviving rank
    reported the loss (it can only say that a peer of its process group is gone, not which):
    the scheduler knows which worker of the pool is not the one placed."""
    text = str(exc)
    if controller is None or "lost a peer of the train pool" not in text:
        return text
    try:
        lost = controller.topology.replaced("train")
    except Exception:  # (a cluster that no longer answers: the rank's words alone)
        return text
    if not lost:
        return text
    return f"worker {', '.join(lost)} of the train pool was lost ({text.removeprefix('worker ')})"


def _close_trace(trace: TraceRecorder | None, warn) -> Path | None:
    """After the run, however it ended, while the cluster is still up: the trace's last tasks
    are fetched from the scheduler and ``trace.json`` is written (a failure is a warning)."""
    try:
        return trace.close() if trace is not None else None
    except Exception as exc:
        warn(f"writing the run's trace failed: {type(exc).__name__}: {exc}")
        return None


def _write_views(folder: RunFolder, trace_file: Path | None, report: bool, warn) -> dict[str, Path]:
    """After the run, however it ended: the report, written from what the run recorded (a
    failure here is a warning: the run's own outcome matters more). Returns the files there
    are, by label, with the trace written before (:func:`_close_trace`)."""
    files = {"run folder": folder.path}
    if trace_file is not None:
        files["trace (Perfetto)"] = trace_file.name
    try:
        if report and folder.records:
            if (path := write_report([folder.path])) is not None:
                files["report"] = path.relative_to(folder.path) if path.is_relative_to(folder.path) else path
    except Exception as exc:
        warn(f"writing the run's report failed: {type(exc).__name__}: {exc}")
    if (folder.path / "dask-report.html").exists():
        files["dask report"] = "dask-report.html"
    return files


def run(loaded: LoadedRecipe, verbose: bool = False, console: Console | None = None,
        resolved: Resolved | None = None, resume_dir: Path | None = None, plain: bool | None = None,
        profile: bool = False, report: bool | None = None, from_checkpoint: str | None = None) -> Path:
    """Run a validated recipe end to end, or go on with the run in ``resume_dir`` from its newest
    checkpoint; returns the run folder. A stop signal ends it with :class:`Interrupted` after a
    checkpoint. ``plain`` forces one line per step (default: when the console is not a terminal);
    ``profile`` (or ``run.profile``) writes Dask's performance report; ``report``
    (default ``run.report``) writes ``report.md`` and its plots at the end."""
    console = console or Console(stderr=True)
    r = loaded.recipe
    resolved = resolved or resolve(loaded)
    random.seed(r.run.seed)  # anything in this process that draws from random (tasks, schedulers)
    folder = RunFolder(resume_dir) if resume_dir else RunFolder.create(loaded)
    # (first: two commands on one folder set each other's checkpoints aside; let go however this ends)
    folder.lock()
    try:
        return _run_in(folder, loaded, verbose, console, resolved, resume_dir, plain, profile, report, from_checkpoint)
    finally:
        folder.unlock()


def _run_in(folder: RunFolder, loaded: LoadedRecipe, verbose: bool, console: Console, resolved: Resolved,
            resume_dir: Path | None, plain: bool | None, profile: bool, report: bool | None,
            from_checkpoint: str | None) -> Path:
    """:func:`run`, in ``folder``, which this process holds."""
    r = loaded.recipe
    hooks = resolved.registry.pm.hook
    checkpoint = None
    if resume_dir:  # the newest usable checkpoint, or the one ``--from`` names
        checkpoint = folders.named(folder.path, from_checkpoint) if from_checkpoint else folder.latest_checkpoint()
    resumed = folders.read(checkpoint) if checkpoint is not None else None
    # every step ran and the trained policy was not written (a save cut short): the resume
    # restores the trainer and writes it
    only_policy = (resumed is not None and resumed["next_step"] == r.run.steps
                   and folder.status().get("state") != "completed")
    if resumed is not None and resumed["next_step"] >= r.run.steps and not only_policy:
        raise UserError(f"run.steps: the run already has {resumed['next_step']} steps; "
                        "pass --set run.steps=N with a larger N to go on")
    t_start = time.time()
    warn = lambda text: warning(console, text)  # noqa: E731
    changed = folders.order_changes(resumed.get("prompt_order"), folders.prompt_order(r)) if resumed else []
    if changed:  # (said, not refused: a user may mean it; the prompts after it are not those the run had)
        warn(f"resumed with other settings than those {checkpoint.name} was written under ({'; '.join(changed)}): "
             f"the prompts of step {resumed['next_step'] + 1} on are not those the run would have had (some may "
             "be trained again, some never)")
    stop = StopRequest(warn)
    warnings_log = WarningsLog(folder.path / "warnings.log")
    dask_cluster = client = trace = watchdog = controller = None
    try:
        # (inside: a sink that cannot open, e.g. a tracker without its account, fails the run's status)
        folder.open(loaded, [s.build() for s in resolved.sinks], resumed, checkpoint)
        # the cluster's processes inherit the ignore, and a signal meanwhile waits for the
        # handler (``run/stopping.py``); connecting to cluster.address starts none, so a stop
        # signal meanwhile ends the command at once
        if r.cluster.factory:  # (its processes start with the signals ignored; its wait for them is stoppable)
            dask_cluster, client = lifecycle.start(r, verbose, spawning=lambda: stop.deferred(hold=False),
                                                   stopping=lambda: stop.signal is not None)
        else:
            with stop.deferred() if not r.cluster.address else nullcontext():
                dask_cluster, client = lifecycle.start(r, verbose)
        stop.install()
        warnings_log.attach(client)
        if not verbose:  # a worker's loss and restart: streamrl's own line says what matters
            warnings_log.take_dask_warnings()
        console.print(f"[bold]streamrl[/] {escape(r.run.name)}: mode={r.run.mode} steps={r.run.steps} -> "
                      f"{escape(printable(str(folder.path)))}", soft_wrap=True)
        if r.cluster.dashboard or r.cluster.address or r.cluster.factory:  # (a cluster of someone else's: its own)
            console.print(f"dashboard: {client.dashboard_link}")
        page = dashboard.install(client, name=r.run.name, mode=r.run.mode, steps=r.run.steps)
        if page:
            console.print(f"streamrl page: {page}")
        pools = lifecycle.check_pools(client)
        console.print("pools: " + ", ".join(f"{p}={len(w)}" for p, w in pools.items() if w))
        trace = TraceRecorder(client, folder.path)
        watchdog = Watchdog(client, r.run.step_timeout_s)
        watchdog.install()
        controller = Controller(resolved, client, pools, dask_cluster)
        stop.listen(controller.stopping)
        if not verbose:
            quiet.quiet_lost_train_workers(pools["train"])
        with watchdog.watching("placing the engines, trainer and rewards", 2 * r.run.step_timeout_s):
            first, lines = controller.begin(checkpoint, folder.path)
        for line in lines:  # e.g. the endpoint's address
            console.print(escape(line), soft_wrap=True, highlight=False)
        run_start(hooks.on_run_start, r.model_copy(deep=True), folder.path)  # (a copy: a plugin cannot change the run)
        # the scheduler's address lets a user attach (``Client(address)``) to inspect the run
        folder.mark("running", step=first, scheduler=client.scheduler.address)
        with ExitStack() as stack:
            if profile or r.run.profile:  # Dask's own report of every task, worker and transfer
                stack.enter_context(performance_report(filename=str(folder.path / "dask-report.html")))
            display = stack.enter_context(RunDisplay(console, r.run.name, r.run.steps, first, plain))
            observers = Observers([*sink_observers(folder.sinks), Called("the trace", trace.step),
                                   Called("the dashboard page", lambda m: dashboard.publish(client, m)),
                                   *plugin_observers(hooks.on_step_end), Called("the console display", display.step)],
                                  warn)
            _steps(r, controller, folder, first, stop, observers, warn, watchdog,
                   lambda line: console.print(escape(line), soft_wrap=True, highlight=False))
        with watchdog.watching("saving the policy"):
            try:
                policy = saving.policy(controller, folder.path / "policy")
            except (Interrupted, ResidentLost):
                raise
            except Exception as exc:  # noqa: BLE001 -- the steps ran: what failed is the save, said in one line
                raise RunFailed(_not_saved(exc, folder)) from None
        folder.mark("completed", step=r.run.steps, policy=str(policy))
    except Interrupted:
        raise
    except BaseException as exc:
        said = _as_said(exc, r, folder, controller)
        if said is exc:
            raise
        raise said from None
    finally:
        stop.winding_down()  # (a signal now must not cut the cluster's shutdown short)
        if watchdog is not None:
            watchdog.uninstall()
        warnings_log.detach()
        # its extensions' close (a thread, evaluations in flight), however the run ended -- while the
        # scheduler still answers (a cancel sent to one that is gone would wait on its connection)
        if controller is not None and client is not None and client.status == "running":
            try:
                controller.close()
            except Exception as exc:  # noqa: BLE001 -- the run's own outcome is what must show
                warn(f"closing the run's step extensions failed: {type(exc).__name__}: {message_line(exc)}")
        folder.close()
        trace_file = _close_trace(trace, warn)
        stopped = lifecycle.stop_meanwhile(dask_cluster, client)
        try:
            files = _write_views(folder, trace_file, r.run.report if report is None else report, warn)
            run_end(hooks.on_run_end, folder.path, folder.records, warn)
        finally:
            stopped()
        warnings_log.release_dask_warnings()  # (after the cluster's own goodbyes)
        stop.uninstall()
        stop.stop_now_if_asked_twice()  # a second signal while it closed: the command says it was interrupted
    errors = reward_errors_line(folder.records)
    if errors:
        console.print(errors, highlight=False)
    if warnings_log.count:
        files["library warnings"] = f"{warnings_log.path.name} ({warnings_log.count})"
    table = summary_table(folder.records, {**files, "policy": Path(policy).name})
    table.caption = f"{time.time() - t_start:.0f}s in all"
    console.print(table)
    return folder.path
