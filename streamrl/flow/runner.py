"""``streamrl recipe run`` and ``resume``: validate, bring up the cluster, run the controller
(checkpointing as ``run.checkpoint_every`` says), save the result, and keep ``status.json`` in
the run folder true whatever happens."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

from rich.console import Console

from streamrl import cluster
from streamrl.errors import Interrupted, RunFailed, UserError
from streamrl.flow import checkpoints, status
from streamrl.flow.controller import Controller
from streamrl.flow.resident import ComponentError, ResidentLost
from streamrl.flow.resolve import Resolved, resolve
from streamrl.flow.stopping import StopRequest, sigint_ignored
from streamrl.recipe import LoadedRecipe, load_recipe, to_toml
from streamrl.telemetry.metrics import MetricsLog

__all__ = ["resolve", "run", "summary", "make_run_dir", "load_for_resume"]


def make_run_dir(loaded: LoadedRecipe) -> Path:
    """``<out_dir>/<name>-<timestamp>`` with the resolved recipe in it."""
    r = loaded.recipe
    run_dir = Path(r.run.out_dir) / f"{r.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    n = 1
    while run_dir.exists():
        n += 1
        run_dir = Path(r.run.out_dir) / f"{r.run.name}-{time.strftime('%Y%m%d-%H%M%S')}-{n}"
    try:
        run_dir.mkdir(parents=True)
        (run_dir / "recipe.toml").write_text(to_toml(r))
    except OSError as exc:
        raise UserError(f"run.out_dir: cannot create a run folder in {r.run.out_dir!r} ({exc.strerror})") from None
    return run_dir.resolve()


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


def load_for_resume(run_dir: str | Path, overrides: list[str] = ()) -> tuple[LoadedRecipe, Path]:
    """The recipe a run folder was started with (``--set`` overrides on top) and the folder.

    Relative paths keep resolving against the original recipe's folder."""
    run_dir = Path(run_dir).resolve()
    if not (run_dir / status.FILE).is_file() or not (run_dir / "recipe.toml").is_file():
        raise UserError(f"{run_dir}: not a run folder (expected status.json and recipe.toml in it)")
    if checkpoints.latest(run_dir) is None:
        raise UserError(f"{run_dir}: no checkpoint to resume from (the run stopped before its first one)")
    state = status.read(run_dir)
    if state["state"] in ("starting", "running") and _alive(state.get("pid")):
        raise UserError(f"{run_dir}: the run is still going (pid {state['pid']}); stop it first (Ctrl-C)")
    loaded = load_recipe(run_dir / "recipe.toml", overrides)
    return LoadedRecipe(loaded.recipe, Path(status.read(run_dir)["recipe_file"])), run_dir


