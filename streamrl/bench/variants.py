"""Variants of one recipe, run one after another and compared: what ``streamrl bench`` (modes,
skew, elastic) and ``streamrl plan`` (its ``--check``, warm-up and calibration runs) share.

A variant is the recipe with extra ``--set`` overrides; each runs as a full run (its own
embedded cluster) in this process, and :func:`summarize_run` makes its ``metrics.jsonl`` one row
of a comparison. A recipe's devices and costs are counted here once, as the planner counts them:
the ``sim`` trainer's virtual GPUs are its train devices.
"""

from __future__ import annotations

import io
import json
import tempfile
import time

from rich.console import Console

from streamrl.run import runner
from streamrl.recipe.recipe import load_recipe
from streamrl.sim.capabilities import SimEngineCapabilities, SimTrainerCapabilities


def describe(file: str, overrides: list[str]):
    """The recipe as given, validated once: ``(resolved, time_scale)``; ``time_scale`` (real
    seconds per simulated second) is None for a real engine."""
    resolved = runner.resolve(load_recipe(file, overrides))
    engine = resolved.engine.capabilities()
    return resolved, engine.time_scale if isinstance(engine, SimEngineCapabilities) else None


def recipe_split(resolved) -> tuple[int, int]:
    """``(generate devices, train devices)`` of the recipe as written."""
    trainer = resolved.trainer.capabilities()  # the sim trainer's devices are virtual
    train = trainer.gpus if isinstance(trainer, SimTrainerCapabilities) else resolved.recipe.pools.train.workers
    return resolved.recipe.pools.generate.workers, train


def costs(resolved) -> tuple[float, float]:
    """Relative cost per device of the generate and the train pool."""
    p = resolved.recipe.pools
    return p.generate.cost_per_device, p.train.cost_per_device


def summarize_run(records: list[dict], warmup: int, time_scale: float | None,
                  device_costs: tuple[float, float, int] | None = None) -> dict:
    """One row of the comparison from a run's ``metrics.jsonl`` records. ``device_costs``: the
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
    for key in ("ranker_recall", "first_sample_recall", "moves/moved"):
        values = [r[key] for r in rs if key in r]
        if values:  # per step
            row[key] = sum(values) / len(values)
    if time_scale:  # report simulated throughput in simulated seconds too
        row["sim_samples_per_s"] = row["samples_per_s"] * time_scale
    # what the weights' publication costs the step (an elastic pool's size moves step by step)
    row["weight_sync_share"] = sum(r.get("weight_sync_s", 0.0) for r in rs) / window if window else 0.0
    if device_costs is not None:
        gen_cost, train_cost, train_devices = device_costs
        cost_s = sum((r["generate_workers"] * gen_cost + train_devices * train_cost) * r["accounting_window_s"]
                     for r in rs)
        row["samples_per_cost_hour"] = samples * (time_scale or 1.0) / cost_s * 3600 if cost_s else 0.0
    return row


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
        extra = list(extra) + [f"run.steps={steps + warmup + drain}", "cluster.dashboard=false",
                               f'run.out_dir="{tmp}"', f'run.name="bench-{name}"']
        loaded = load_recipe(file, list(overrides) + extra)
        resolved = runner.resolve(loaded)  # a variant's own mistakes are one line too
        console.print(f"bench {label}: {name} ({steps} steps + {warmup} warm-up){' [simulated]' if simulated else ''}")
        t0 = time.time()
        # (no report per variant: `streamrl report` on the run folders overlays them)
        run_dir = runner.run(loaded, console=Console(file=io.StringIO()), resolved=resolved, report=False)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        rows[name] = summarize_run(records[:warmup + steps], warmup, time_scale,
                                    (*costs(resolved), recipe_split(resolved)[1]))
        rows[name]["drain_steps"] = drain
        rows[name]["run_dir"] = str(run_dir)
        rows[name]["total_s"] = round(time.time() - t0, 1)
    return rows
