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

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from streamrl.sim.capabilities import SimTrainerCapabilities
from streamrl.bench.variants import describe, run_variants

MODES = ("colocated", "batch", "stream", "async")


def mode_overrides(resolved, mode: str) -> list[str]:
    """Overrides that turn the recipe into its ``mode`` variant with equal devices."""
    out = [f"run.mode={mode}"]
    trainer = resolved.trainer.capabilities()
    if mode == "colocated" and isinstance(trainer, SimTrainerCapabilities):  # virtual devices: add some
        out += trainer.colocated_overrides(resolved.recipe.pools.generate.workers)
    return out


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
