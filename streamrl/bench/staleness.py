"""``streamrl bench staleness RECIPE``: how learning holds as samples get staler, with and without
an off-policy correction.

    streamrl bench staleness recipes/addition.toml --seeds 3 --out staleness.json

The recipe runs at each staleness ``k`` (0: ``stream`` mode, on-policy; ``k >= 1``: ``async``
with ``run.max_staleness = k``) with each correction (``algorithm.off_policy.correction``), for
each seed (``run.seed``), all for the same number of steps. Rows are compared on:

- the held-out score at the end (``[eval]``, added when the recipe has none: at the start and
  after the last step, on ``--eval-prompts`` of the task's held-out prompts), per seed;
- the area under the training reward curve (its mean over the steps);
- samples/s over the steps after the first;
- the diagnostics (``offpolicy/...``) averaged over the steps: mean token staleness, importance
  weights' effective sample size, shares clipped, truncated and masked.

Stale samples must really be stale: admission lets generation run at most ``k`` versions ahead,
but a generate worker that picks a task up late may already hold newer weights. The bench makes
the engine repeatable (``engine.reproducible = true`` where the engine has it): a step's
generation then finishes with the version it was admitted under, which is exactly ``k``
versions behind once ``k`` steps have passed. The table reports the measured mean token
staleness either way. Every run of the bench pays that setting, so the rows compare alike.

The runs share one cluster, started once (the recipe's own pools, embedded), each attaching to
it with ``cluster.address`` as a run on a cluster users already have does; seeds go round the
rows in turn (seed 0 of every row, then seed 1, ...) so a machine that slows down over time
favours none.
"""

from __future__ import annotations

import io
import json
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from streamrl.algorithms.off_policy import CORRECTIONS
from streamrl.bench.variants import one_cluster
from streamrl.errors import UserError
from streamrl.recipe.recipe import load_recipe
from streamrl.run import runner

#: the default correction (``OffPolicyConfig.correction``), chosen from the evidence in
#: docs/benchmarks.md: PPO's clip to the behaviour policy alone
DEFAULT = "none"

#: the correction the table compares with the default when the command names none: the best
#: of the others in the same evidence
RUNNER_UP = "m2po"

#: the staleness values of the table when the command names none
STALENESS = (0, 1, 2, 4, 8)


def variant_overrides(k: int, correction: str, seed: int, steps: int) -> list[str]:
    """The ``--set`` overrides of one run: staleness ``k``, the correction, the seed, the steps."""
    mode = ["run.mode=stream"] if k == 0 else ["run.mode=async", f"run.max_staleness={k}"]
    # (the whole table, the correction at its defaults: a recipe's cap or band for another
    # correction would be a setting this one does not read, and refused)
    return mode + [f'algorithm.off_policy={{correction="{correction}"}}', f"run.seed={seed}", f"run.steps={steps}"]


def held_out(records: list[dict]) -> float | None:
    """The held-out score of the policy after the last step: the last record's evaluation
    (pass@1, else the mean reward); None when the run evaluated nothing."""
    last = records[-1] if records else {}
    for key in ("eval/pass@1", "eval/reward_mean"):
        if key in last:
            return float(last[key])
    return None


def run_row(records: list[dict]) -> dict:
    """One run's figures from its ``metrics.jsonl`` records."""
    after = records[1:] or records  # the first step loads models and compiles: left out of samples/s
    window = sum(r["accounting_window_s"] for r in after)

    def mean(key: str) -> float | None:
        values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
        return sum(values) / len(values) if values else None

    bucket_means = {}
    for what in ("clipped", "truncated", "masked"):
        shares = [sum(r.get(f"offpolicy/{b}/{what}", 0.0) * r.get(f"offpolicy/{b}/tokens", 0) for b in
                      ("0", "1", "2-3", "4+")) / max(1, sum(r.get(f"offpolicy/{b}/tokens", 0) for b in
                                                            ("0", "1", "2-3", "4+"))) for r in records]
        bucket_means[f"{what}_mean"] = sum(shares) / len(shares) if shares else None
    return {"held_out": held_out(records), "reward_area": mean("reward_mean"),
            "samples_per_s": sum(r["samples"] for r in after) / window if window else 0.0,
            "token_staleness_mean": mean("offpolicy/token_staleness_mean"), "ess_mean": mean("offpolicy/ess"),
            "low_ess_steps": sum(1 for r in records if r.get("offpolicy/low_ess")), **bucket_means,
            "staleness_max": max((r["staleness_max"] for r in records), default=0)}


def summarize(runs: list[dict]) -> dict:
    """A row of the table from its runs (one per seed)."""
    seeds = [r["held_out"] for r in runs]
    scored = [s for s in seeds if s is not None]

    def mean(key: str) -> float | None:
        values = [r[key] for r in runs if r.get(key) is not None]
        return sum(values) / len(values) if values else None

    return {"seeds": seeds, "held_out_mean": statistics.fmean(scored) if scored else None,
            "held_out_spread": max(scored) - min(scored) if scored else None,
            **{k: mean(k) for k in ("reward_area", "samples_per_s", "token_staleness_mean", "ess_mean",
                                    "clipped_mean", "truncated_mean", "masked_mean")},
            "low_ess_steps": sum(r["low_ess_steps"] for r in runs), "runs": runs}


