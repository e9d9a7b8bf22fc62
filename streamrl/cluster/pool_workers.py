"""What makes a worker one of a pool's, whatever starts it (the embedded cluster, a factory, a
job script): its name, threads, resources, environment, and the pin resource that lets a task
follow it through a restart. ``lifecycle.py`` and ``factories.py`` both build on this."""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import TYPE_CHECKING

from distributed import Nanny, Worker

from streamrl.cluster import quiet
from streamrl.devices import ENV as DEVICE_ENV
from streamrl.recipe.learners import LearnerConfig, main_learner
from streamrl.recipe.pools import REQUIRED_POOLS
from streamrl.recipe.recipe import Recipe

if TYPE_CHECKING:
    from distributed import Client

#: Resource prefix naming one worker: ``worker:train-0``. Dask turns a worker *name* given in
#: ``workers=`` into the worker's address when the task is submitted, so a task pinned that way
#: waits for ever once a nanny restarts the worker on a new address; a resource comes back with
#: the restarted worker. Plenty of slots, so it never limits how many tasks run.
PIN = "worker:"
PIN_SLOTS = 1_000_000


#: Set in the Nanny's process before it spawns a worker (``distributed.nanny.pre-spawn-environ``):
#: glibc reads its malloc settings once, at process start. Dask sets MALLOC_TRIM_THRESHOLD_=65536
#: there (give freed memory back to the OS); setting any malloc threshold also freezes the mmap
#: threshold at 128 KiB, so every activation and gradient above that is a fresh mmap with page
#: faults on each use -- a tiny model's forward/backward ran twice as slow on a worker as in a
#: plain process. Big blocks come from the heap again (32 MiB is glibc's ceiling); the trim
#: stays, but above 64 MiB of padding at the top of the heap: with the trim alone, each step's
#: freed activations went back to the OS and came back as page faults (docs/benchmarks.md).
PRE_SPAWN_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 * 1024 * 1024), "MALLOC_TOP_PAD_": str(64 * 1024 * 1024)}

#: Dask's memory management, off for the workers streamrl starts (only termination near the
#: limit stays, a restart the run handles as any lost worker). It spills and pauses for the data a
#: worker holds for Dask; a streamrl worker's memory is its model, optimizer and activations,
#: which neither spilling nor waiting frees (glibc keeps much of it as "unmanaged"). A paused
#: worker runs no task until its memory falls: two LoRA learners of a 135M model on one 2-core
#: machine's worker reached 80% of Dask's share and the run could neither step nor stop.
WORKER_MEMORY = {"distributed.worker.memory.target": False, "distributed.worker.memory.spill": False,
                 "distributed.worker.memory.pause": False}

#: Dask's watchers in the clusters streamrl starts, at rates for a few long tasks: every process
#: times its event loop (Dask: every 20 ms) and reads its CPU, memory, disk and network figures
#: (every 500 ms), and every nanny its worker's memory (every 100 ms), rates made for many short
#: tasks and a dashboard watched live. Idle, a scheduler, a nanny and a worker spent about a
#: third less CPU at these (docs/benchmarks.md), and a run's processes idle much of the time:
#: waiting on a step, on traffic to serve, on a learner. A loop blocked for
#: ``distributed.admin.tick.limit`` (3 s) is still reported. Dask's worker profiler samples the
#: stack of every thread running a task every 100 ms, not every 10 ms: a generate worker's tasks
#: all wait on its engine, whose decode loop needs the GIL between its kernels, and at 10 ms the
#: sampling of 32 waiting tasks took a quarter of the engine's tokens/s (docs/benchmarks.md); the
#: dashboard's Profile page still fills. Defaults only: what a user set in Dask's config (a YAML
#: file, ``DASK_*`` variables) stays.
WATCHERS = {"distributed": {"admin": {"tick": {"interval": "1s"}, "system-monitor": {"interval": "2s"}},
                            "worker": {"memory": {"monitor-interval": "1s"}, "profile": {"interval": "100ms"}}}}


def dask_environment(config: dict, prefix: str = "DASK_") -> dict[str, str]:
    """Dask config (nested, as :data:`WATCHERS`) as the ``DASK_A__B__C`` variables Dask reads
    at import: what a cluster started by hand needs in its environment for the same setting."""
    out = {}
    for key, value in config.items():
        name = prefix + key.upper().replace("-", "_")
        out.update(dask_environment(value, name + "__") if isinstance(value, dict) else {name: str(value)})
    return out


#: Environment every worker gets: quiet libraries, no hub access, no tokenizer thread pools.
WORKER_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}


