"""The reference loop: one RL step after another in this process, no Dask. Read it first.

It is the algorithm every mode of the controller implements, without the distribution:

    for each step:
        prompts  = task.prompts(step, P)                    # P prompt groups
        groups   = [engine.generate(p, n) for p in prompts]  # n samples each, with logprobs
        rewards  = reward.score(...) for every sample
        repeat algorithm.epochs times:
            trainer.micro_batch(groups[i:j], 1 / (P * n))  # advantages -> loss -> backward
            trainer.step()                                  # one optimizer step per pass
        engine.load_weights(trainer.named_weights())        # the new policy generates next

The controller (``run/controller.py``) runs the same components as Dask tasks on labelled
pools and streams groups into micro-batches as they finish; on the same samples it gives the
same update as :func:`train_step` (``tests/test_flow.py`` checks it). ``streamrl reference
RECIPE`` runs this loop on a recipe.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from streamrl.api import Engine, Group, Trainer
from streamrl.flow.placement import trainer_context
from streamrl.plugins.resolve import Resolved
from streamrl.rewards.scoring import score_group
from streamrl.telemetry.stats import StepStats, TrainTaskStats


def train_step(trainer: Trainer, groups: list[Group], groups_per_micro_batch: int,
               epochs: int = 1) -> tuple[TrainTaskStats, StepStats]:
    """Forward/backward over the groups in micro-batches, then one optimizer step; ``epochs``
    times. Every micro-batch's loss is scaled by 1 / samples, so the cut does not change the
    update. Returns the first pass's sums (the on-policy ones) and the last optimizer step's stats."""
    samples = sum(len(g) for g in groups)
    first = TrainTaskStats()
    for epoch in range(epochs):
        for i in range(0, len(groups), groups_per_micro_batch):
            sums = trainer.micro_batch(groups[i:i + groups_per_micro_batch], 1.0 / samples)
            if epoch == 0:
                first.add(sums)
                first.micro_batches += 1
        stepped = StepStats.of(trainer.step())
    return first, stepped


def generate(engine: Engine, prompts, n: int) -> list[Group]:
    """Every prompt's group; submitted together so the engine batches them."""
    with ThreadPoolExecutor(max_workers=max(1, len(prompts))) as pool:
        return list(pool.map(lambda p: engine.generate(p, n), prompts))


def not_used(resolved: Resolved) -> list[str]:
    """The recipe's parts this loop leaves out (it generates, scores and trains, one step after
    another, in one process), each as the recipe names it."""
    r = resolved.recipe
    out = []
    for section in ("scheduler", "ranker"):
        table = getattr(r, section, None)
        if table is not None:
            out.append(f'{section}.name = "{table.name}"')
    out += [f'[[metrics]] name = "{m.name}"' for m in r.metrics]
    if r.learners:
        out.append(f"[[learners]] ({len(r.learners)})")
    for section in ("serve", "eval"):
        if getattr(r, section, None) is not None:
            out.append(f"[{section}]")
    if r.run.mode != "stream":
        out.append(f'run.mode = "{r.run.mode}" (this loop is on-policy, one step after another)')
    return out


def run(resolved: Resolved, steps: int, log: Callable[[str], None] = print) -> list[dict]:
    """``steps`` steps of the recipe's components in this process; returns one record per step.
    It says first which of the recipe's parts it does not use (:func:`not_used`)."""
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    r = resolved.recipe
    left_out = not_used(resolved)
    if left_out:
        log("the reference loop does not use: " + ", ".join(left_out))
    torch.manual_seed(r.run.seed)
    task, reward = resolved.task.build(), resolved.reward.build()
    engine = resolved.engine.build()
    engine.load(resolved.model_path)
    context = trainer_context(resolved)
    trainer = resolved.trainer.build(context)
    transfer = resolved.transfer.build()
    t = r.trainer
    records = []
    try:
        for step in range(steps):
            t0 = time.time()
            groups = generate(engine, task.prompts(step, t.prompts_per_step), t.samples_per_prompt)
            for g in groups:
                score_group(reward, g, r.reward.score_timeout_s, r.reward.limit)
            stats, _ = train_step(trainer, groups, t.groups_per_micro_batch, context.algorithm.epochs)
            version = step + 1  # one published policy per step, as in the controller
            engine.load_weights(transfer.receive(transfer.send(trainer.named_weights(), version), version), version)
            record = {"step": step, "policy_version": version, "samples": stats.samples,
                      "reward_mean": stats.reward_sum / stats.samples,
                      "loss": stats.loss_sum / stats.samples, "step_s": time.time() - t0}
            records.append(record)
            log(f"step {step + 1:>3}/{steps}  reward {record['reward_mean']:.3f}  loss {record['loss']:+.4f}  "
                f"{record['samples'] / record['step_s']:.1f} samples/s  v{version}")
    finally:
        engine.close()
        for obj in (trainer, reward, task, transfer):
            obj.close()
    return records
