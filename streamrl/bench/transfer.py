"""``streamrl bench transfer RECIPE``: how long a weight publication takes with each transfer.

For each transfer named (``--transfers dask,...``) it brings up the recipe's cluster, builds the
engines and the trainer, and publishes the trainer's weights ``--repeats`` times exactly as a
run does (export on the train worker, one load per generate worker, ``flow/weights.publish``),
timing each publication from submission until every engine holds the new version. It reports
the model's size, seconds per publication (median) and the rate in GB/s (model bytes / seconds),
next to the machine's memory-copy rate measured on the train worker (a ``clone`` of the same
tensors): the ceiling any transfer on one machine works against.
"""

from __future__ import annotations

import statistics
import time

from rich.console import Console
from rich.table import Table

from streamrl.cluster import lifecycle
from streamrl.run import runner
from streamrl.run.controller import Controller
from streamrl.flow.weights import publish, relay_sites, wait_loaded
from streamrl.recipe.recipe import load_recipe


def memcpy_rate(repeats: int = 5) -> tuple[float, float]:
    """Train worker: ``(bytes, seconds)`` of the fastest clone of the trainer's weights."""
    from streamrl.on_worker.resident import TRAINER, resident

    import torch

    weights = resident(TRAINER).named_weights()
    size = sum(t.numel() * t.element_size() for t in weights.values())
    # (a GPU's copies are queued, not done, when clone returns: the clock waits for them)
    cuda = any(t.is_cuda for t in weights.values())
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    best = float("inf")
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        copies = {n: t.clone() for n, t in weights.items()}
        sync()
        best = min(best, time.perf_counter() - t0)
        del copies
    return size, best


def measure(file: str, overrides: list[str], transfer: str, repeats: int) -> dict:
    """One transfer: model bytes, every publication's seconds, the memcpy rate."""
    loaded = load_recipe(file, [*overrides, f'transfer={{name="{transfer}"}}', "cluster.dashboard=false"])
    resolved = runner.resolve(loaded)
    dask_cluster, client = lifecycle.start(loaded.recipe)
    try:
        ctl = Controller(resolved, client, lifecycle.check_pools(client))
        ctl.place_residents()
        topo = ctl.topology
        size, copy_s = client.submit(memcpy_rate, pure=False, **topo.train_pin).result()
        seconds = []
        for version in range(1, repeats + 2):  # the first is a warm-up (connections, buffers)
            t0 = time.perf_counter()
            wait_loaded(publish(client, None, version, topo.train_pin, topo.generate_pins(),
                                tag=f"-bench-{transfer}", trainer_id=topo.incarnations,
                                sites=relay_sites(resolved.transfer.config, topo.generate)))
            seconds.append(time.perf_counter() - t0)
        return {"transfer": transfer, "model_bytes": size, "generate_workers": len(topo.generate),
                "publish_s": seconds[1:], "memcpy_gb_s": size / copy_s / 1e9}
    finally:
        lifecycle.stop(dask_cluster, client)


def bench(file: str, overrides: list[str], transfers: list[str], repeats: int, out: str | None) -> list[dict]:
    """Measure every transfer one after another; print a table (and write JSON to ``out``)."""
    import json

    rows = [measure(file, overrides, name, repeats) for name in transfers]
    table = Table(title=f"weight publication, {file}")
    for col in ("transfer", "model MB", "generate workers", "s / publication (median)", "GB/s", "memcpy GB/s"):
        table.add_column(col)
    for r in rows:
        median = statistics.median(r["publish_s"])
        r["publish_s_median"] = median
        r["gb_s"] = r["model_bytes"] / median / 1e9
        table.add_row(r["transfer"], f"{r['model_bytes'] / 1e6:.1f}", str(r["generate_workers"]), f"{median:.4f}",
                      f"{r['gb_s']:.3f}", f"{r['memcpy_gb_s']:.2f}")
    Console().print(table)
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=2)
    return rows
