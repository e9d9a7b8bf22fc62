"""``streamrl recipe run`` and ``resume``: validate, bring up the cluster, run the controller
(checkpointing as ``run.checkpoint_every`` says), save the result, and keep the run folder
(``flow/run_folder.py``) true whatever happens."""

from __future__ import annotations

import random
import time
from pathlib import Path

from rich.console import Console

from streamrl import cluster
from streamrl.errors import Interrupted, RunFailed, UserError
from streamrl.flow import checkpoints
from streamrl.flow.controller import Controller
from streamrl.flow.resident import ComponentError, ResidentLost
from streamrl.flow.resolve import Resolved, resolve
from streamrl.flow.run_folder import RunFolder
from streamrl.flow.stopping import StopRequest, sigint_ignored
from streamrl.recipe import LoadedRecipe
from streamrl.telemetry import dashboard
from streamrl.telemetry.report import write_report
from streamrl.telemetry.trace import TraceRecorder

__all__ = ["resolve", "run", "summary", "load_for_resume"]


def load_for_resume(run_dir: str | Path, overrides: list[str] = ()) -> tuple[LoadedRecipe, Path]:
    """The recipe a run folder was started with (``--set`` overrides on top) and the folder."""
    loaded, folder = RunFolder.for_resume(run_dir, overrides)
    return loaded, folder.path

def summary(records: list[dict], window: int = 10) -> str:
    """One line: did reward go up (mean of the first vs the last ``window`` steps), how fast."""
    if not records:
        return "no steps run"
    k = min(window, len(records))
    first = sum(r["reward_mean"] for r in records[:k]) / k
    last = sum(r["reward_mean"] for r in records[-k:]) / k
    rate = sum(r["samples"] for r in records) / max(sum(r["step_s"] for r in records), 1e-9)
    return (f"reward {first:.3f} (first {k} steps) -> {last:.3f} (last {k}); "
            f"{rate:.1f} samples/s over {len(records)} steps")


def step_line(m: dict, steps: int) -> str:
    """The console line of one step."""
    return (f"step {m['step'] + 1:>3}/{steps}  reward {m['reward_mean']:.3f}  "
            f"samples/s {m['samples_per_s']:6.1f}  gen {m['generate_s']:.2f}s  "
            f"train {m['train_s']:.2f}s  sync {m['weight_sync_s']:.3f}s  idle "
            + " ".join(f"{p[:3]} {a['idle_ratio']:.0%}" for p, a in m["pools"].items())
            + f"  v{m['policy_version']}"
            # an elastic pool: how many generated, and what changed after the step
            + (f"  gen x{m['generate_workers']} {m['elastic']}".rstrip() if "elastic" in m else "")
            # a reward that raises or returns NaN scores 0 and is counted; say so where it is seen
            + (f"  [yellow]reward errors {m['reward_errors']}/{m['samples']}[/]" if m.get("reward_errors") else ""))


