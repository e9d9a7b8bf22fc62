"""``streamrl bench elastic RECIPE --min 1 --max 3``: a fixed generate pool vs an elastic one.

Variants, each a full run of the recipe (``--set`` overrides applied to all):

* ``fixed-<min>`` -- ``min`` generate workers for the whole run;
* ``fixed-<max>`` -- ``max`` of them;
* ``elastic``     -- starts with ``min`` and may grow to ``max`` (``pools.generate.elastic``).

Reported per variant: samples/s over the measured steps (boundary to boundary, the elastic run's
worker starts included), the mean generate pool size, samples per generate-worker-second (what a
pool billed per worker pays for), the pool size step by step, and whether every prompt of every
step was trained exactly once (from the sample ids in ``metrics.jsonl``).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

from streamrl.bench.modes import describe, run_variants, write_result
from streamrl.errors import UserError


def exactly_once(records: list[dict], prompts: int, samples_per_prompt: int) -> bool:
    """Every step trained ``prompts`` groups of ``samples_per_prompt`` samples, and no sample id
    appears twice in the run."""
    seen: set[str] = set()
    for r in records:
        uids = [x["uid"] for x in r["sample_log"]]
        groups = Counter(u.rsplit("-", 1)[0] for u in uids)
        if len(groups) != prompts or set(groups.values()) != {samples_per_prompt} or seen & set(uids):
            return False
        seen |= set(uids)
    return len(seen) == len(records) * prompts * samples_per_prompt


def pool_figures(records: list[dict]) -> dict:
    """The generate pool's size over the steps, and samples per generate-worker-second."""
    sizes = [r["generate_workers"] for r in records]
    worker_s = sum(r["generate_workers"] * r["accounting_window_s"] for r in records)
    window = sum(r["accounting_window_s"] for r in records)
    return {"pool_sizes": sizes, "mean_generate_workers": worker_s / window,
            "samples_per_generate_worker_s": sum(r["samples"] for r in records) / worker_s,
            "events": {r["step"]: r["elastic"] for r in records if r.get("elastic")}}


def bench(file: str, overrides: list[str], lo: int, hi: int, steps: int = 10, warmup: int = 1,
          out: str | None = None, console: Console | None = None) -> dict:
    """Run the three variants, print the table, write the JSON result; returns the result."""
    if not 1 <= lo < hi:
        raise UserError(f"--min/--max: expected 1 <= min < max (got {lo}, {hi})")
    console = console or Console(stderr=True, width=120)
    resolved, time_scale = describe(file, overrides)
    simulated = time_scale is not None
    # a fixed pool is an elastic one that may not move (so the recipe's own elastic table, if
    # any, is replaced the same way in every variant)
    variants = {f"fixed-{lo}": [f"pools.generate.workers={lo}", f"pools.generate.elastic={{min={lo},max={lo}}}"],
                f"fixed-{hi}": [f"pools.generate.workers={hi}", f"pools.generate.elastic={{min={hi},max={hi}}}"],
                "elastic": [f"pools.generate.workers={lo}", f"pools.generate.elastic={{min={lo},max={hi}}}"]}
    rows = run_variants(file, overrides, variants, steps, warmup, console, "elastic", time_scale)
    t = resolved.recipe.trainer
    for row in rows.values():
        records = [json.loads(line) for line in (Path(row["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
        measured = records[warmup:warmup + steps]
        row.update(pool_figures(measured))
        row["exactly_once"] = exactly_once(records, t.prompts_per_step, t.samples_per_prompt)
        row["vs_fixed_min"] = row["samples_per_s"] / rows[f"fixed-{lo}"]["samples_per_s"]
    result = {"recipe": str(file), "overrides": list(overrides), "simulated": simulated, "time_scale": time_scale,
              "steps": steps, "warmup": warmup, "min": lo, "max": hi, "variants": rows}
    console.print(table(result))
    write_result(result, out, console)
    return result


def table(result: dict) -> Table:
    """The comparison as a rich table."""
    sim = result["simulated"]
    t = Table(title=f"streamrl bench elastic {result['recipe']}"
                    + (f" -- SIMULATED (1 simulated s = {result['time_scale']} s)" if sim else ""))
    for col in ["variant", "sim samples/s" if sim else "samples/s", "x fixed-min", "mean gen workers",
                "samples/gen-worker-s", "idle gen", "idle train", "exactly once", "pool size by step"]:
        t.add_column(col, justify="right")
    for name, r in result["variants"].items():
        rate = r["sim_samples_per_s"] if sim else r["samples_per_s"]
        per_worker = r["samples_per_generate_worker_s"] * (result["time_scale"] or 1.0)
        t.add_row(name, f"{rate:.2f}", f"{r['vs_fixed_min']:.2f}", f"{r['mean_generate_workers']:.2f}",
                  f"{per_worker:.2f}", f"{r['idle'].get('generate', 0):.0%}", f"{r['idle'].get('train', 0):.0%}",
                  "yes" if r["exactly_once"] else "NO", ",".join(map(str, r["pool_sizes"])))
    return t
