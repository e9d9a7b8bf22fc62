"""``streamrl bench elastic RECIPE --min 1 --max 3``: a fixed generate pool vs an elastic one.

Variants, each a full run of the recipe (``--set`` overrides applied to all):

* ``fixed-<min>`` -- ``min`` generate workers for the whole run;
* ``fixed-<max>`` -- ``max`` of them;
* ``elastic``     -- starts with ``min`` and may grow to ``max`` (``pools.generate.elastic``).

Reported per variant: samples/s over the measured steps (boundary to boundary, the elastic run's
worker starts included), the mean generate pool size, samples per generate-worker-second (what a
pool billed per worker pays for), the pool size step by step, and whether every prompt of every
step was trained exactly once (from the sample ids in ``metrics.jsonl``).

``--repeats N`` runs the three variants N times, interleaved (fixed-min, fixed-max, elastic,
elastic, fixed-max, fixed-min, ...), and reports each pass and the median of each variant's ratio to fixed-min *of
the same pass*: on a shared machine one pass's ratio moves by more than the effect measured
(seen: fixed-1 alone ranged 46-110 samples/s across days on 2 cores), and pairing runs of one
pass cancels the slow drift.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

from streamrl.bench.modes import write_result
from streamrl.errors import UserError
from streamrl.bench.variants import describe, run_variants


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
    """The generate pool's size over the steps, samples per generate-worker-second, and response
    tokens per second: runs of one recipe learn apart (their mean response lengths differ from
    run to run), and a run whose answers got shorter has more samples/s for the same generation
    speed."""
    sizes = [r["generate_workers"] for r in records]
    worker_s = sum(r["generate_workers"] * r["accounting_window_s"] for r in records)
    window = sum(r["accounting_window_s"] for r in records)
    tokens = sum(r["response_len_mean"] * r["samples"] for r in records)
    return {"pool_sizes": sizes, "mean_generate_workers": worker_s / window,
            "response_tokens_per_s": tokens / window,
            "samples_per_generate_worker_s": sum(r["samples"] for r in records) / worker_s,
            "events": {r["step"]: r["elastic"] for r in records if r.get("elastic")}}


def bench(file: str, overrides: list[str], lo: int, hi: int, steps: int = 10, warmup: int = 1,
          out: str | None = None, console: Console | None = None, repeats: int = 1) -> dict:
    """Run the three variants ``repeats`` times, print the table, write the JSON result; returns
    the result (its ``variants`` are the first pass, ``passes`` all of them, ``median_vs_fixed_min``
    the median ratio of each variant to fixed-min over the passes)."""
    if not 1 <= lo < hi:
        raise UserError(f"--min/--max: expected 1 <= min < max (got {lo}, {hi})")
    if repeats < 1:
        raise UserError(f"--repeats: expected >= 1 (got {repeats})")
    console = console or Console(stderr=True, width=120)
    resolved, time_scale = describe(file, overrides)
    simulated = time_scale is not None
    # a fixed pool is an elastic one that may not move (so the recipe's own elastic table, if
    # any, is replaced the same way in every variant)
    variants = {f"fixed-{lo}": [f"pools.generate.workers={lo}", f"pools.generate.elastic={{min={lo},max={lo}}}"],
                f"fixed-{hi}": [f"pools.generate.workers={hi}", f"pools.generate.elastic={{min={hi},max={hi}}}"],
                "elastic": [f"pools.generate.workers={lo}", f"pools.generate.elastic={{min={lo},max={hi}}}"]}
    t = resolved.recipe.trainer
    passes = []
    for i in range(repeats):
        label = "elastic" if repeats == 1 else f"elastic, pass {i + 1}/{repeats}"
        # every other pass in reverse order, so a drift of the machine's speed during the bench
        # does not favour the variant that always runs first
        order = dict(list(variants.items())[::-1 if i % 2 else 1])
        rows = run_variants(file, overrides, order, steps, warmup, console, label, time_scale)
        rows = {name: rows[name] for name in variants}
        for row in rows.values():
            records = [json.loads(line) for line in (Path(row["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
            measured = records[warmup:warmup + steps]
            row.update(pool_figures(measured))
            row["exactly_once"] = exactly_once(records, t.prompts_per_step, t.samples_per_prompt)
            row["vs_fixed_min"] = row["samples_per_s"] / rows[f"fixed-{lo}"]["samples_per_s"]
            row["tokens_vs_fixed_min"] = row["response_tokens_per_s"] / rows[f"fixed-{lo}"]["response_tokens_per_s"]
        passes.append(rows)
    medians = {name: statistics.median(p[name]["vs_fixed_min"] for p in passes) for name in variants}
    token_medians = {name: statistics.median(p[name]["tokens_vs_fixed_min"] for p in passes) for name in variants}
    result = {"recipe": str(file), "overrides": list(overrides), "simulated": simulated, "time_scale": time_scale,
              "steps": steps, "warmup": warmup, "min": lo, "max": hi, "repeats": repeats,
              "variants": passes[0], "passes": passes, "median_vs_fixed_min": medians,
              "median_tokens_vs_fixed_min": token_medians}
    console.print(table(result))
    write_result(result, out, console)
    return result


def table(result: dict) -> Table:
    """The comparison as a rich table: one row per variant and pass, then the medians."""
    sim = result["simulated"]
    passes = result.get("passes", [result["variants"]])
    t = Table(title=f"streamrl bench elastic {result['recipe']}"
                    + (f" -- SIMULATED (1 simulated s = {result['time_scale']} s)" if sim else ""),
              caption=(None if len(passes) == 1 else "median x fixed-min over the passes, samples/s: " + ", ".join(
                  f"{name} {m:.2f}" for name, m in result["median_vs_fixed_min"].items()) + "; response tokens/s: "
                  + ", ".join(f"{name} {m:.2f}" for name, m in result["median_tokens_vs_fixed_min"].items())))
    for col in ["pass", "variant", "sim samples/s" if sim else "samples/s", "x fixed-min", "tokens/s x fixed-min",
                "per cost-hour", "sync share", "mean gen workers",
                "samples/gen-worker-s", "idle gen", "idle train", "exactly once", "pool size by step"]:
        t.add_column(col, justify="right")
    for i, rows in enumerate(passes):
        for name, r in rows.items():
            _row(t, result, i + 1, name, r)
    return t


def _row(t: Table, result: dict, i: int, name: str, r: dict) -> None:
    sim = result["simulated"]
    rate = r["sim_samples_per_s"] if sim else r["samples_per_s"]
    per_worker = r["samples_per_generate_worker_s"] * (result["time_scale"] or 1.0)
    t.add_row(str(i), name, f"{rate:.2f}", f"{r['vs_fixed_min']:.2f}", f"{r['tokens_vs_fixed_min']:.2f}",
              f"{r['samples_per_cost_hour']:,.0f}", f"{r['weight_sync_share']:.1%}", f"{r['mean_generate_workers']:.2f}",
              f"{per_worker:.2f}", f"{r['idle'].get('generate', 0):.0%}", f"{r['idle'].get('train', 0):.0%}",
              "yes" if r["exactly_once"] else "NO", ",".join(map(str, r["pool_sizes"])))