def run(loaded: LoadedRecipe, verbose: bool = False, console: Console | None = None,
        resolved: Resolved | None = None, resume_dir: Path | None = None, plain: bool | None = None,
        profile: bool = False, report: bool | None = None) -> Path:
    """Run a validated recipe end to end, or go on with the run in ``resume_dir`` from its newest
    checkpoint; returns the run folder. A stop signal ends it with :class:`Interrupted` after a
    checkpoint. ``plain`` forces one line per step (default: when the console is not a terminal);
    ``profile`` (or ``run.profile``) writes Dask's performance report; ``report``
    (default ``run.report``) writes ``report.md`` and its plots at the end."""
    console = console or Console(stderr=True)
    r = loaded.recipe
    resolved = resolved or resolve(loaded)
    hooks = resolved.registry.pm.hook
    random.seed(r.run.seed)  # anything in this process that draws from random (tasks, schedulers)
    folder = RunFolder(resume_dir) if resume_dir else RunFolder.create(loaded)
    checkpoint = folder.latest_checkpoint() if resume_dir else None
    resumed = checkpoints.read(checkpoint) if checkpoint is not None else None
    if resumed is not None and resumed["next_step"] >= r.run.steps:
        raise UserError(f"run.steps: the run already has {resumed['next_step']} steps; "
                        "pass --set run.steps=N with a larger N to go on")
    folder.open(loaded, [s.build() for s in resolved.sinks], resumed)
    t_start = time.time()
    warn = lambda text: console.print(f"[yellow]{text}[/]", soft_wrap=True)  # noqa: E731
    stop = StopRequest(warn)
    dask_cluster = client = trace = None
    try:
        with sigint_ignored():  # the cluster's processes inherit the ignore (``flow/stopping.py``)
            dask_cluster, client = cluster.start(r, verbose)
        stop.install()
        console.print(f"[bold]streamrl[/] {r.run.name}: mode={r.run.mode} steps={r.run.steps} -> {folder.path}",
                      soft_wrap=True)
        console.print(f"dashboard: {client.dashboard_link}")
        page = dashboard.install(client)
        if page:
            console.print(f"streamrl page: {page}")
        trace = TraceRecorder(client, folder.path)
        pools = cluster.check_pools(client)
        console.print("pools: " + ", ".join(f"{p}={len(w)}" for p, w in pools.items() if w))
        controller = Controller(resolved, client, pools, dask_cluster)
        controller.place_residents()
        first = 0
        if checkpoint is not None:
            first = controller.resume(checkpoint)
            console.print(f"resumed from {checkpoint.name}: step {first + 1}, policy v{controller.version}")
        hooks.on_run_start(recipe=r, run_dir=folder.path)
        # the scheduler's address lets a user attach (``Client(address)``) to inspect the run
        folder.mark("running", step=first, scheduler=client.scheduler.address)
        every = r.run.checkpoint_every

        def checkpoint_after(done: int) -> bool:
            return done == r.run.steps or bool(every and done % every == 0)

        for step in range(first, r.run.steps):
            # The next step's training may start before this step's record is written, unless a
            # checkpoint must capture the weights right after this step.
            m = controller.step(step, feed_next=not (stop.requested or checkpoint_after(step + 1)))
            folder.record(m, warn)
            trace.step(m)
            dashboard.publish(client, m)
            hooks.on_step_end(step=step, metrics=m)
            console.print(step_line(m, r.run.steps), soft_wrap=True)
            done = step + 1
            if stop.requested and controller.fed is not None:
                continue  # the next step is already training: stop after it
            if stop.requested or checkpoint_after(done):
                saved = controller.checkpoint(folder.path, done, len(folder.records))
                folder.mark("running", step=done, checkpoint=str(saved))
            if stop.requested and done < r.run.steps:
                folder.mark("interrupted", step=done)
                raise Interrupted(f"stopped after step {done} of {r.run.steps}; checkpoint {saved.name} written. "
                                  f"Resume with: {folder.resume_command()}")
        policy = controller.save_policy(folder.path / "policy")
        folder.mark("completed", step=r.run.steps, policy=str(policy))
        console.print(summary(folder.records))
        errors = sum(rec.get("reward_errors", 0) for rec in folder.records)
        if errors:
            console.print(f"[yellow]reward errors: {errors} of {sum(rec['samples'] for rec in folder.records)} "
                          "samples scored 0 (the reward raised or returned a non-number; see metrics.jsonl)[/]")
        console.print(f"policy saved: {policy}  ({time.time() - t_start:.0f}s in all)")
    except Interrupted:
        raise
    except BaseException as exc:
        folder.failed(exc)
        if isinstance(exc, ComponentError):  # a component that cannot be built on a worker: one line
            raise UserError(str(exc)) from None
        if isinstance(exc, ResidentLost):  # the trainer's state died with its worker
            ckpt = folder.latest_checkpoint()
            then = (f"resume from {ckpt.name} with: {folder.resume_command()}" if ckpt
                    else "it had no checkpoint yet (run.checkpoint_every); start it again")
            raise RunFailed(f"{exc}; the run stopped, {then}") from None
        raise
    finally:
        stop.uninstall()
        folder.close()
        if trace is not None:
            trace.close()
        if (r.run.report if report is None else report) and folder.records:
            write_report([folder.path])
        try:
            hooks.on_run_end(run_dir=folder.path, metrics=folder.records)
        except Exception as exc:  # an observer's failure must not hide the run's outcome
            warn(f"on_run_end failed: {type(exc).__name__}: {exc}")
        if dask_cluster is not None or client is not None:
            cluster.stop(dask_cluster, client)
    return folder.path