# (at import: every worker process of a pool imports this module, as the cluster's process does;
# a scratch folder another process removed first is no error to show the user, least of all
# below "streamrl: interrupted")
logging.getLogger("distributed.diskutils").addFilter(quiet.drop_vanished_scratch)


class PoolWorker(Worker):
    """The embedded cluster's worker: a Dask ``Worker`` that ignores SIGINT and SIGTERM.

    Its process is in the ``streamrl`` process's process group, so a signal sent to the group
    (Ctrl-C, ``kill -- -PGID``, systemd or Slurm stopping the run) reaches it too; dying of it
    would lose the step's work and the trainer's state, and its nanny would restart it in the
    middle of the stop. The ``streamrl`` process handles the signal and closes the workers in
    order (``run/stopping.py``). Set here, when the worker is built, because a worker that a
    nanny restarts (or the elastic pool adds) is spawned while the ``streamrl`` process has its
    own handler installed, which a new process does not inherit."""

    def __init__(self, *args, **kwargs):
        ignore_stop_signals()
        nice = int(os.environ.get(NICE_ENV, "0") or 0)
        if nice:
            lower_priority(nice)
        super().__init__(*args, **kwargs)


#: The signals that stop a run (``run/stopping.py``), which the ``streamrl`` process handles.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def ignore_stop_signals() -> None:
    """Ignore SIGINT and SIGTERM in this process (a worker process of the embedded cluster: the
    ``streamrl`` process stops it). Does nothing off the main thread, where Python cannot set
    signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    # (started while the ``streamrl`` process held them blocked: a pending one is dropped now,
    # and this process's own children start unblocked)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


#: Set by :func:`pool_worker` (a pool's ``nice``) and :func:`learner_worker`: how much to lower
#: the worker process's CPU priority.
NICE_ENV = "STREAMRL_NICE"


def lower_priority(by: int) -> None:
    """Lower this process's CPU priority (``nice``) by ``by``. On Linux a priority belongs to each
    thread and a new thread takes its creator's, so every thread there now is lowered: the
    threads started later (task threads, torch's) inherit it."""
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: the priority is the process's
        threads = [0]
    for tid in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
        except OSError:  # (a thread that has just ended)
            pass


def gpu_ids(ids: list[str], per_worker: int, i: int) -> list[str]:
    """The GPU ids worker ``i`` gets: ``per_worker`` consecutive ones, wrapping around the list."""
    return [ids[(i * per_worker + k) % len(ids)] for k in range(per_worker)] if ids else []


def pool_worker_names(recipe: Recipe) -> list[tuple[str, int]]:
    """``(pool, i)`` of every worker the recipe's ``[pools.*]`` tables ask for, pool by pool."""
    out = []
    for pool in [*REQUIRED_POOLS, "rank", "agent"]:
        cfg = getattr(recipe.pools, pool)
        if cfg is not None:  # (an optional pool left out)
            out += [(pool, i) for i in range(cfg.workers)]
    return out


def side_learner_names(recipe: Recipe) -> list[str]:
    """The workers the side learners train on, by the name after ``learner-``: every
    ``[[learners]]`` table but the main learner's (which trains on the train pool) has one of its
    own, ``learner-<name>``, or shares ``learner-<worker>`` with the others naming that ``worker``."""
    if not recipe.learners or recipe.pools.train is None:
        return []
    main = main_learner(recipe.learners, recipe.run.serve)
    return list(dict.fromkeys(lr.worker or lr.name for lr in recipe.learners if lr.name != main))


def planned_workers(recipe: Recipe) -> list[tuple[str, dict]]:
    """Every worker the recipe asks for, whatever starts it (the embedded cluster, a factory):
    ``(pool, worker)`` with ``worker`` as :func:`pool_worker` describes it and ``pool`` the
    ``[pools.*]`` table whose settings it takes -- the pools' workers pool by pool, then one per
    side learner (:func:`learner_worker`, with the train pool's)."""
    return ([(pool, pool_worker(recipe, pool, i)) for pool, i in pool_worker_names(recipe)]
            + [("train", learner_worker(recipe, name)) for name in side_learner_names(recipe)])


def worker_spec(recipe: Recipe, log_level: int = logging.WARNING) -> dict:
    """The embedded cluster's ``SpecCluster`` worker specification: a Nanny per
    :func:`planned_workers`."""
    return {w["name"]: nanny_spec(recipe, pool, w, log_level) for pool, w in planned_workers(recipe)}


#: The resource of a learner's own worker: not ``train``, so no task of the train pool lands there.
LEARN = "learn"


def learner_worker(recipe: Recipe, learner: str) -> dict:
    """The worker ``learner-<learner>`` (a learner's own, or the one learners naming ``worker =
    <learner>`` share), as :func:`pool_worker` describes one: a train pool worker (its threads,
    device and environment) offering ``learn`` instead of ``train``, its CPU priority lowered by
    its (first) learner's ``nice``."""
    w = pool_worker(recipe, "train", 0)
    name = f"learner-{learner}"
    table = next((lr for lr in recipe.learners if (lr.worker or lr.name) == learner), None)  # (none: added while running)
    nice = table.nice if table else LearnerConfig.model_fields["nice"].default
    w["env"] = {**w["env"], NICE_ENV: str(nice)}
    w.update(name=name, nthreads=recipe.pools.train.threads,
             resources={LEARN: recipe.pools.train.threads, PIN + name: PIN_SLOTS})
    return w


def learner_worker_spec(recipe: Recipe, learner: str, log_level: int = logging.WARNING) -> dict:
    """The embedded cluster's spec of learner ``learner``'s worker (:func:`learner_worker`)."""
    return nanny_spec(recipe, "train", learner_worker(recipe, learner), log_level)


def pool_worker(recipe: Recipe, pool: str, i: int, slots: int | None = None, gpu_slot: int | None = None) -> dict:
    """What makes worker ``<pool>-<i>`` one of its pool, whatever starts it: ``name``,
    ``nthreads``, ``resources`` (``slots`` units of the pool's resource, default its threads; 0
    for a worker that must not take the pool's tasks yet) and ``env`` (the pool's settings, and
    its GPUs when ``cuda_visible_devices`` lists some: those of ``gpu_slot``, default ``i`` -- a
    worker added after others left takes a free one, not the one its name's number wraps to)."""
    cfg = getattr(recipe.pools, pool)
    env = {**WORKER_ENV, DEVICE_ENV: cfg.device, **cfg.env}
    if cfg.nice:
        env[NICE_ENV] = str(cfg.nice)
    gpus = gpu_ids(cfg.cuda_visible_devices, cfg.gpus_per_worker, i if gpu_slot is None else gpu_slot)
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
    return {"name": name, "nthreads": threads, "resources": resources, "env": env}


def memory_limit(recipe: Recipe, pool: str) -> str | int:
    """The Nanny's host memory limit for a worker of ``pool``: the pool's ``memory_limit``, but
    ``auto`` on a GPU pool means the machine's memory over all the cluster's workers rather than
    Dask's share by threads -- a one-thread GPU trainer gets 1/16 of a 16-core machine that way,
    less than CUDA's libraries and a 0.5B model's load need on the host, and is restarted."""
    cfg = getattr(recipe.pools, pool)
    if cfg.memory_limit != "auto" or not (cfg.device == "cuda" or cfg.cuda_visible_devices):
        return cfg.memory_limit
    import psutil

    pools = [getattr(recipe.pools, p) for p in ("generate", "train", "reward", "rank", "agent")]
    workers = sum(p.workers for p in pools if p is not None) + len(recipe.learners)
    return psutil.virtual_memory().total // max(1, workers)


def pool_worker_spec(recipe: Recipe, pool: str, i: int, log_level: int = logging.WARNING,
                     slots: int | None = None, gpu_slot: int | None = None) -> dict:
    """The embedded cluster's spec of worker ``<pool>-<i>`` (:func:`pool_worker`)."""
    return nanny_spec(recipe, pool, pool_worker(recipe, pool, i, slots, gpu_slot), log_level)


def nanny_spec(recipe: Recipe, pool: str, w: dict, log_level: int = logging.WARNING) -> dict:
    """The embedded cluster's spec of worker ``w`` (:func:`pool_worker`'s) of ``pool``: a Nanny
    bound to ``cluster.host``, with the pool's memory limit."""
    return {"cls": Nanny, "options": {
        **w, "host": recipe.cluster.host, "memory_limit": memory_limit(recipe, pool),
        "silence_logs": log_level, "worker_class": PoolWorker,
    }}


def workers(client: "Client") -> dict[str, dict]:
    """``{address: info}`` of every worker of ``client``'s cluster, fetched now. Not
    ``client.scheduler_info()``: the client refreshes that cache every few seconds *without*
    per-worker details, and a refresh that lands between its fetch and its return hands back no
    workers at all (seen in CI)."""
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]


def addresses(client: "Client") -> dict[str, str]:
    """``{worker name: address}`` of every worker up now (:func:`workers`): a worker back at
    another address was restarted; one missing is down."""
    return {str(info.get("name")): addr for addr, info in workers(client).items()}
