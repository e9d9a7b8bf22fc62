"""Steps of simulated rollouts under one dispatch variant: the ranker learns between steps as in
a real run (:class:`streamrl.flow.dispatch.Dispatcher`), the policy's length estimates learn
across steps, and each step's training is modelled in stream mode (the trainer takes groups as
they finish). What ``streamrl bench skew`` runs for the variants a Dask run cannot express.
Every figure is *simulated*.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from functools import partial

from streamrl.api import DispatchContext, Ranker, Scheduler
from streamrl.ranking.recall import top_recall
from streamrl.scheduling.estimates import prior_from_scores
from streamrl.scheduling.longtail import GroupSpec, LongTailConfig, LongTailPolicy
from streamrl.sim import latency
from streamrl.sim.latency import Profile
from streamrl.sim.rollout import Rollout, SampleRecord, StepResult
from streamrl.sim.workload import sample_length


@dataclass
class Variant:
    """One way of dispatching: a whole-group :class:`Scheduler`, or the long-tail policy."""

    name: str
    """Its name in the table."""
    scheduler: Scheduler | None = None
    """A whole-group scheduler (``fcfs``, ``skew``), placed once per step."""
    policy: LongTailConfig | None = None
    """Or the long-tail policy's options."""
    ranker: Ranker | None = None
    """The prompt-text ranker (None: every prompt scores alike)."""


@dataclass
class Setup:
    """The simulated cluster and workload of a recipe."""

    task: object
    """The task (its prompts carry their hidden length model)."""
    profile: Profile
    """Cost model of an instance."""
    instances: int
    """Generate instances."""
    prompts_per_step: int
    """Prompt groups per step."""
    samples_per_prompt: int
    """Samples per group."""
    seed: int = 0
    """The sim engine's length seed (same lengths as a Dask run of the recipe)."""
    train_gpus: int = 1
    """Simulated training GPUs (the modelled stream-mode training)."""
    max_running: int = 0
    """The sim engine's ``max_running``."""
    tick_s: float = 2.0
    """Simulated seconds between the long-tail policy's looks at the instances."""


def train_end(setup: Setup, result: StepResult) -> float:
    """Modelled end of a stream-mode step: the trainer takes each group when it finishes (its
    tokens at the cost model's training rate), then one optimizer step and the weights' sync."""
    tokens: dict[str, int] = {}
    for s in result.samples:
        tokens[s.group] = tokens.get(s.group, 0) + s.prompt_tokens + s.length
    free = 0.0
    for g, end in sorted(result.group_end_s.items(), key=lambda x: x[1]):
        free = max(free, end) + latency.train_time(setup.profile, tokens[g], setup.train_gpus)
    p = setup.profile
    return free + p.params * 16 / (p.mem_bw * p.bw_eff * setup.train_gpus) + latency.weight_sync_time(p)


def simulate(setup: Setup, variant: Variant, steps: int, warmup: int) -> dict:
    """Run ``warmup + steps`` steps; returns the means over the last ``steps``
    (``generate_makespan_s``, ``step_s``, ``samples_per_s``, recalls, ``moved``) and per-step rows."""
    n, rollout = setup.samples_per_prompt, Rollout(setup.profile, setup.instances, setup.max_running, setup.tick_s)
    step_latency = partial(latency.step_latency, setup.profile)
    policy = LongTailPolicy(variant.policy, step_latency) if variant.policy is not None else None
    observed: list[int] = []
    prompt_tokens = 0.0
    rows = []
    for step in range(warmup + steps):
        prompts = setup.task.prompts(step, setup.prompts_per_step)
        samples = [SampleRecord(p.uid, k, sample_length(p, random.Random(f"{setup.seed}-{p.uid}-{k}")),
                                p.answer["prompt_tokens"]) for p in prompts for k in range(n)]
        by_group = {p.uid: [s for s in samples if s.group == p.uid] for p in prompts}
        scores = variant.ranker.predict(prompts) if variant.ranker is not None else [0.0] * len(prompts)
        if policy is not None:
            priors = prior_from_scores(scores, observed)
            specs = [GroupSpec(p.uid, n, p.answer["prompt_tokens"], prior, bool(observed))
                     for p, prior in zip(prompts, priors)]
            placed = [(by_group[c.group][k], c.instance, c.priority)
                      for c in policy.place(specs, setup.instances) for k in c.samples]
        else:
            workers = [str(i) for i in range(setup.instances)]
            ctx = DispatchContext(n, observed, prompt_tokens, step_latency)
            placed = [(s, int(a.worker), a.priority)
                      for a in variant.scheduler.dispatch(prompts, scores, workers, ctx)
                      for s in by_group[prompts[a.index].uid]]
        result = rollout.run(samples, placed, policy, version=step)
        actual = [sum(math.log(s.length) for s in by_group[p.uid]) / n for p in prompts]
        row = {"step": step, "generate_makespan_s": result.makespan_s, "step_s": train_end(setup, result),
               "moved": result.moved}
        if variant.ranker is not None:
            row["recall_prior"] = top_recall(scores, actual, 0.2)
        if policy is not None:
            firsts = [policy.close(p.uid).first_estimate for p in prompts]
            row["recall_first"] = top_recall([f if f is not None else 0.0 for f in firsts], actual, 0.2)
        rows.append(row)
        lengths = [[s.length for s in by_group[p.uid]] for p in prompts]
        if variant.ranker is not None:
            variant.ranker.observe(prompts, lengths)
        observed = (observed + [s.length for s in samples])[-8192:]
        prompt_tokens = sum(s.prompt_tokens for s in samples) / len(samples)
    window = rows[warmup:] or rows
    out = {k: sum(r[k] for r in window) / len(window) for k in window[0] if k != "step"}
    out["samples_per_s"] = setup.prompts_per_step * n / out["step_s"]
    out["rows"] = rows
    return out
