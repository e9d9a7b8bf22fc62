"""``streamrl bench modes RECIPE``: the same workload in colocated, batch, stream and async mode.

Each mode is a full run of the recipe (its own embedded cluster, ``--set`` overrides applied to
all), one after another in this process. The first ``warmup`` steps of each run are left out
(model loads, first weight sync); an async run goes on for ``max_staleness`` more steps that are
also left out (its generation would otherwise idle at the end for want of steps to admit), so
every mode is measured over the same number of steady-state steps. Throughput is samples over
the accounting windows (step boundary to boundary: wall time, controller overhead included);
idle ratios are the pools' busy clocks over the same windows.

Colocated gets the same devices as the disaggregated modes. On a real engine that is automatic:
the train workers also generate. The ``sim`` trainer's devices are virtual, so its capabilities
say how to size the colocated variant (``SimTrainerCapabilities.colocated_overrides``: ``G + T``
instances and ``G + T`` training GPUs where the recipe has ``G`` instances and ``T`` GPUs).
"""

from __future__ import annotations

import io
import json
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from streamrl.flow import runner
from streamrl.recipe import load_recipe
from streamrl.sim.capabilities import SimEngineCapabilities, SimTrainerCapabilities

MODES = ("colocated", "batch", "stream", "async")


def describe(file: str, overrides: list[str]):
    """The recipe as given, validated once: ``(resolved, time_scale)``; ``time_scale`` (real
    seconds per simulated second) is None for a real engine."""
    resolved = runner.resolve(load_recipe(file, overrides))
    engine = resolved.engine.capabilities()
    return resolved, engine.time_scale if isinstance(engine, SimEngineCapabilities) else None


def mode_overrides(resolved, mode: str) -> list[str]:
    """Overrides that turn the recipe into its ``mode`` variant with equal devices."""
    out = [f"run.mode={mode}"]
    trainer = resolved.trainer.capabilities()
    if mode == "colocated" and isinstance(trainer, SimTrainerCapabilities):  # virtual devices: add some
        out += trainer.colocated_overrides(resolved.recipe.pools.generate.workers)
    return out


def summarize_run(records: list[dict], warmup: int, time_scale: float | None,
                  costs: tuple[float, float, int] | None = None) -> dict:
    """One row of the comparison from a run's ``metrics.jsonl`` records. ``costs``: the
    variant's cost per generate and per train device and its train devices, for
    ``samples_per_cost_hour`` (samples per hour of devices costing 1 each; simulated recipes:
    per simulated hour)."""
    rs = records[warmup:] or records
    window = sum(r["accounting_window_s"] for r in rs)
    samples = sum(r["samples"] for r in rs)
    row = {
        "steps": len(rs),
        "samples": samples,
        "wall_s": round(window, 3),
        "samples_per_s": samples / window,
        "reward_mean": sum(r["reward_mean"] * r["samples"] for r in rs) / samples,
        "staleness_max": max(r["staleness_max"] for r in rs),
        "idle": {},
    }
    for pool in rs[0]["pools"]:
        busy = sum(r["pools"][pool]["busy_s"] for r in rs)
        cap = busy + sum(r["pools"][pool]["idle_s"] for r in rs)
        row["idle"][pool] = 1.0 - busy / cap if cap else 0.0
    makespans = [r["generate_makespan_s"] for r in rs if "generate_makespan_s" in r]
    if makespans:  # submission of a step's first group to its last sample generated
        row["generate_makespan_s"] = sum(makespans) / len(makespans)
    recalls = [r["ranker_recall"] for r in rs if "ranker_recall" in r]
    if recalls:
        row["ranker_recall"] = sum(recalls) / len(recalls)
    if time_scale:  # report simulated throughput in simulated seconds too
        row["sim_samples_per_s"] = row["samples_per_s"] * time_scale
    # what the weights' publication costs the step (an elastic pool's size moves step by step)
    row["weight_sync_share"] = sum(r.get("weight_sync_s", 0.0) for r in rs) / window if window else 0.0
    if costs is not None:
        gen_cost, train_cost, train_devices = costs
        cost_s = sum((r["generate_workers"] * gen_cost + train_devices * train_cost) * r["accounting_window_s"]
                     for r in rs)
        row["samples_per_cost_hour"] = samples * (time_scale or 1.0) / cost_s * 3600 if cost_s else 0.0
    return row


