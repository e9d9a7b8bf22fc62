"""``streamrl bench engine RECIPE``: how fast the recipe's engine generates one step's samples.

Each ``--variant LABEL:KEY=VALUE;KEY=VALUE`` is the recipe with those overrides (e.g.
``vllm:engine.name="vllm"``); with none, the recipe as it is. For each variant it brings up the
recipe's cluster, builds the engines on the generate workers, and generates ``--steps`` steps of
the task's prompts exactly as a run submits them (bundles of ``pools.generate.groups_per_task``
groups, spread over the generate workers, as many tasks at once as a run has) but trains
nothing: the policy stays the initial one, so every variant samples from the same model. It
reports seconds per step (median), samples/s and response tokens/s, and each variant's speed
relative to the first -- ratios measured in one invocation, on one machine.
"""

from __future__ import annotations

import json
import statistics
import time

from rich.console import Console
from rich.table import Table

from streamrl.cluster import lifecycle
from streamrl.errors import UserError
from streamrl.flow import submit
from streamrl.on_worker import task_functions
from streamrl.run import runner
from streamrl.run.controller import Controller
from streamrl.recipe.recipe import load_recipe


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``"label:a=1;b=2"`` -> ``("label", ["a=1", "b=2"])``; a bare ``"label"`` has no overrides."""
    label, _, rest = text.partition(":")
    if not label.strip():
        raise UserError(f"--variant {text!r}: expected LABEL:KEY=VALUE;KEY=VALUE")
    return label.strip(), [o.strip() for o in rest.split(";") if o.strip()]


def measure(file: str, overrides: list[str], steps: int, warmup: int) -> dict:
    """Generate ``warmup + steps`` steps with the recipe's engine; per measured step its seconds,
    samples and response tokens."""
    loaded = load_recipe(file, [*overrides, "cluster.dashboard=false"])
    resolved = runner.resolve(loaded)
    t = loaded.recipe.trainer
    dask_cluster, client = lifecycle.start(loaded.recipe)
    try:
        ctl = Controller(resolved, client, lifecycle.check_pools(client))
        ctl.place_residents()
        pins = list(ctl.topology.generate_pins().values())
        per_task = submit.groups_per_task(loaded.recipe)
        rows = []
        for step in range(warmup + steps):
            prompts = ctl.task.prompts(step, t.prompts_per_step)
            bundles = [prompts[i:i + per_task] for i in range(0, len(prompts), per_task)]
            before = loop_counts(client)
            wall0 = time.time()  # (the clock the samples' stamps use, so the phases add up to the step)
            futures = [client.submit(task_functions.generate_groups, b, t.samples_per_prompt,
                                     key=f"bench-gen-{step}-{k}", **pins[k % len(pins)])
                       for k, b in enumerate(bundles)]
            # one gather for all (as a run hands samples on: no round trip per task)
            groups = [g for bundle in client.gather(futures) for g in bundle]
            wall1 = time.time()
            seconds = wall1 - wall0
            if step >= warmup:
                samples = [s for g in groups for s in g]
                rows.append({"seconds": seconds, "samples": len(samples),
                             "response_tokens": sum(len(s.response_ids) for s in samples),
                             **phases(samples, wall0, wall1), **counted(before, loop_counts(client))})
        return {"engine": loaded.recipe.engine.name, "generate_workers": len(pins), "steps": rows}
    finally:
        lifecycle.stop(dask_cluster, client)


def loop_counts(client) -> dict:
    """Every generate worker's engine loop counters (``SlotEngine.loop_counts``), by worker; a
    worker whose engine keeps none is left out."""
    found = client.run(task_functions.engine_loop_counts)
    return {w: c for w, c in found.items() if c is not None}


def counted(before: dict, after: dict) -> dict:
    """A step's decode steps, admissions (each one prefill), the prefills' host seconds, those
    replayed from captured graphs and the loops' idle seconds, summed over the workers."""
    if not after:
        return {}
    return {f"engine_{k}": round(sum(c[k] - before.get(w, {}).get(k, 0) for w, c in after.items()), 4)
            for k in ("steps", "admissions", "admitted", "prefill_s", "prefill_graphed", "idle_s")}


def phases(samples: list, submitted: float, collected: float) -> dict:
    """Where a step's seconds went on the way through Dask, from the samples' own stamps (the
    engine's ``gen_start``, as its task called it, and ``gen_end``, as a response was handed
    back): ``dispatch_s`` from the submit to the first task's call into its engine, ``spread_s``
    from there to the last task's call (the tasks reach the engine one after another),
    ``generate_s`` from the first call to the last response, ``collect_s`` from the last response
    to every result in the caller's hands. One machine's clock: the bench's cluster is local."""
    starts = [s.times["gen_start"] for s in samples]
    first, last, end = min(starts), max(starts), max(s.times["gen_end"] for s in samples)
    return {"dispatch_s": round(first - submitted, 4), "spread_s": round(last - first, 4),
            "generate_s": round(end - first, 4), "collect_s": round(collected - end, 4)}


def summarise(label: str, result: dict) -> dict:
    """Median seconds per step and the rates over all measured steps."""
    rows = result["steps"]
    total = sum(r["seconds"] for r in rows)
    return {"variant": label, "engine": result["engine"], "generate_workers": result["generate_workers"],
            "step_s_median": statistics.median(r["seconds"] for r in rows),
            "samples_per_s": sum(r["samples"] for r in rows) / total,
            "response_tokens_per_s": sum(r["response_tokens"] for r in rows) / total,
            "mean_response_tokens": sum(r["response_tokens"] for r in rows) / sum(r["samples"] for r in rows),
            **{f"{k}_per_step": statistics.mean(r[k] for r in rows)
               for k in ("dispatch_s", "spread_s", "generate_s", "collect_s") if rows and k in rows[0]},
            **({"admissions_per_step": statistics.mean(r["engine_admissions"] for r in rows),
                "prefill_s_per_step": statistics.mean(r["engine_prefill_s"] for r in rows),
                "prefill_graphed_per_step": statistics.mean(r["engine_prefill_graphed"] for r in rows),
                "idle_s_per_step": statistics.mean(r["engine_idle_s"] for r in rows)}
               if rows and "engine_admissions" in rows[0] else {}),
            "steps": rows}


def bench(file: str, overrides: list[str], variants: list[str], steps: int, warmup: int, out: str | None) -> list[dict]:
    """Measure every variant, print the table (speed relative to the first), optionally write JSON."""
    parsed = [parse_variant(v) for v in variants] or [("recipe", [])]
    results = []
    for label, extra in parsed:
        results.append(summarise(label, measure(file, [*overrides, *extra], steps, warmup)))
    base = results[0]["step_s_median"]
    for r in results:
        r["speedup_vs_first"] = base / r["step_s_median"]
    table = Table(title=f"generation per step, {file} ({steps} steps after {warmup} warm-up)")
    for col in ("variant", "engine", "s/step (median)", "samples/s", "tokens/s", "tokens/sample", "speed-up"):
        table.add_column(col)
    for r in results:
        table.add_row(r["variant"], r["engine"], f"{r['step_s_median']:.3f}", f"{r['samples_per_s']:.0f}",
                      f"{r['response_tokens_per_s']:.0f}", f"{r['mean_response_tokens']:.1f}",
                      f"{r['speedup_vs_first']:.2f}x")
    Console().print(table)
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=2)
    return results
