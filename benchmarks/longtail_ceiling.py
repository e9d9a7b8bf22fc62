"""How much a step's generation makespan can shrink on a simulated long-tail recipe, by how much
each placement knows about the lengths -- the ceiling that the ``longtail`` scheduler works under.

    python benchmarks/longtail_ceiling.py recipes/paper-7b-20k.toml --steps 2-6

Every row places the very samples a run of the recipe generates (the ``sim`` engine's lengths,
seeded the same) and runs them in the rollout model (:mod:`streamrl.sim.rollout`: every instance
on one virtual clock, the ``sim`` engine's cost model, all of a step admitted at once, no
moves). What each row knows:

* ``fcfs``               -- nothing: whole groups round-robin (the baseline);
* ``spread``             -- nothing: every group's samples dealt one per instance in turn (the
  ``longtail`` scheduler with chunks of 1 and no ranker);
* ``group-oracle LPT``   -- each prompt's true median length (its hidden difficulty, what a
  perfect ranker or a group's own samples can learn): samples placed longest expected first,
  each on the instance with the least expected work;
* ``group-oracle tail``  -- the same knowledge, StreamRL's split: the samples of groups whose
  median is above a threshold on ``k`` long-tail instances of their own, the rest balanced over
  the others; the best ``k`` and threshold per step;
* ``sample-oracle LPT``  -- every sample's true length, the same greedy balance as above;
* ``sample-oracle tail`` -- every sample's true length, the split by the sample's own length
  (the best ``k`` and threshold per step, said in the cell).

The gap between the group rows and the sample rows is what no estimate from a prompt or a
group can close: how long one sample of a group runs is, in this workload, its own draw.
Everything here is SIMULATED.
"""

from __future__ import annotations

import argparse
import math
import random

from streamrl.recipe.recipe import load_recipe
from streamrl.run import runner
from streamrl.sim import latency
from streamrl.sim.rollout import Rollout, SampleRecord
from streamrl.sim.workload import sample_length


def work(s: SampleRecord, length: float) -> float:
    """Context-token reads of one sample of ``length`` tokens (what a decode step pays for)."""
    return length * (s.prompt_tokens + length / 2)


def balance(samples: list[SampleRecord], instances: list[int], length, c0: float, per_ctx: float) -> list:
    """Longest first, each to the instance whose estimated finish (decode-step overhead times its
    longest sample, plus the context reads of everything on it) grows least."""
    longest = dict.fromkeys(instances, 0.0)
    load = dict.fromkeys(instances, 0.0)
    out = []
    for s in sorted(samples, key=lambda s: -length(s)):
        n = length(s)
        i = min(instances, key=lambda j: (c0 * max(longest[j], n) + per_ctx * (load[j] + work(s, n)), j))
        longest[i], load[i] = max(longest[i], n), load[i] + work(s, n)
        out.append((s, i, n))
    return out


def main() -> None:
    """Print one markdown table: per step, the makespan of each row and its ratio to fcfs."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("--steps", default="2-6", help="steps to place, e.g. 2-6 (the bench's measured steps)")
    args = ap.parse_args()
    resolved = runner.resolve(load_recipe(args.recipe, []))
    engine, recipe = resolved.engine.capabilities(), resolved.recipe
    task, profile = resolved.task.build(), engine.profile
    n_inst, per_prompt = recipe.pools.generate.workers, recipe.trainer.samples_per_prompt
    c0, per_ctx = latency.decode_coefficients(profile)
    lo, hi = (int(x) for x in args.steps.split("-"))

    def fresh(samples):
        return [SampleRecord(s.group, s.index, s.length, s.prompt_tokens) for s in samples]

    def run(samples, placed):
        return Rollout(profile, n_inst).run(samples, placed).makespan_s

    names = ["fcfs", "spread", "group-oracle LPT", "group-oracle tail", "sample-oracle LPT", "sample-oracle tail"]

    def split(base, length):
        """The best ``(makespan, k, threshold)`` of a long-tail split by ``length``."""
        best = None
        for k in range(1, n_inst):
            for threshold in range(2000, 20001, 2000):
                s = fresh(base)
                placed = (balance([x for x in s if length(x) > threshold], list(range(k)), length, c0, per_ctx)
                          + balance([x for x in s if length(x) <= threshold], list(range(k, n_inst)), length, c0,
                                    per_ctx))
                m = run(s, placed)
                if best is None or m < best[0]:
                    best = (m, k, threshold)
        return best
    totals = dict.fromkeys(names, 0.0)
    print("| step | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for step in range(lo, hi + 1):
        prompts = task.prompts(step, recipe.trainer.prompts_per_step)
        median = {p.uid: p.answer["log_median"] for p in prompts}
        base = [SampleRecord(p.uid, k, sample_length(p, random.Random(f"{engine.seed}-{p.uid}-{k}")),
                             p.answer["prompt_tokens"]) for p in prompts for k in range(per_prompt)]
        group_of = {p.uid: g for g, p in enumerate(prompts)}
        row = {}
        s = fresh(base)
        row["fcfs"] = run(s, [(x, group_of[x.group] % n_inst, 0.0) for x in s])
        s = fresh(base)
        row["spread"] = run(s, [(x, j % n_inst, 0.0) for j, x in enumerate(s)])
        s = fresh(base)
        row["group-oracle LPT"] = run(s, balance(s, list(range(n_inst)), lambda x: math.exp(median[x.group]),
                                                 c0, per_ctx))
        grouped = split(base, lambda x: math.exp(median[x.group]))
        row["group-oracle tail"] = grouped[0]
        s = fresh(base)
        row["sample-oracle LPT"] = run(s, balance(s, list(range(n_inst)), lambda x: x.length, c0, per_ctx))
        best = split(base, lambda x: x.length)
        row["sample-oracle tail"] = best[0]
        for name in names:
            totals[name] += row[name]
        cells = [f"{row[name]:.1f} ({row['fcfs'] / row[name]:.2f}x)" for name in names]
        cells[3] += f" k={grouped[1]}, >{grouped[2]}"
        cells[-1] += f" k={best[1]}, >{best[2]}"
        print(f"| {step} | " + " | ".join(cells) + " |")
    print("| mean | " + " | ".join(f"{totals[name] / (hi - lo + 1):.1f} ({totals['fcfs'] / totals[name]:.3f}x)"
                                  for name in names) + " |")


if __name__ == "__main__":
    main()
