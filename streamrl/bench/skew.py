"""``streamrl bench skew RECIPE``: fcfs dispatch vs StreamRL's skew scheduler, in one invocation.

Variants (each a full run of the recipe, ``--set`` overrides applied to all):

* ``fcfs``          -- round-robin dispatch, no ranker (the baseline);
* ``skew-oracle``   -- skew scheduler with the workload's true expected lengths (only for tasks
  that carry them, ``longtail-sim`` and ``countdown``): what a perfect ranker would give;
* ``lpt-oracle``    -- the same without the split: predicted work balanced over all instances
  (greedy LPT), longest first inside each;
* ``skew-learned``  -- skew scheduler with the online ``learned`` ranker (the real thing).

Reported per variant: mean generation makespan per step (first submission to last sample),
end-to-end samples/s (step boundary to boundary), ratios to fcfs, the ranker's top-20% recall.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from streamrl.bench.modes import write_result
from streamrl.bench.variants import describe, run_variants


def variants_for(resolved) -> dict[str, list[str]]:
    """The variants that make sense for the recipe's task (``resolved``: from
    ``streamrl.bench.variants.describe``)."""
    answer = resolved.task.build().prompts(0, 1)[0].answer

    def use(section: str, name: str) -> str:
        # keep the recipe's options when it already uses this component (e.g. its skew alpha);
        # otherwise replace the whole section, since another component's options would not validate
        current = getattr(resolved.recipe, section)
        return f'{section}.name="{name}"' if current is not None and current.name == name else f'{section}={{name="{name}"}}'

    out = {"fcfs": [use("scheduler", "fcfs")]}
    if isinstance(answer, dict) and "log_median" in answer:  # the oracle needs the true lengths
        out["skew-oracle"] = [use("scheduler", "skew"), use("ranker", "oracle")]
        # the same without the long-tail/regular split: LPT balancing of predicted work only
        out["lpt-oracle"] = [use("scheduler", "skew"), "scheduler.split=false", use("ranker", "oracle")]
    out["skew-learned"] = [use("scheduler", "skew"), use("ranker", "learned")]
    return out


def bench(file: str, overrides: list[str], steps: int = 5, warmup: int = 2, out: str | None = None,
          console: Console | None = None) -> dict:
    """Run the variants, print the table, write the JSON result; returns the result."""
    console = console or Console(stderr=True, width=120)
    resolved, time_scale = describe(file, overrides)
    simulated = time_scale is not None
    rows = run_variants(file, overrides, variants_for(resolved), steps, warmup, console, "skew", time_scale)
    ref = rows["fcfs"]
    for row in rows.values():
        row["speedup_generate"] = ref["generate_makespan_s"] / row["generate_makespan_s"]
        row["speedup_end_to_end"] = row["samples_per_s"] / ref["samples_per_s"]
    result = {"recipe": str(file), "overrides": list(overrides), "simulated": simulated, "time_scale": time_scale,
              "steps": steps, "warmup": warmup, "variants": rows}
    scale = time_scale or 1.0
    t = Table(title=f"streamrl bench skew {file}" + (f" -- SIMULATED (1 simulated s = {time_scale} s)" if simulated else ""))
    for col in ["variant", "gen makespan (sim s)" if simulated else "gen makespan s", "x fcfs (gen)",
                "sim samples/s" if simulated else "samples/s", "x fcfs (e2e)", "per cost-hour", "sync share",
                "recall@20%", "idle gen"]:
        t.add_column(col, justify="right")
    for name, r in rows.items():
        rate = r["samples_per_s"] * (time_scale or 1.0)
        t.add_row(name, f"{r['generate_makespan_s'] / scale:.1f}", f"{r['speedup_generate']:.2f}", f"{rate:.2f}",
                  f"{r['speedup_end_to_end']:.2f}", f"{r['samples_per_cost_hour']:,.0f}", f"{r['weight_sync_share']:.1%}",
                  f"{r['ranker_recall']:.2f}" if "ranker_recall" in r else "-",
                  f"{r['idle'].get('generate', 0):.0%}")
    console.print(t)
    write_result(result, out, console)
    return result
