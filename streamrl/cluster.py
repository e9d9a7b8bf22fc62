"""Pools as Dask worker resources: the embedded local cluster, or an existing one.

A pool is a label on workers: a worker of pool ``generate`` offers the resource ``generate``
(one unit per task slot) and is named ``generate-<i>``. Tasks ask for the resource, so the
scheduler sends them only there. The embedded cluster is a ``SpecCluster`` of ``Nanny`` worker
processes bound to ``cluster.host`` (127.0.0.1 by default: nothing listens outside the machine).
For several machines, start ``dask scheduler`` and on each machine
``dask worker tcp://SCHED:8786 --resources "generate=16" --name generate-0 --nthreads 16``,
then set ``cluster.address``.
"""

from __future__ import annotations

import logging
import os
import time

import dask
from distributed import Client, Nanny, Scheduler, SpecCluster, WorkerPlugin

from streamrl.devices import ENV as DEVICE_ENV
from streamrl.errors import UserError
from streamrl.recipe import REQUIRED_POOLS, Recipe

#: Set in the Nanny's process before it spawns a worker (``distributed.nanny.pre-spawn-environ``):
#: glibc reads its malloc settings once, at process start. Dask sets MALLOC_TRIM_THRESHOLD_=65536
#: there (give freed memory back to the OS); setting any malloc threshold also freezes the mmap
#: threshold at 128 KiB, so every activation and gradient above that is a fresh mmap with page
#: faults on each use -- a tiny model's forward/backward ran 2x slower on a worker than in a
#: plain process (0.58 s vs 0.29 s per 512 W1 samples). Big blocks come from the heap again
#: (32 MiB is glibc's ceiling); the trim stays, but above 64 MiB of padding at the top of the
#: heap: with the trim alone, each step's freed activations went back to the OS and came back
#: as page faults (a W1 training step of 512 samples: 0.208 s vs 0.192 s with the padding).
PRE_SPAWN_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 * 1024 * 1024), "MALLOC_TOP_PAD_": str(64 * 1024 * 1024)}

#: Environment every worker gets: quiet libraries, no hub access, no tokenizer thread pools.
WORKER_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}


def gpu_ids(ids: list[str], per_worker: int, i: int) -> list[str]:
    """The GPU ids worker ``i`` gets: ``per_worker`` consecutive ones, wrapping around the list."""
    return [ids[(i * per_worker + k) % len(ids)] for k in range(per_worker)] if ids else []


def worker_spec(recipe: Recipe, log_level: int = logging.WARNING) -> dict:
    """The ``SpecCluster`` worker specification built from the recipe's ``[pools.*]`` tables."""
    spec = {}
    for pool in [*REQUIRED_POOLS, "rank"]:
        cfg = getattr(recipe.pools, pool)
        if cfg is None:  # an optional pool left out
            continue
        for i in range(cfg.workers):
            spec[f"{pool}-{i}"] = pool_worker_spec(recipe, pool, i, log_level)
    return spec


def pool_worker_spec(recipe: Recipe, pool: str, i: int, log_level: int = logging.WARNING,
                     slots: int | None = None) -> dict:
    """The spec of worker ``<pool>-<i>``: a Nanny offering ``slots`` units of the pool's resource
    (default: its threads; 0 for a worker that must not take the pool's tasks yet)."""
    cfg = getattr(recipe.pools, pool)
    env = {**WORKER_ENV, DEVICE_ENV: cfg.device, **cfg.env}
    gpus = gpu_ids(cfg.cuda_visible_devices, cfg.gpus_per_worker, i)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    name = f"{pool}-{i}"
    threads, resources = cfg.threads, {pool: cfg.threads if slots is None else slots}
    if gpus or cfg.device == "cuda":  # tasks that need a GPU can ask Dask for one
        resources["GPU"] = len(gpus) or cfg.gpus_per_worker
    if recipe.run.mode == "colocated" and pool == "train":
        # time-sharing: a train worker is also a generate worker (generation and
        # training alternate, so the slots never compete)
        gen = recipe.pools.generate.threads
        threads, resources = cfg.threads + gen, {"train": cfg.threads, "generate": gen}
    resources[PIN + name] = PIN_SLOTS  # lets a task follow this worker through a restart (pin())
    return {"cls": Nanny, "options": {
        "name": name, "nthreads": threads, "resources": resources,
        "host": recipe.cluster.host, "memory_limit": cfg.memory_limit, "env": env,
        "silence_logs": log_level,
    }}


