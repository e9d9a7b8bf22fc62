"""Variants of one recipe, run one after another and compared: what ``streamrl bench`` (modes,
skew, elastic) and ``streamrl plan`` (its ``--check``, warm-up and calibration runs) share.

A variant is the recipe with extra ``--set`` overrides; each runs as a full run in this process,
and :func:`summarize_run` makes its ``metrics.jsonl`` one row of a comparison. A recipe's devices
and costs are counted here once, as the planner counts them: the ``sim`` trainer's virtual GPUs
are its train devices.

Variants that would start the same embedded cluster (the same workers, the same ``[cluster]``
settings: variants of a scheduler, a ranker, a mode) run on one, started once
(:func:`one_cluster`) and attached to with ``cluster.address`` as a run on a cluster users
already have is: a run leaves nothing of itself on such a cluster, so each variant starts from
what the next one does, and the comparison no longer waits on a cluster's start and stop per
variant. A variant that needs a cluster of its own (an elastic pool grows the cluster it
started; other pools or worker settings) still starts one.
"""

from __future__ import annotations

import io
import json
import logging
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from rich.console import Console
from rich.markup import escape

from streamrl.recipe.recipe import Recipe, load_recipe
from streamrl.run import runner
from streamrl.sim.capabilities import SimEngineCapabilities, SimTrainerCapabilities


def describe(file: str, overrides: list[str]):
    """The recipe as given, validated once: ``(resolved, time_scale)``; ``time_scale`` (real
    seconds per simulated second) is None for a real engine."""
    resolved = runner.resolve(load_recipe(file, overrides))
    engine = resolved.engine.capabilities()
    return resolved, engine.time_scale if isinstance(engine, SimEngineCapabilities) else None


def recipe_split(resolved) -> tuple[int, int]:
    """``(generate devices, train devices)`` of the recipe as written."""
    trainer = resolved.trainer.capabilities()  # the sim trainer's devices are virtual
    train = trainer.gpus if isinstance(trainer, SimTrainerCapabilities) else resolved.recipe.pools.train.workers
    return resolved.recipe.pools.generate.workers, train


def costs(resolved) -> tuple[float, float]:
    """Relative cost per device of the generate and the train pool."""
    p = resolved.recipe.pools
    return p.generate.cost_per_device, p.train.cost_per_device


def summarize_run(records: list[dict], warmup: int, time_scale: float | None,
                  device_costs: tuple[float, float, int] | None = None, colocated: bool = False) -> dict:
    """One row of the comparison from a run's ``metrics.jsonl`` records. ``device_costs``: the
    variant's cost per generate and per train device and its train devices, for
    ``samples_per_cost_hour`` (samples per hour of devices costing 1 each; simulated recipes:
    per simulated hour). ``colocated``: generation and training share the train devices, each
    counted once (generate instances beyond them on devices of their own)."""
    rs = records[warmup:] or records
    window = sum(r["accounting_window_s"] for r in rs)
    samples = sum(r["samples"] for r in rs)
    row = {
        "steps": len(rs),
        "samples": samples,
        "wall_s": round(window, 3),
        "samples_per_s": samples / window,
        "reward_mean": sum(r["reward_mean"] * r["samples"] for r in rs) / samples,
        "staleness_max": max(r["staleness_max"] for r in rs),
        "idle": {},
    }
    for pool in rs[0]["pools"]:
        busy = sum(r["pools"][pool]["busy_s"] for r in rs)
        cap = busy + sum(r["pools"][pool]["idle_s"] for r in rs)
        row["idle"][pool] = 1.0 - busy / cap if cap else 0.0
    makespans = [r["generate_makespan_s"] for r in rs if "generate_makespan_s" in r]
    if makespans:  # submission of a step's first group to its last sample generated
        row["generate_makespan_s"] = sum(makespans) / len(makespans)
    for key in ("ranker_recall", "first_sample_recall", "moves/moved"):
        values = [r[key] for r in rs if key in r]
        if values:  # per step
            row[key] = sum(values) / len(values)
    if time_scale:  # report simulated throughput in simulated seconds too
        row["sim_samples_per_s"] = row["samples_per_s"] * time_scale
    # what the weights' publication costs the step (an elastic pool's size moves step by step)
    row["weight_sync_share"] = sum(r.get("weight_sync_s", 0.0) for r in rs) / window if window else 0.0
    if device_costs is not None:
        gen_cost, train_cost, train_devices = device_costs
        if colocated:  # (generate instances beyond the train devices: generate devices of their own)
            cost_s = sum((max(r["generate_workers"] - train_devices, 0) * gen_cost + train_devices * train_cost)
                         * r["accounting_window_s"] for r in rs)
        else:
            cost_s = sum((r["generate_workers"] * gen_cost + train_devices * train_cost) * r["accounting_window_s"]
                         for r in rs)
        row["samples_per_cost_hour"] = samples * (time_scale or 1.0) / cost_s * 3600 if cost_s else 0.0
    return row


