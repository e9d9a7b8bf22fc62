"""``streamrl bench eval``: what held-out evaluation costs training -- the recipe without and
with ``[eval] every = N``, back to back and interleaved, samples/s of each.

    streamrl bench eval recipes/addition.toml --every 10 --steps 30 --warmup 3 --repeats 3

Evaluation runs on the generate pool below training's Dask priority; the ratio says how much
of the run's throughput it takes. Passes alternate the order (without, with; with, without; ...)
so a machine that slows down over time does not favour one; the median ratio is reported.
"""

from __future__ import annotations

import json
import statistics

from rich.console import Console
from rich.table import Table

from streamrl.errors import UserError
from streamrl.recipe.recipe import load_recipe
from streamrl.bench.variants import describe, run_variants


def bench(file: str, overrides: list[str], every: int, steps: int, warmup: int, repeats: int,
          out: str | None) -> dict:
    """Run the passes, print the table; returns each pass's rows and the median ratio."""
    if load_recipe(file, overrides).recipe.eval is not None:
        raise UserError(f"{file}: the recipe has an [eval] table already; bench eval adds one (give a recipe "
                        "without it)")
    if every < 1 or repeats < 1:
        raise UserError("--every and --repeats must be >= 1")
    _, time_scale = describe(file, overrides)
    console = Console()
    variants = {"no eval": [], f"eval every {every}": [f"eval.every={every}"]}
    passes = []
    for i in range(repeats):
        order = dict(reversed(list(variants.items()))) if i % 2 else variants
        passes.append(run_variants(file, overrides, order, steps, warmup, console, f"eval, pass {i + 1}",
                                   time_scale))
    with_eval = f"eval every {every}"
    ratios = [p[with_eval]["samples_per_s"] / p["no eval"]["samples_per_s"] for p in passes]
    table = Table(title=f"held-out evaluation's cost: {file} ({steps} steps after {warmup} warm-up, "
                        f"{repeats} interleaved passes)")
    for col in ("pass", "samples/s without", f"samples/s with eval every {every}", "ratio", "gen idle without",
                "gen idle with"):
        table.add_column(col)
    for i, (p, ratio) in enumerate(zip(passes, ratios)):
        table.add_row(str(i + 1), f"{p['no eval']['samples_per_s']:.1f}", f"{p[with_eval]['samples_per_s']:.1f}",
                      f"{ratio:.3f}", f"{p['no eval']['idle'].get('generate', 0):.0%}",
                      f"{p[with_eval]['idle'].get('generate', 0):.0%}")
    median = statistics.median(ratios)
    table.add_row("median", "", "", f"{median:.3f}", "", "")
    console.print(table)
    result = {"passes": passes, "ratios": ratios, "median_ratio": median}
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
    return result
