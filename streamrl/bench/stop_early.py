"""``streamrl bench stop-early RECIPE``: the same workload with responses ended early by the
reward's ``stop_early`` (``engine.stop_early_every``) and without, in one invocation.

Each variant is a full run of the recipe on the slot engine (``engine.batching = "slots"`` is set
for both), one after the other; the first ``warmup`` steps are left out. Reported per variant:
samples/s, the generation makespan of a step (its first submission to its last sample),
response tokens per sample, the reward, and the share of samples the engine ended early.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from streamrl.bench.modes import write_result
from streamrl.bench.variants import describe, run_variants


def bench(file: str, overrides: list[str], every: int = 8, steps: int = 5, warmup: int = 1,
          out: str | None = None, console: Console | None = None) -> dict:
    """Run the recipe with ``engine.stop_early_every = 0`` and ``= every``; print and write the result."""
    console = console or Console(stderr=True, width=120)
    base = list(overrides) + ['engine.batching="slots"']
    _, time_scale = describe(file, base)
    variants = {"off": ["engine.stop_early_every=0"], f"every {every}": [f"engine.stop_early_every={every}"]}
    rows = run_variants(file, base, variants, steps, warmup, console, "stop-early", time_scale)
    for row in rows.values():
        records = [json.loads(line) for line in (Path(row["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
        kept = records[warmup:warmup + steps]
        row["makespan_s"] = sum(r.get("generate_makespan_s", r["generate_s"]) for r in kept) / len(kept)
        row["response_len_mean"] = sum(r["response_len_mean"] for r in kept) / len(kept)
        row["stopped_early"] = sum(r.get("stopped_early", 0.0) for r in kept) / len(kept)
    off = rows["off"]
    for row in rows.values():
        row["x_samples_per_s"] = row["samples_per_s"] / off["samples_per_s"]
        row["x_makespan"] = off["makespan_s"] / row["makespan_s"]
    result = {"recipe": str(file), "overrides": list(overrides), "steps": steps, "warmup": warmup, "variants": rows}
    console.print(table(result))
    write_result(result, out, console)
    return result


def table(result: dict) -> Table:
    """The comparison as a rich table."""
    t = Table(title=f"streamrl bench stop-early {result['recipe']}")
    for col in ["stop early", "samples/s", "x off", "gen makespan s", "x off (faster)", "tokens/sample",
                "ended early", "reward"]:
        t.add_column(col, justify="right")
    for name, r in result["variants"].items():
        t.add_row(name, f"{r['samples_per_s']:.2f}", f"{r['x_samples_per_s']:.2f}", f"{r['makespan_s']:.2f}",
                  f"{r['x_makespan']:.2f}", f"{r['response_len_mean']:.1f}", f"{r['stopped_early']:.1%}",
                  f"{r['reward_mean']:.3f}")
    return t
