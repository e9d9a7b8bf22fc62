"""``streamrl recipe run``: validate, bring up the cluster, run the controller, save the result."""

from __future__ import annotations

import random
import time
from pathlib import Path

from rich.console import Console

from streamrl import cluster
from streamrl.errors import UserError
from streamrl.flow.controller import Controller
from streamrl.flow.resident import ComponentError
from streamrl.flow.resolve import Resolved, resolve
from streamrl.recipe import LoadedRecipe, to_toml
from streamrl.telemetry.metrics import MetricsLog

__all__ = ["resolve", "run", "summary", "make_run_dir"]


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
            + f"  v{m['policy_version']}")


def run(loaded: LoadedRecipe, verbose: bool = False, console: Console | None = None,
        resolved: Resolved | None = None) -> Path:
    """Run a validated recipe end to end; returns the run folder."""
    console = console or Console(stderr=True)
    r = loaded.recipe
    resolved = resolved or resolve(loaded)
    registry = resolved.registry
    random.seed(r.run.seed)  # anything in this process that draws from random (tasks, schedulers)
    run_dir = make_run_dir(loaded)
    log = MetricsLog(run_dir / "metrics.jsonl")
    sinks = [s.build() for s in resolved.sinks]
    for sink in sinks:
        sink.open(run_dir)
    t_start = time.time()
    dask_cluster, client = cluster.start(r, verbose)
    try:
        console.print(f"[bold]streamrl[/] {r.run.name}: mode={r.run.mode} steps={r.run.steps} -> {run_dir}", soft_wrap=True)
        console.print(f"dashboard: {client.dashboard_link}")
        pools = cluster.check_pools(client)
        console.print("pools: " + ", ".join(f"{p}={len(w)}" for p, w in pools.items() if w))
        controller = Controller(resolved, client, pools)
        controller.place_residents()
        registry.pm.hook.on_run_start(recipe=r, run_dir=run_dir)
        for step in range(r.run.steps):
            m = controller.step(step)
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
        policy = controller.save_policy(run_dir / "policy")
        console.print(summary(log.records))
        console.print(f"policy saved: {policy}  ({time.time() - t_start:.0f}s in all)")
    except ComponentError as exc:  # a component that cannot be built on a worker: one line
        raise UserError(str(exc)) from None
    finally:
        for sink in sinks:
            sink.close()
        try:
            registry.pm.hook.on_run_end(run_dir=run_dir, metrics=log.records)
        except Exception as exc:  # an observer's failure must not hide the run's outcome
            console.print(f"[yellow]on_run_end failed: {type(exc).__name__}: {exc}[/]", soft_wrap=True)
        cluster.stop(dask_cluster, client)
    return run_dir
