"""``streamrl bench skew RECIPE``: fcfs dispatch vs StreamRL's skew scheduler, in one invocation.

Variants (each a full run of the recipe, ``--set`` overrides applied to all):

* ``fcfs``          -- round-robin dispatch, no ranker (the baseline);
* ``skew-oracle``   -- skew scheduler with the workload's true expected lengths (only for tasks
  that carry them, ``longtail-sim`` and ``countdown``): what a perfect ranker would give;
* ``lpt-oracle``    -- the same without the split: predicted work balanced over all instances
  (greedy LPT), longest first inside each;
* ``skew-learned``  -- skew scheduler with the online ``learned`` ranker (the real thing);
* ``longtail-learned`` -- the ``longtail`` scheduler: groups cut into chunks, placed
  longest estimated first on the instance with the least estimated work, priors from the
  ``learned`` ranker;
* ``fcfs-again`` (with ``--repeats`` above 1) -- ``fcfs`` once more in every pass: how far two
  runs of one variant land apart on this machine, the noise to read the other ratios against.

On a simulated recipe whose prompts carry their hidden length model, a second table comes from
the rollout model (:mod:`streamrl.sim.rollout_run`: every instance on one virtual clock, no
Dask), where a coordinator sees all instances, so it also measures what a run's dispatch cannot
do: stragglers moved (``+moves``, and the same without them), estimates updated from a group's
own finished samples. It shows ``fcfs`` and the table's variants again on the same footing.

Reported per variant: mean generation makespan per step (first submission to last sample),
end-to-end samples/s (step boundary to boundary), ratios to fcfs, the ranker's top-20% recall.
"""

from __future__ import annotations

import statistics

from rich.console import Console
from rich.table import Table

from streamrl.bench.modes import write_result
from streamrl.bench.variants import describe, run_variants
from streamrl.errors import UserError


def medians(rows: list[dict]) -> dict:
    """One row from several passes of a variant: each number the median over the passes, the
    rest (run folder, idle shares) from the first pass."""
    out = dict(rows[0])
    for key, value in rows[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and all(key in r for r in rows):
            out[key] = statistics.median(r[key] for r in rows)
    return out


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
    out["longtail-learned"] = [use("scheduler", "longtail"), use("ranker", "learned")]
    if resolved.engine.capabilities().moves_samples:  # stragglers moved between the run's live engines
        out["longtail-learned +moves"] = [use("scheduler", "longtail"), "scheduler.migrate=true", use("ranker", "learned")]
    return out


def chosen(variants: dict[str, list[str]], only: str | None) -> dict[str, list[str]]:
    """The variants ``--variants`` names (comma-separated), ``fcfs`` first whether named or not
    (every ratio is to it); all of them when ``only`` is None. One line naming the unknown ones."""
    if only is None:
        return variants
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in variants]
    if unknown:
        raise UserError(f"--variants: {', '.join(map(repr, unknown))} not among this recipe's variants: "
                        f"{', '.join(variants)}")
    return {name: variants[name] for name in variants if name == "fcfs" or name in names}


def rollout_variants() -> list:
    """The rollout model's variants (fresh rankers and policies each)."""
    from streamrl.ranking.rankers import LearnedRanker, LearnedRankerConfig, OracleRanker, OracleRankerConfig
    from streamrl.scheduling.longtail import LongTailConfig
    from streamrl.scheduling.schedulers import FCFS, FCFSConfig, Skew, SkewConfig
    from streamrl.sim.rollout_run import Variant

    def learned():
        return LearnedRanker(LearnedRankerConfig())

    return [Variant("fcfs", FCFS(FCFSConfig())),
            Variant("lpt-oracle", Skew(SkewConfig(split=False)), ranker=OracleRanker(OracleRankerConfig())),
            Variant("skew-learned", Skew(SkewConfig()), ranker=learned()),
            Variant("longtail-learned, whole groups", policy=LongTailConfig(chunk=0), ranker=learned()),
            Variant("longtail-learned", policy=LongTailConfig(), ranker=learned()),
            Variant("longtail-learned, chunks of 1", policy=LongTailConfig(chunk=1), ranker=learned()),
            Variant("longtail, no ranker", policy=LongTailConfig()),
            Variant("longtail-learned +moves", policy=LongTailConfig(migrate=True), ranker=learned()),
            Variant("longtail-learned +moves, whole groups", policy=LongTailConfig(chunk=0, migrate=True),
                    ranker=learned())]