def variant_costs(resolved) -> tuple[float, float, int]:
    """``(cost per generate device, cost per train device, train devices)`` of a recipe (a sim
    trainer's virtual GPUs, else the train workers), as the planner counts them."""
    from streamrl.planning.allocate import costs, recipe_split

    return (*costs(resolved), recipe_split(resolved)[1])


def run_variants(file: str, overrides: list[str], variants: dict[str, list[str]], steps: int, warmup: int,
                 console: Console, label: str, time_scale: float | None) -> dict:
    """Run the recipe once per variant (its extra ``--set`` overrides); returns ``{variant: row}``.
    ``time_scale`` (from :func:`describe`) is None for a real engine."""
    simulated = time_scale is not None
    tmp = tempfile.mkdtemp(prefix="streamrl-bench-")
    rows = {}
    for name, extra in variants.items():
        loaded = load_recipe(file, list(overrides) + list(extra))
        # Async keeps generating up to max_staleness steps ahead; in the run's last steps there is
        # nothing left to generate, so the generate pool idles by construction. Run that many
        # extra steps and leave them out: every mode is measured over `steps` steady-state steps.
        r = loaded.recipe.run
        drain = r.max_staleness if r.mode == "async" else 0
        extra = list(extra) + [f"run.steps={steps + warmup + drain}", "cluster.dashboard_port=0",
                               f'run.out_dir="{tmp}"', f'run.name="bench-{name}"']
        loaded = load_recipe(file, list(overrides) + extra)
        resolved = runner.resolve(loaded)  # a variant's own mistakes are one line too
        console.print(f"bench {label}: {name} ({steps} steps + {warmup} warm-up){' [simulated]' if simulated else ''}")
        t0 = time.time()
        run_dir = runner.run(loaded, console=Console(file=io.StringIO()), resolved=resolved)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        rows[name] = summarize_run(records[:warmup + steps], warmup, time_scale, variant_costs(resolved))
        rows[name]["drain_steps"] = drain
        rows[name]["run_dir"] = str(run_dir)
        rows[name]["total_s"] = round(time.time() - t0, 1)
    return rows


def bench(file: str, overrides: list[str], modes=MODES, steps: int = 5, warmup: int = 1,
          out: str | None = None, console: Console | None = None) -> dict:
    """Run every mode, print the table, write the JSON result; returns the result."""
    console = console or Console(stderr=True, width=120)
    resolved, time_scale = describe(file, overrides)
    simulated = time_scale is not None
    variants = {mode: mode_overrides(resolved, mode) for mode in modes}
    rows = run_variants(file, overrides, variants, steps, warmup, console, "modes", time_scale)
    for row in rows.values():
        for ref in ("batch", "colocated"):
            if ref in rows:
                row[f"vs_{ref}"] = row["samples_per_s"] / rows[ref]["samples_per_s"]
    result = {"recipe": str(file), "overrides": list(overrides), "simulated": simulated,
              "time_scale": time_scale, "steps": steps, "warmup": warmup, "modes": rows}
    console.print(table(result))
    write_result(result, out, console)
    return result


def write_result(result: dict, out: str | None, console: Console) -> None:
    """Write the JSON result (next to the first run's folder unless ``out`` is given)."""
    first = next(iter(next(v for k, v in result.items() if isinstance(v, dict) and k in ("modes", "variants")).values()))
    path = Path(out) if out else Path(first["run_dir"]).parent / "bench.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    console.print(f"result: {path}")


def table(result: dict) -> Table:
    """The comparison as a rich table."""
    sim = result["simulated"]
    title = f"streamrl bench modes {result['recipe']}" + (
        f" -- SIMULATED (1 simulated s = {result['time_scale']} s)" if sim else "")
    t = Table(title=title)
    for col in ["mode", "sim samples/s" if sim else "samples/s", "x batch", "x colocated", "per cost-hour",
                "sync share", "idle gen", "idle train", "stale max", "reward"]:
        t.add_column(col, justify="right")
    for mode, r in result["modes"].items():
        rate = r["sim_samples_per_s"] if sim else r["samples_per_s"]
        t.add_row(mode, f"{rate:.2f}", f"{r['vs_batch']:.2f}" if "vs_batch" in r else "-",
                  f"{r['vs_colocated']:.2f}" if "vs_colocated" in r else "-", f"{r['samples_per_cost_hour']:,.0f}",
                  f"{r['weight_sync_share']:.1%}", f"{r['idle'].get('generate', 0):.0%}",
                  f"{r['idle'].get('train', 0):.0%}", str(r["staleness_max"]), f"{r['reward_mean']:.3f}")
    return t
