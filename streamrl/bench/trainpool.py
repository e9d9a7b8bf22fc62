"""``streamrl bench trainpool RECIPE``: the train pool on its own -- one worker, several with
``ddp``, several with ``fsdp`` -- on the same synthetic batches.

For each variant it brings up the recipe's cluster (a fresh one, so each worker's peak memory is
its own), places the trainer on every train worker (joined, and sharded for ``fsdp``), and
trains ``--warmup + --steps`` steps of ``--samples`` synthetic samples (``bench trainer``'s)
exactly as a batch-mode run does: train tasks over the ranks, one optimizer step per rank. It
reports seconds per step, tokens/s and the speed-up against the first variant, and per train
worker the bytes of training state it holds (parameters and optimizer state, its shard only)
and its process's peak resident memory. Nothing generates: it measures the train pool.
"""

from __future__ import annotations

import json
import statistics
import time

from rich.console import Console
from rich.table import Table

from streamrl.cluster import lifecycle
from streamrl.bench.engine import parse_variant
from streamrl.bench.trainer import synthetic_groups
from streamrl.flow import submit
from streamrl.run import runner
from streamrl.run.controller import Controller
from streamrl.recipe.recipe import load_recipe

DEFAULT_VARIANTS = ["one:pools.train.workers=1", "ddp:pools.train.workers=2",
                    'fsdp:pools.train.workers=2;trainer.strategy="fsdp"']


def held_state() -> dict:
    """Train worker: bytes of parameters and optimizer state this rank holds (a shard's local
    part only: ``Trainer.footprint``), and the process's peak resident memory so far."""
    import resource

    from streamrl.on_worker.resident import TRAINER, resident

    held = resident(TRAINER).footprint()
    return {"params_bytes": held.params_bytes, "optimizer_bytes": held.optimizer_bytes,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def measure(file: str, overrides: list[str], samples: int, prompt: int, response: int, steps: int,
            warmup: int) -> dict:
    """One variant on a fresh cluster: seconds per step, and each rank's state and peak memory."""
    loaded = load_recipe(file, [*overrides, "cluster.dashboard=false", "run.mode=batch"])
    resolved = runner.resolve(loaded)
    t = loaded.recipe.trainer
    dask_cluster, client = lifecycle.start(loaded.recipe)
    try:
        ctl = Controller(resolved, client, lifecycle.check_pools(client))
        ctl.place_residents()
        topo = ctl.topology
        vocab = client.submit(_vocab, pure=False, **topo.train_pin).result()
        groups = synthetic_groups(samples, t.samples_per_prompt, prompt, response, vocab, loaded.recipe.run.seed)
        n = sum(len(g) for g in groups)
        for s in (s for g in groups for s in g):
            s.times = {"gen_start": 0.0, "gen_end": 0.0, "reward_end": 0.0}  # (train tasks log them)
        bundles = client.scatter([[g] for g in groups])  # as reward tasks hand them over: one bundle each
        seconds = []
        for step in range(warmup + steps):
            t0 = time.perf_counter()
            last, _ = submit.epochs(topo, loaded.recipe, ctl.epochs, step, bundles, False, after=None, samples=n)
            client.gather(last)  # every rank's optimizer step
            if step >= warmup:
                seconds.append(time.perf_counter() - t0)
        ranks = {name: client.submit(held_state, pure=False, **topo.pins[name]).result() for name in topo.train}
        client.cancel(bundles)  # (else stopping the cluster reports the scattered batch lost)
        return {"train_workers": len(topo.train), "strategy": t.strategy, "samples": n,
                "tokens_per_step": n * (prompt + response), "step_s": seconds, "ranks": ranks}
    finally:
        lifecycle.stop(dask_cluster, client)


def _vocab() -> int:
    from streamrl.on_worker.resident import TRAINER, resident

    return resident(TRAINER).footprint().vocab_size or 1000  # (no model: any token ids will do)


def bench(file: str, overrides: list[str], variants: list[str], samples: int, prompt: int, response: int,
          steps: int, warmup: int, out: str | None) -> list[dict]:
    """Measure each variant (``LABEL:KEY=VALUE;...``; default one worker, ddp x2, fsdp x2), print
    a table (speed-ups against the first), optionally write JSON."""
    rows = []
    for label, extra in [parse_variant(v) for v in variants or DEFAULT_VARIANTS]:
        row = measure(file, [*overrides, *extra], samples, prompt, response, steps, warmup)
        row["step_s_median"] = statistics.median(row["step_s"])
        rows.append({"variant": label, **row})
    table = Table(title=f"train pool, {file}: {samples} samples x {prompt}+{response} tokens per step")
    for col in ("variant", "workers", "strategy", "s/step", "tokens/s", "vs first", "state MB per rank",
                "peak RSS MB per rank"):
        table.add_column(col)
    for r in rows:
        state = [(x["params_bytes"] + x["optimizer_bytes"]) / 1e6 for x in r["ranks"].values()]
        rss = [x["peak_rss_bytes"] / 1e6 for x in r["ranks"].values()]
        table.add_row(r["variant"], str(r["train_workers"]), r["strategy"], f"{r['step_s_median']:.3f}",
                      f"{r['tokens_per_step'] / r['step_s_median']:,.0f}",
                      f"{rows[0]['step_s_median'] / r['step_s_median']:.2f}x",
                      " / ".join(f"{x:,.1f}" for x in state), " / ".join(f"{x:,.0f}" for x in rss))
    Console().print(table)
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=2)
    return rows