def bench(file: str, overrides: list[str], staleness=STALENESS, corrections=(DEFAULT, RUNNER_UP), seeds: int = 3,
          steps: int | None = None, eval_prompts: int = 256, out: str | None = None,
          console: Console | None = None) -> dict:
    """Run every (staleness, correction, seed), print the table, write the JSON; returns it."""
    console = console or Console(stderr=True, width=140)
    unknown = [c for c in corrections if c not in CORRECTIONS]
    if unknown:
        raise UserError(f"--corrections: unknown correction {unknown[0]!r}; expected some of {', '.join(CORRECTIONS)}")
    if seeds < 1 or min(staleness) < 0 or (steps is not None and steps < 1) or eval_prompts < 1:
        raise UserError("--seeds, --steps and --eval-prompts must be >= 1, --staleness values >= 0")
    loaded = load_recipe(file, overrides)
    recipe = loaded.recipe
    if recipe.cluster.address or recipe.cluster.factory:
        raise UserError(f"{file}: bench staleness starts the recipe's embedded cluster once for all its runs; "
                        "give a recipe without cluster.address or cluster.factory")
    steps = steps or recipe.run.steps
    # (named again: a recipe that leaves [algorithm] to its default gets a table from the
    # correction's override, which must still say which algorithm it is)
    common = list(overrides) + [f'algorithm.name="{recipe.algorithm.name}"']
    resolved = runner.resolve(loaded)
    forced = "reproducible" in type(resolved.engine.config).model_fields
    if forced:
        common.append("engine.reproducible=true")
    else:
        console.print(f"[yellow]engine {recipe.engine.name!r} cannot keep a step's generation on the version it was "
                      "admitted under: staleness is bounded, not forced (the table shows what it was)[/]")
    if recipe.eval is None:
        common += ["eval.every=0", f"eval.max_prompts={eval_prompts}"]
    for k in staleness:  # every variant validates before the first run starts
        for c in corrections:
            runner.resolve(load_recipe(file, common + variant_overrides(k, c, 0, steps)))
    tmp = tempfile.mkdtemp(prefix="streamrl-bench-staleness-")
    # On-policy every correction's weight is 1 (up to the engine's and trainer's disagreement on
    # the same weights: bucket 0's mismatch), so staleness 0 runs once, uncorrected, as the
    # reference -- unless ``none`` is not asked for.
    rows_run = [(k, c) for k in staleness for c in corrections
                if not (k == 0 and "none" in corrections and c != "none")]
    runs: dict[tuple[int, str], list[dict]] = {key: [] for key in rows_run}
    t_all = time.time()
    with one_cluster(recipe) as address:
        for seed in range(seeds):
            for k, c in rows_run:
                name = f"s{k}-{c}-seed{seed}"
                extra = variant_overrides(k, c, seed, steps) + [
                    f'cluster.address="{address}"', f'run.out_dir="{tmp}"', f'run.name="{name}"']
                run = load_recipe(file, common + extra)
                console.print(f"bench staleness: staleness {k}, {c}, seed {seed} ({steps} steps)")
                t0 = time.time()
                run_dir = runner.run(run, console=Console(file=io.StringIO()), report=False)
                records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
                row = run_row(records)
                row.update({"seed": seed, "run_dir": str(run_dir), "total_s": round(time.time() - t0, 1)})
                runs[(k, c)].append(row)
    rows = [{"staleness": k, "correction": c, **summarize(runs[(k, c)])} for k, c in rows_run]
    result = {"recipe": str(file), "overrides": list(overrides), "default": DEFAULT, "steps": steps,
              "seeds_per_row": seeds, "forced_staleness": forced, "wall_s": round(time.time() - t_all, 1),
              "rows": rows}
    console.print(table(result))
    path = Path(out) if out else Path(tmp) / "bench-staleness.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    console.print(f"result: {path}")
    return result


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(result: dict) -> Table:
    """The comparison as a rich table: a row per (staleness, correction)."""
    t = Table(title=f"streamrl bench staleness {result['recipe']} ({result['steps']} steps, "
                    f"{result['seeds_per_row']} seeds per row)")
    for col in ("staleness", "correction", "held-out per seed", "mean", "spread", "reward area", "samples/s",
                "token staleness", "ESS", "clipped", "truncated", "masked"):
        t.add_column(col, justify="right", no_wrap=col == "held-out per seed")
    for r in result["rows"]:
        t.add_row(str(r["staleness"]), r["correction"], " ".join(_f(s, ".3f") for s in r["seeds"]),
                  _f(r["held_out_mean"], ".3f"), _f(r["held_out_spread"], ".3f"), _f(r["reward_area"], ".3f"),
                  _f(r["samples_per_s"], ".0f"), _f(r["token_staleness_mean"], ".2f"), _f(r["ess_mean"], ".3f"),
                  _f(r["clipped_mean"], ".1%"), _f(r["truncated_mean"], ".1%"), _f(r["masked_mean"], ".1%"))
    return t
