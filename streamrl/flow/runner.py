"""``streamrl recipe run``: validate, bring up the cluster, run the controller, save the result."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console

from streamrl import cluster
from streamrl.flow.controller import Controller
from streamrl.plugins import KINDS, build_registry
from streamrl.recipe import SECTIONS, LoadedRecipe, check_pools, to_toml, validate_section
from streamrl.errors import UserError
from streamrl.telemetry.metrics import MetricsLog


def simulates_training(registry, recipe) -> bool:
    """Whether the recipe's engine is simulated (``sim``): it brings its own cost-model trainer
    and needs no model."""
    return bool(getattr(registry.get("engine", recipe.engine.name, "engine.name").factory,
                        "simulates_training", False))


def resolve(loaded: LoadedRecipe):
    """Phase two of validation: plugins load, every named component exists and its section is
    valid. Returns the registry. Needs no cluster."""
    r = loaded.recipe
    check_pools(r)
    registry = build_registry(r.plugins.modules, loaded.base)
    for section, kind in SECTIONS.items():
        assert kind in KINDS
        sec = getattr(r, section)
        if sec is None:  # optional section left out
            continue
        comp = registry.get(kind, sec.name, f"{section}.name")
        validate_section(comp.config, sec.options(), section)
    for i, sec in enumerate(r.metrics):
        comp = registry.get("metric_sink", sec.name, f"metrics[{i}].name")
        validate_section(comp.config, sec.options(), f"metrics[{i}]")
    if simulates_training(registry, r):
        return registry  # a simulated engine and trainer need no model
    if loaded.model_path() is None:
        raise UserError('model: missing; add a [model] table with path = "<folder of a transformers model>"')
    if not (loaded.model_path() / "config.json").is_file():
        raise UserError(f"model.path: no transformers model at {loaded.model_path()} "
                        f"(make one with: streamrl model init --task {r.task.name} --out {r.model.path})")
    return registry


def make_run_dir(loaded: LoadedRecipe) -> Path:
    """``<out_dir>/<name>-<timestamp>`` with the resolved recipe in it."""
    r = loaded.recipe
    run_dir = Path(r.run.out_dir) / f"{r.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    n = 1
    while run_dir.exists():
        n += 1
        run_dir = Path(r.run.out_dir) / f"{r.run.name}-{time.strftime('%Y%m%d-%H%M%S')}-{n}"
    run_dir.mkdir(parents=True)
    (run_dir / "recipe.toml").write_text(to_toml(r))
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


def run(loaded: LoadedRecipe, verbose: bool = False, console: Console | None = None) -> Path:
    """Run a validated recipe end to end; returns the run folder."""
    console = console or Console(stderr=True)
    r = loaded.recipe
    registry = resolve(loaded)
    run_dir = make_run_dir(loaded)
    log = MetricsLog(run_dir / "metrics.jsonl")
    sinks = [registry.get("metric_sink", sec.name, f"metrics[{i}].name").build(sec.options(), f"metrics[{i}]")
             for i, sec in enumerate(r.metrics)]
    for sink in sinks:
        sink.open(run_dir)
    t_start = time.time()
    dask_cluster, client = cluster.start(r, verbose)
    try:
        console.print(f"[bold]streamrl[/] {r.run.name}: mode={r.run.mode} steps={r.run.steps} -> {run_dir}", soft_wrap=True)
        console.print(f"dashboard: {client.dashboard_link}")
        pools = cluster.check_pools(client)
        console.print("pools: " + ", ".join(f"{p}={len(w)}" for p, w in pools.items() if w))
        controller = Controller(loaded, registry, client, pools)
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
            console.print(
                f"step {step + 1:>3}/{r.run.steps}  reward {m['reward_mean']:.3f}  "
                f"samples/s {m['samples_per_s']:6.1f}  gen {m['generate_s']:.2f}s  "
                f"train {m['train_s']:.2f}s  sync {m['weight_sync_s']:.3f}s  idle "
                + " ".join(f"{p[:3]} {a['idle_ratio']:.0%}" for p, a in m["pools"].items())
                + f"  v{m['policy_version']}", soft_wrap=True)
        policy = controller.save_policy(run_dir / "policy")
        console.print(summary(log.records))
        console.print(f"policy saved: {policy}  ({time.time() - t_start:.0f}s in all)")
    finally:
        for sink in sinks:
            sink.close()
        registry.pm.hook.on_run_end(run_dir=run_dir, metrics=log.records)
        cluster.stop(dask_cluster, client)
    return run_dir