def run(loaded: LoadedRecipe, verbose: bool = False, console: Console | None = None,
        resolved: Resolved | None = None, resume_dir: Path | None = None) -> Path:
    """Run a validated recipe end to end, or go on with the run in ``resume_dir`` from its newest
    checkpoint; returns the run folder. A stop signal ends it with :class:`Interrupted` after a
    checkpoint."""
    console = console or Console(stderr=True)
    r = loaded.recipe
    resolved = resolved or resolve(loaded)
    registry = resolved.registry
    random.seed(r.run.seed)  # anything in this process that draws from random (tasks, schedulers)
    checkpoint = checkpoints.latest(resume_dir) if resume_dir else None
    run_dir = resume_dir or make_run_dir(loaded)
    resumed = checkpoints.read(checkpoint) if checkpoint is not None else None
    if resumed is not None and resumed["next_step"] >= r.run.steps:
        raise UserError(f"run.steps: the run already has {resumed['next_step']} steps; "
                        "pass --set run.steps=N with a larger N to go on")
    if resume_dir:  # the recipe as resumed (e.g. more steps) is the one to resume from next time
        (run_dir / "recipe.toml").write_text(to_toml(r))
    status.write(run_dir, "starting", recipe_file=str(loaded.file.resolve()), steps=r.run.steps, pid=os.getpid())
    log = MetricsLog(run_dir / "metrics.jsonl")
    if checkpoint is not None:  # steps after the checkpoint are run again: drop their records
        log.keep_first(resumed["records"])
    sinks = [s.build() for s in resolved.sinks]
    for sink in sinks:
        sink.open(run_dir)
    t_start = time.time()
    stop = StopRequest(lambda text: console.print(f"[yellow]{text}[/]", soft_wrap=True))
    dask_cluster = client = None
    try:
        with sigint_ignored():  # the cluster's processes inherit the ignore (``flow/stopping.py``)
            dask_cluster, client = cluster.start(r, verbose)
        stop.install()
        console.print(f"[bold]streamrl[/] {r.run.name}: mode={r.run.mode} steps={r.run.steps} -> {run_dir}", soft_wrap=True)
        console.print(f"dashboard: {client.dashboard_link}")
        pools = cluster.check_pools(client)
        console.print("pools: " + ", ".join(f"{p}={len(w)}" for p, w in pools.items() if w))
        controller = Controller(resolved, client, pools, dask_cluster)
        controller.place_residents()
        first = 0
        if checkpoint is not None:
            first = controller.resume(checkpoint)
            console.print(f"resumed from {checkpoint.name}: step {first + 1}, policy v{controller.version}")
        registry.pm.hook.on_run_start(recipe=r, run_dir=run_dir)
        # the scheduler's address lets a user attach (``Client(address)``) to inspect the run
        status.write(run_dir, "running", step=first, scheduler=client.scheduler.address)
        every = r.run.checkpoint_every

        def checkpoint_after(done: int) -> bool:
            return done == r.run.steps or bool(every and done % every == 0)

        for step in range(first, r.run.steps):
            # The next step's training may start before this step's record is written, unless a
            # checkpoint must capture the weights right after this step.
            m = controller.step(step, feed_next=not (stop.requested or checkpoint_after(step + 1)))
            log.write(m)
            for sink in list(sinks):
                try:
                    sink.write(m)
                except Exception as exc:  # a broken sink must not end the run; metrics.jsonl has it all
                    console.print(f"[yellow]metric sink {type(sink).__name__} failed and is dropped: "
                                  f"{type(exc).__name__}: {exc}[/]", soft_wrap=True)
                    sinks.remove(sink)
            registry.pm.hook.on_step_end(step=step, metrics=m)
            console.print(step_line(m, r.run.steps), soft_wrap=True)
            done = step + 1
            if stop.requested and controller.fed is not None:
                continue  # the next step is already training: stop after it
            if stop.requested or checkpoint_after(done):
                saved = controller.checkpoint(run_dir, done, len(log.records))
                status.write(run_dir, "running", step=done, checkpoint=str(saved))
            if stop.requested and done < r.run.steps:
                status.write(run_dir, "interrupted", step=done)
                raise Interrupted(f"stopped after step {done} of {r.run.steps}; checkpoint {saved.name} written. "
                                  f"Resume with: {status.resume_command(run_dir)}")
        policy = controller.save_policy(run_dir / "policy")
        status.write(run_dir, "completed", step=r.run.steps, policy=str(policy))
        console.print(summary(log.records))
        errors = sum(rec.get("reward_errors", 0) for rec in log.records)
        if errors:
            console.print(f"[yellow]reward errors: {errors} of {sum(rec['samples'] for rec in log.records)} samples "
                          "scored 0 (the reward raised or returned a non-number; see metrics.jsonl)[/]")
        console.print(f"policy saved: {policy}  ({time.time() - t_start:.0f}s in all)")
    except Interrupted:
        raise
    except BaseException as exc:
        _failed(run_dir, exc)
        if isinstance(exc, ComponentError):  # a component that cannot be built on a worker: one line
            raise UserError(str(exc)) from None
        if isinstance(exc, ResidentLost):  # the trainer's state died with its worker
            ckpt = checkpoints.latest(run_dir)
            then = (f"resume from {ckpt.name} with: {status.resume_command(run_dir)}" if ckpt
                    else "it had no checkpoint yet (run.checkpoint_every); start it again")
            raise RunFailed(f"{exc}; the run stopped, {then}") from None
        raise
    finally:
        stop.uninstall()
        for sink in sinks:
            sink.close()
        try:
            registry.pm.hook.on_run_end(run_dir=run_dir, metrics=log.records)
        except Exception as exc:  # an observer's failure must not hide the run's outcome
            console.print(f"[yellow]on_run_end failed: {type(exc).__name__}: {exc}[/]", soft_wrap=True)
        if dask_cluster is not None or client is not None:
            cluster.stop(dask_cluster, client)
    return run_dir


def _alive(pid: int | None) -> bool:
    """Is process ``pid`` running on this machine (a run killed with -9 leaves ``running``)?"""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _failed(run_dir: Path, exc: BaseException) -> None:
    """Mark the run folder failed, with the error and, if there is a checkpoint, how to go on."""
    fields = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    if checkpoints.latest(run_dir) is not None:
        fields["resume"] = status.resume_command(run_dir)
    status.write(run_dir, "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed", **fields)