class QuickExit(WorkerPlugin):
    """After a clean close, end the worker process without the interpreter's slow finalization.

    A worker that imported torch and transformers spends seconds in C-level teardown after its
    last line of Python (measured: >2.5 s under load, past the Nanny's 4 s grace period), so
    the Nanny kills it and warns "Worker process still alive after 4.0 seconds, killing" at the
    end of every run. Once the worker has closed cleanly there is nothing left to finalize: an
    ``atexit`` hook registered last runs first, flushes, and calls ``os._exit(0)``. A worker
    that dies any other way (an error, a kill) exits normally, with its own exit code.
    """

    name = "streamrl-quick-exit"

    def setup(self, worker) -> None:
        import atexit

        self.closed = False
        atexit.register(self._exit)

    def teardown(self, worker) -> None:
        self.closed = True

    def _exit(self) -> None:
        if self.closed:
            import sys

            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


class QuietTaskErrors(WorkerPlugin):
    """A failed task is reported once, by the ``streamrl`` process, in one line or with its
    traceback; the worker's own "Compute Failed" log of the same error (a second traceback in
    the user's terminal) is kept out unless ``--verbose``."""

    name = "streamrl-quiet-task-errors"

    def setup(self, worker) -> None:
        logging.getLogger("distributed.worker").addFilter(_drop_compute_failed)


class QuietShutdown(WorkerPlugin):
    """A worker whose own connections are closing (the run is over, or it failed and is being
    shut down) may have a heartbeat in flight; it fails with "ConnectionPool closing" and the
    worker logs it with a traceback in the user's terminal, under the run's real error. Only
    that record is dropped: a heartbeat failing while the worker runs is still logged."""

    name = "streamrl-quiet-shutdown"

    def setup(self, worker) -> None:
        from distributed.core import Status

        def keep(record: logging.LogRecord) -> bool:
            if not str(record.msg).startswith("Failed to communicate with scheduler during heartbeat"):
                return True
            exc = record.exc_info[1] if record.exc_info else None
            return worker.status == Status.running and "ConnectionPool closing" not in str(exc)

        logging.getLogger("distributed.worker").addFilter(keep)


def _drop_compute_failed(record: logging.LogRecord) -> bool:
    """Logging filter: False for the worker's "Compute Failed" record (the error reaches the
    client anyway); everything else the worker logs stays."""
    return not str(record.msg).startswith("Compute Failed")


def quiet_dask(verbose: bool) -> int:
    """Dask logs at INFO by default; keep the user's terminal for streamrl unless ``--verbose``."""
    level = logging.INFO if verbose else logging.WARNING
    for name in ("distributed", "distributed.scheduler", "distributed.nanny", "distributed.worker",
                 "distributed.core", "distributed.http.proxy", "bokeh"):
        logging.getLogger(name).setLevel(level)
    # bokeh warns that its dashboard allows any Host header; the dashboard binds to
    # cluster.host (loopback by default), so the warning is noise for the user
    logging.getLogger("bokeh.server.util").setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return level


def start(recipe: Recipe, verbose: bool = False) -> tuple[SpecCluster | None, Client]:
    """Connect to ``cluster.address`` or start the embedded cluster; wait for every pool."""
    level = quiet_dask(verbose)
    if recipe.cluster.address:
        try:
            client = Client(recipe.cluster.address, timeout=recipe.cluster.connect_timeout)
        except OSError as exc:
            raise UserError(f"cluster.address: cannot reach scheduler {recipe.cluster.address} ({exc})") from None
        cluster = None
    else:
        host = recipe.cluster.host
        dask.config.set({f"distributed.nanny.pre-spawn-environ.{k}": v for k, v in PRE_SPAWN_ENV.items()})
        cluster = SpecCluster(
            workers=worker_spec(recipe, level),
            scheduler={"cls": Scheduler, "options": {
                "host": host, "dashboard_address": f"{host}:{recipe.cluster.dashboard_port}"}},
            silence_logs=level, name="streamrl",
        )
        client = Client(cluster)
        try:
            client.wait_for_workers(len(cluster.worker_spec), timeout=recipe.cluster.startup_timeout)
        except TimeoutError:
            client.close()
            cluster.close()
            raise UserError(f"cluster.startup_timeout: workers did not start within "
                            f"{recipe.cluster.startup_timeout}s") from None
        client.register_plugin(QuickExit())  # only on workers we started ourselves
        client.register_plugin(QuietShutdown())
        if not verbose:
            client.register_plugin(QuietTaskErrors())
    check_pools(client)
    return cluster, client


