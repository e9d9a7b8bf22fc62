"""What watching a run costs: W1 (``recipes/addition.toml``) with the live display against the
same run printing plain lines, interleaved, median samples/s of each.

    python benchmarks/display_cost.py --steps 30 --repeats 3

Both variants run everything else a run does at every step (metrics.jsonl, the trace, the
dashboard page's summary); the live variant draws rich's live display on a terminal console
(written to /dev/null), the plain one prints one line per step. The ratio live / plain is the
display's cost (1.0: none). Each run is a full run with its own embedded cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from rich.console import Console

from streamrl.run import runner
from streamrl.recipe.recipe import load_recipe


def samples_per_s(run_dir, warmup: int) -> float:
    """Steady-state samples/s of a run: its samples over its steps' wall time, warm-up left out."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][warmup:]
    return sum(r["samples"] for r in records) / sum(r["accounting_window_s"] for r in records)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="recipes/addition.toml")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="passes of both variants, interleaved")
    ap.add_argument("--out", default=None, help="write the JSON result here")
    args = ap.parse_args()
    out_dir = tempfile.mkdtemp(prefix="streamrl-display-")
    rates: dict[str, list[float]] = {"live": [], "plain": []}
    with open(os.devnull, "w") as devnull:
        for rep in range(args.repeats):
            for variant in (("live", "plain") if rep % 2 == 0 else ("plain", "live")):
                loaded = load_recipe(args.recipe, [f"run.steps={args.steps + args.warmup}", f'run.out_dir="{out_dir}"',
                                                   "cluster.dashboard_port=0", f'run.name="display-{variant}"'])
                console = Console(file=devnull, force_terminal=variant == "live", width=120)
                run_dir = runner.run(loaded, console=console, plain=variant == "plain", report=False)
                rates[variant].append(samples_per_s(run_dir, args.warmup))
                print(f"pass {rep + 1} {variant}: {rates[variant][-1]:.1f} samples/s", flush=True)
    ratios = [live / plain for live, plain in zip(rates["live"], rates["plain"])]
    result = {"recipe": args.recipe, "steps": args.steps, "warmup": args.warmup, "samples_per_s": rates,
              "median_live": statistics.median(rates["live"]), "median_plain": statistics.median(rates["plain"]),
              "ratios_live_over_plain": ratios, "median_ratio": statistics.median(ratios)}
    print(f"live display: {result['median_live']:.1f} samples/s, plain: {result['median_plain']:.1f}; "
          f"live/plain median ratio {result['median_ratio']:.3f} over {args.repeats} interleaved passes")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