def rollout_table(resolved, steps: int, warmup: int, console: Console) -> dict | None:
    """The rollout model's rows (None when the recipe is not simulated or its prompts carry no
    hidden length model)."""
    from streamrl.sim.capabilities import SimEngineCapabilities, SimTrainerCapabilities
    from streamrl.sim.rollout_run import Setup, simulate

    engine, trainer = resolved.engine.capabilities(), resolved.trainer.capabilities()
    task = resolved.task.build()
    answer = task.prompts(0, 1)[0].answer
    if not isinstance(engine, SimEngineCapabilities) or not (isinstance(answer, dict) and "prompt_tokens" in answer):
        return None
    r = resolved.recipe
    setup = Setup(task, engine.profile, r.pools.generate.workers, r.trainer.prompts_per_step,
                  r.trainer.samples_per_prompt, seed=engine.seed,
                  train_gpus=trainer.gpus if isinstance(trainer, SimTrainerCapabilities) else 1,
                  max_running=engine.max_running)
    rows = {v.name: {k: x for k, x in simulate(setup, v, steps, warmup).items() if k != "rows"}
            for v in rollout_variants()}
    ref = rows["fcfs"]
    t = Table(title="rollout model (virtual time, all instances on one clock, stream-mode training modelled) -- SIMULATED")
    for col in ["variant", "gen makespan (sim s)", "x fcfs (gen)", "step (sim s)", "x fcfs (e2e)", "moved/step",
                "recall@20% ranker", "recall@20% own first"]:
        t.add_column(col, justify="right")
    for name, x in rows.items():
        x["speedup_generate"] = ref["generate_makespan_s"] / x["generate_makespan_s"]
        x["speedup_end_to_end"] = ref["step_s"] / x["step_s"]
        t.add_row(name, f"{x['generate_makespan_s']:.1f}", f"{x['speedup_generate']:.3f}", f"{x['step_s']:.1f}",
                  f"{x['speedup_end_to_end']:.3f}", f"{x['moved']:.1f}",
                  f"{x['recall_prior']:.2f}" if "recall_prior" in x else "-",
                  f"{x['recall_first']:.2f}" if "recall_first" in x else "-")
    console.print(t)
    return rows


def bench(file: str, overrides: list[str], steps: int = 5, warmup: int = 2, out: str | None = None,
          console: Console | None = None, repeats: int = 1, only: str | None = None) -> dict:
    """Run the variants (those ``only`` names, comma-separated, and ``fcfs``; default all)
    ``repeats`` times (interleaved, every other pass in reverse order), print the table, write
    the JSON result; returns the result. Its ``variants`` are each variant's medians over the
    passes (ratios to each pass's own ``fcfs``), ``passes`` every pass."""
    if repeats < 1:
        raise UserError(f"--repeats: expected >= 1 (got {repeats})")
    console = console or Console(stderr=True, width=160)
    resolved, time_scale = describe(file, overrides)
    simulated = time_scale is not None
    variants = chosen(variants_for(resolved), only)
    if repeats > 1:  # an A/A pair: how far two runs of one variant land apart on this machine
        variants["fcfs-again"] = variants["fcfs"]
    passes = []
    for i in range(repeats):
        label = "skew" if repeats == 1 else f"skew, pass {i + 1}/{repeats}"
        # a drift of the machine's speed during the bench must not favour the variant run first
        order = dict(list(variants.items())[::-1 if i % 2 else 1])
        rows = run_variants(file, overrides, order, steps, warmup, console, label, time_scale)
        rows = {name: rows[name] for name in variants}
        ref = rows["fcfs"]
        for row in rows.values():
            row["speedup_generate"] = ref["generate_makespan_s"] / row["generate_makespan_s"]
            row["speedup_end_to_end"] = row["samples_per_s"] / ref["samples_per_s"]
        passes.append(rows)
    rows = {name: medians([p[name] for p in passes]) for name in variants}
    result = {"recipe": str(file), "overrides": list(overrides), "simulated": simulated, "time_scale": time_scale,
              "steps": steps, "warmup": warmup, "repeats": repeats, "variants": rows, "passes": passes}
    scale = time_scale or 1.0
    t = Table(title=f"streamrl bench skew {file}" + (f" -- SIMULATED (1 simulated s = {time_scale} s)" if simulated else ""))
    if repeats > 1:
        t.caption = (f"medians over {repeats} interleaved passes; \\[range] over the passes; fcfs-again is fcfs run "
                     "twice per pass: the bench's own noise")
    for col in ["variant", "gen makespan (sim s)" if simulated else "gen makespan s", "x fcfs (gen)",
                "sim samples/s" if simulated else "samples/s", "x fcfs (e2e)", "per cost-hour", "sync share",
                "recall@20%", "own first recall", "moved/step", "idle gen"]:
        t.add_column(col, justify="right")

    def ratio(name: str, key: str) -> str:
        spread = [p[name][key] for p in passes]
        return f"{rows[name][key]:.2f}" + (f" [{min(spread):.2f}-{max(spread):.2f}]" if repeats > 1 else "")

    for name, r in rows.items():
        rate = r["samples_per_s"] * (time_scale or 1.0)
        t.add_row(name, f"{r['generate_makespan_s'] / scale:.1f}", ratio(name, "speedup_generate"), f"{rate:.2f}",
                  ratio(name, "speedup_end_to_end"), f"{r['samples_per_cost_hour']:,.0f}",
                  f"{r['weight_sync_share']:.1%}",
                  f"{r['ranker_recall']:.2f}" if "ranker_recall" in r else "-",
                  f"{r['first_sample_recall']:.2f}" if "first_sample_recall" in r else "-",
                  f"{r['moves/moved']:.1f}" if "moves/moved" in r else "-",
                  f"{r['idle'].get('generate', 0):.0%}")
    console.print(t)
    rollout = rollout_table(resolved, steps, warmup, console)
    if rollout is not None:
        result["rollout_model"] = rollout
    write_result(result, out, console)
    return result