def stop(cluster: SpecCluster | None, client: Client, timeout: float = 10.0) -> None:
    """Shut down in order: workers first, then the client and scheduler.

    Closing the scheduler while workers still run makes each worker log a heartbeat traceback
    on its way out; retiring them first keeps the end of a run quiet. An external cluster
    (``cluster.address``) is left running: only our client disconnects.
    """
    if cluster is not None:
        # Results the controller still holds (the last optimizer step) go with their workers;
        # that is the point of stopping, so the scheduler need not warn about it.
        logging.getLogger("distributed.scheduler").setLevel(logging.ERROR)
        try:
            cluster.scale(0)
            deadline = time.monotonic() + timeout
            # Wait for the Nanny processes themselves (SpecCluster drops them once closed), not
            # only for the scheduler to forget them: a worker still closing when the scheduler
            # goes away logs a heartbeat traceback (seen about one run in four before this).
            while (cluster.workers or workers(client)) and time.monotonic() < deadline:
                time.sleep(0.1)
        except Exception:  # shutting down anyway; never hide the run's real error behind this
            pass
    client.close()
    if cluster is not None:
        cluster.close()


#: Resource prefix naming one worker: ``worker:train-0``. Dask turns a worker *name* given in
#: ``workers=`` into the worker's address when the task is submitted, so a task pinned that way
#: waits for ever once a nanny restarts the worker on a new address; a resource comes back with
#: the restarted worker. Plenty of slots, so it never limits how many tasks run.
PIN = "worker:"
PIN_SLOTS = 1_000_000


def workers(client: Client) -> dict[str, dict]:
    """``{address: info}`` of every worker, fetched now. Not ``client.scheduler_info()``: the
    client refreshes that cache every few seconds *without* per-worker details, and a refresh that
    lands between its fetch and its return hands back no workers at all (seen in CI)."""
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]


def pool_workers(client: Client) -> dict[str, dict[str, str]]:
    """``{pool: {worker name: address}}`` from the resources each worker offers."""
    pools: dict[str, dict[str, str]] = {p: {} for p in REQUIRED_POOLS}
    for addr, info in workers(client).items():
        for res in info.get("resources", {}):
            if not res.startswith(PIN):
                pools.setdefault(res, {})[str(info.get("name", addr))] = addr
    return pools


def pins(client: Client) -> dict[str, dict]:
    """``{worker name: submit() keywords that run a task on that worker}``: its ``worker:<name>``
    resource when it offers one (the embedded cluster's workers do), else its name."""
    out = {}
    for addr, info in workers(client).items():
        name = str(info.get("name", addr))
        if PIN + name in info.get("resources", {}):
            out[name] = {"resources": {PIN + name: 1}}
        else:  # an external worker started without it: pinned by name (not restart-proof)
            out[name] = {"workers": [name], "allow_other_workers": False}
    return out


def at(pin: dict, **resources: int) -> dict:
    """``pin`` with more resources required (e.g. ``train=1``)."""
    return {**pin, "resources": {**pin.get("resources", {}), **resources}}


def check_pools(client: Client) -> dict[str, dict[str, str]]:
    """Every pool the run uses must have a worker, or its tasks would wait forever."""
    pools = pool_workers(client)
    for pool, what in REQUIRED_POOLS.items():
        if not pools.get(pool):
            raise UserError(
                f"pools.{pool}: no worker of cluster {client.scheduler.address} offers resource "
                f"{pool!r} (this pool {what}); start one with: dask worker ADDRESS --resources \"{pool}=1\"")
    return pools