def run_variants(file: str, overrides: list[str], variants: dict[str, list[str]], steps: int, warmup: int,
                 console: Console, label: str, time_scale: float | None) -> dict:
    """Run the recipe once per variant (its extra ``--set`` overrides), in the order given;
    returns ``{variant: row}``. ``time_scale`` (from :func:`describe`) is None for a real engine.
    The largest set of variants that would start the same embedded cluster runs on one."""
    simulated = time_scale is not None
    tmp = tempfile.mkdtemp(prefix="streamrl-bench-")
    planned = {}
    for name, extra in variants.items():
        loaded = load_recipe(file, list(overrides) + list(extra))
        # Async keeps generating up to max_staleness steps ahead; in the run's last steps there is
        # nothing left to generate, so the generate pool idles by construction. Run that many
        # extra steps and leave them out: every mode is measured over `steps` steady-state steps.
        r = loaded.recipe.run
        drain = r.max_staleness if r.mode == "async" else 0
        extra = list(extra) + [f"run.steps={steps + warmup + drain}", "cluster.dashboard=false",
                               f'run.out_dir="{tmp}"', f'run.name="bench-{name}"']
        planned[name] = (load_recipe(file, list(overrides) + extra), extra, drain)
    sharing = shared_layout({name: loaded.recipe for name, (loaded, _, _) in planned.items()})
    last_shared = max(sharing, key=list(planned).index, default=None)
    rows = {}
    with ExitStack() as held:
        address = None
        for name, (loaded, extra, drain) in planned.items():
            if name in sharing:
                if address is None:  # (started for the first variant on it, stopped after the last)
                    address = held.enter_context(one_cluster(loaded.recipe))
                loaded = load_recipe(file, list(overrides) + extra + [f'cluster.address="{address}"'])
            resolved = runner.resolve(loaded)  # a variant's own mistakes are one line too
            # (escaped: rich would take "[simulated]" for markup and print nothing of it)
            console.print(escape(f"bench {label}: {name} ({steps} steps + {warmup} warm-up)"
                                 f"{' [simulated]' if simulated else ''}{' [shared cluster]' if name in sharing else ''}"))
            t0 = time.time()
            # (no report per variant: `streamrl report` on the run folders overlays them)
            run_dir = runner.run(loaded, console=Console(file=io.StringIO()), resolved=resolved, report=False)
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            rows[name] = summarize_run(records[:warmup + steps], warmup, time_scale,
                                        (*costs(resolved), recipe_split(resolved)[1]),
                                        colocated=loaded.recipe.run.mode == "colocated")
            rows[name]["drain_steps"] = drain
            rows[name]["run_dir"] = str(run_dir)
            rows[name]["shared_cluster"] = name in sharing
            rows[name]["total_s"] = round(time.time() - t0, 1)
            if name == last_shared:
                held.close()  # the shared cluster's last variant: stop it before the others run
    return rows


def shared_layout(recipes: dict[str, Recipe]) -> set[str]:
    """The variants that run on one cluster: the largest set (at least two; the first such set
    on a tie) that would start the same embedded cluster -- the same workers with the same
    settings, the same ``[cluster]`` table. A recipe on a cluster of its own choosing
    (``cluster.address``, ``cluster.factory``), with an elastic generate pool, or with a model
    on a GPU is in none: a GPU engine's memory is not certain to come back within the worker
    process that held it (vLLM's, for one), so each such variant keeps fresh workers."""
    from streamrl.cluster.pool_workers import planned_workers  # (Dask's worker: only where a bench runs)

    groups: dict[str, list[str]] = {}
    for name, recipe in recipes.items():
        c = recipe.cluster
        gen = recipe.pools.generate
        if c.address or c.factory or (gen is not None and gen.elastic is not None) or on_a_gpu(recipe):
            continue
        key = json.dumps([c.model_dump(mode="json"), planned_workers(recipe)], sort_keys=True, default=str)
        groups.setdefault(key, []).append(name)
    best = max(groups.values(), key=len, default=[])  # (max keeps the first of equal lengths)
    return set(best) if len(best) >= 2 else set()


def on_a_gpu(recipe: Recipe) -> bool:
    """Whether a worker of the recipe may hold a model on a GPU: the recipe has a model (the
    simulated engine has none), this machine has an NVIDIA GPU and some pool's device is not
    ``cpu``."""
    from streamrl.cluster.pool_workers import planned_workers
    from streamrl.cluster.warm_start import has_nvidia_gpu
    from streamrl.devices import ENV as DEVICE_ENV

    if recipe.model is None or not recipe.model.path or not has_nvidia_gpu():
        return False
    return any(w["env"].get(DEVICE_ENV) != "cpu" for _, w in planned_workers(recipe))


@contextmanager
def one_cluster(recipe: Recipe) -> Iterator[str]:
    """The recipe's embedded cluster, started once for several runs that attach to it with
    ``cluster.address``; yields the scheduler's address and stops the cluster at the end."""
    from streamrl.cluster import lifecycle  # (Dask's cluster classes: only where one starts)

    cluster, client = lifecycle.start(recipe)
    # The scheduler lives in this process: each run's check that no other run holds the cluster
    # (a variable read that times out when none does) would log an error here, not in a log of
    # the scheduler's own as on a cluster users start themselves.
    noise = _NoUnclaimedClusterNoise()
    logging.getLogger("distributed.core").addFilter(noise)
    try:
        yield cluster.scheduler_address
    finally:
        logging.getLogger("distributed.core").removeFilter(noise)
        lifecycle.stop(cluster, client)


class _NoUnclaimedClusterNoise(logging.Filter):
    """Drops the scheduler's log of a variable read that timed out (how a run sees that no
    other run holds the cluster)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "variable_get" not in record.getMessage()
