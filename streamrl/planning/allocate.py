"""``streamrl plan RECIPE --devices N``: which split of N devices, which mode and staleness bound.

StreamRL's allocator balances generation against training from measured stage profiles. Here
every split ``G`` generate + ``N - G`` train devices, every mode and every staleness bound up to
``--max-staleness`` is replayed on the profile (``predict.py``), and the best few are printed
with the ``--set`` overrides that apply them. With ``--check`` the top choice and the recipe as
written (in the same mode) are then run for real, one after the other, and the measured
samples/s printed next to the predictions: a plan is only as good as its forecast.

Cost: ``pools.<pool>.cost_per_device`` (relative price of one device per unit time) gives
samples per cost unit; ``--objective cost`` ranks by it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.table import Table

from streamrl.errors import UserError
from streamrl.planning import profile as profiling
from streamrl.planning.predict import Prediction, predict
from streamrl.planning.profile import StageProfile
from streamrl.sim.capabilities import SimTrainerCapabilities
from streamrl.bench.variants import costs, describe, recipe_split, run_variants


def per_cost_hour(pred: Prediction, cost: tuple[float, float]) -> float:
    """Samples per cost unit, where one device of cost 1.0 for one hour is a unit."""
    spend = pred.generate * cost[0] + pred.train * cost[1]
    return pred.samples_per_s * 3600 / spend if spend else math.inf


def _json_number(x: float) -> float | None:
    # (devices that cost nothing make samples per cost unit infinite: null in JSON, which has no Infinity)
    return x if math.isfinite(x) else None


def split_overrides(resolved, pred: Prediction) -> list[str]:
    """``--set`` overrides that turn the recipe into ``pred``'s split, mode and bound. Async
    keeps ``max_staleness + 1`` steps of groups on the generate workers: each needs a thread."""
    r = resolved.recipe
    out = [f"pools.generate.workers={pred.generate}"]
    trainer = resolved.trainer.capabilities()
    if isinstance(trainer, SimTrainerCapabilities):
        out += trainer.resize(pred.train)
    else:
        out.append(f"pools.train.workers={pred.train}")
    out.append(f"run.mode={pred.mode}")
    if pred.mode == "async":
        out.append(f"run.max_staleness={pred.max_staleness}")
    tasks = math.ceil((pred.max_staleness + 1) * r.trainer.prompts_per_step / r.pools.generate.groups_per_task)
    # Dask spreads groups by count, not evenly: half again as many slots, and one for weight loads
    threads = math.ceil(1.5 * tasks / pred.generate) + 1
    if threads > r.pools.generate.threads:
        out.append(f"pools.generate.threads={threads}")
    return out


def search(profile: StageProfile, devices: int, modes: list[str], max_staleness: int, steps: int, warmup: int,
           cost: tuple[float, float], objective: str,
           trains_on: Callable[[int], bool] = lambda workers: True) -> list[tuple[Prediction, float]]:
    """Every split (at least one device each side, a train pool the trainer ``trains_on``), mode
    and bound, best first: ``[(prediction, samples per cost unit)]``."""
    rows = []
    for g in range(1, devices):
        if not trains_on(devices - g):  # (a trainer of one worker, or one that cannot shard: refused by the run)
            continue
        for mode in modes:
            for k in (range(1, max_staleness + 1) if mode == "async" else [0]):
                pred = predict(profile, g, devices - g, mode, k, steps, warmup)
                rows.append((pred, per_cost_hour(pred, cost)))
    key = (lambda r: r[1]) if objective == "cost" else (lambda r: r[0].samples_per_s)
    return sorted(rows, key=key, reverse=True)


def table(rows, profile: StageProfile, title: str, measured: dict | None = None) -> Table:
    """``[(label, prediction, samples per cost unit)]`` as a rich table (``measured``: label ->
    measured samples/s)."""
    unit = "sim s" if profile.simulated else "s"
    t = Table(title=title)
    for col in ["#", "generate", "train", "mode", "stale", f"samples/{unit}", "per cost-hour", "idle gen",
                "idle train", f"step ({unit})", "sync share"] + (["measured", "error"] if measured else []):
        t.add_column(col, justify="right")
    for i, p, pc in rows:
        cells = [str(i + 1) if isinstance(i, int) else i, str(p.generate), str(p.train), p.mode,
                 str(p.max_staleness) if p.mode == "async" else "-", f"{p.samples_per_s:.2f}",
                 f"{pc:,.0f}", f"{p.idle_generate:.0%}", f"{p.idle_train:.0%}", f"{p.step_s:.0f}",
                 f"{p.weight_sync_share:.2%}"]
        if measured:
            m = measured.get(i)
            cells += [f"{m:.2f}", f"{m / p.samples_per_s - 1:+.0%}"] if m else ["-", "-"]
        t.add_row(*cells)
    return t


def plan(file: str, overrides: list[str], devices: int | None, modes: list[str], max_staleness: int, top: int,
         steps: int, warmup: int, objective: str, check: bool, profile_file: str | None,
         save_profile: str | None, calibrate_steps: int, out: str | None, console: Console | None = None) -> dict:
    """The ``streamrl plan`` command; returns the JSON result it writes."""
    console = console or Console(stderr=True, width=140)
    resolved, time_scale = describe(file, overrides)
    if profile_file:
        prof = StageProfile.read(profile_file)
    else:
        prof = profiling.from_cost_model(resolved)
        if prof is None and not calibrate_steps:
            raise UserError(f"{file}: a real engine is profiled by a warm-up run of the recipe (--calibrate-steps N, "
                            f"N > 0) or planned from a saved profile with --profile")
        if prof is None:
            console.print(f"plan: profiling the recipe ({calibrate_steps} batch steps after one warm-up, "
                          f"and the engine's start-up profile)")
            prof = profiling.from_warmup(file, overrides, resolved, calibrate_steps)
        elif calibrate_steps:
            console.print(f"plan: calibrating the controller's own costs ({calibrate_steps} async steps of the recipe)")
            cal = profiling.calibrate(file, overrides, calibrate_steps)
            scale = time_scale or 1.0
            prof.step_overhead_s = cal["step_overhead_s"] / scale
            prof.submit_per_group_s = cal["submit_per_group_s"] / scale
            prof.source += (f"; controller {cal['step_overhead_s'] * 1000:.0f} ms/step + "
                            f"{cal['submit_per_group_s'] * 1000:.1f} ms/group measured")
    if save_profile:
        console.print(f"profile: {prof.save(save_profile)}")
    base_g, base_t = recipe_split(resolved)
    devices = devices or base_g + base_t
    if devices < 2:
        raise UserError("--devices must be >= 2 (one to generate, one to train)")
    cost = costs(resolved)
    rr, can = resolved.recipe, resolved.trainer.capabilities()
    rows = search(prof, devices, modes, max_staleness, steps, warmup, cost, objective,
                  lambda workers: not can.refuses(rr.trainer.name, workers, rr.trainer.strategy))
    if not rows:  # (every split but one train worker would be refused, and one leaves none to generate)
        raise UserError(f"--devices {devices}: no split of them is one trainer {rr.trainer.name!r} trains on "
                        f"({can.refuses(rr.trainer.name, devices - 1, rr.trainer.strategy)})")
    r = resolved.recipe.run
    best = rows[0][0]
    base_k = r.max_staleness if best.mode == "async" else 0
    base = predict(prof, base_g, base_t, best.mode, base_k, steps, warmup)
    shown = rows[:top] + [(base, per_cost_hour(base, cost))]
    labels = list(range(len(shown) - 1)) + ["recipe"]
    result = {"recipe": str(file), "overrides": list(overrides), "devices": devices, "objective": objective,
              "simulated": prof.simulated, "time_scale": time_scale, "profile": prof.source,
              "choices": [{**asdict(p), "per_cost_hour": _json_number(pc), "overrides": split_overrides(resolved, p)}
                          for p, pc in rows[:top]],
              "recipe_split": {**asdict(base), "per_cost_hour": _json_number(per_cost_hour(base, cost))}}
    measured = None
    if check:
        variants = {"plan": split_overrides(resolved, best),
                    "recipe": [f"run.mode={best.mode}"] + ([f"run.max_staleness={base_k}"] if base_k else [])}
        ran = run_variants(file, overrides, variants, steps, warmup, console, "plan --check", time_scale)
        rate = {k: v["sim_samples_per_s"] if time_scale else v["samples_per_s"] for k, v in ran.items()}
        measured = {0: rate["plan"], "recipe": rate["recipe"]}
        result["check"] = {k: {"measured_samples_per_s": rate[k], "idle": v["idle"], "run_dir": v["run_dir"]}
                           for k, v in ran.items()}
        result["check"]["plan_vs_recipe"] = rate["plan"] / rate["recipe"]
        result["check"]["prediction_error"] = rate["plan"] / best.samples_per_s - 1
    title = (f"streamrl plan {file}: {devices} devices" + (" -- SIMULATED" if prof.simulated else "")
             + f" (profile: {prof.source})")
    console.print(table([(lab, p, pc) for lab, (p, pc) in zip(labels, shown)], prof, title, measured))
    console.print("apply the top choice with: " + " ".join(f"--set {o}" for o in split_overrides(resolved, best)))
    if check:
        c = result["check"]
        console.print(f"check: plan {rate['plan']:.2f} vs recipe {rate['recipe']:.2f} measured samples/"
                      f"{'sim ' if prof.simulated else ''}s ({c['plan_vs_recipe']:.2f}x); prediction error "
                      f"{c['prediction_error']:+.0%}")
    path = Path(out) if out else None
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        console.print(f"result: {path}")
    return result

