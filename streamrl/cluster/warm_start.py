"""Warm worker start: the embedded cluster's workers forked from a process that has already
imported what every worker imports, instead of each spawned as a fresh interpreter.

A worker of a small run spends most of its start importing torch, transformers and Dask, a few
seconds of CPU each, and a run on a laptop starts three or more of them at once; a cluster
restarted for every run (as CI does, and anyone trying recipes) pays it each time. Python's
``forkserver`` start method keeps one server process with those modules loaded and forks a
worker from it in a fraction of a second. The server is started as soon as the recipe is known
(:func:`begin`), so its imports overlap the ``streamrl`` process's own; Dask's Nanny then starts
(and restarts, and adds) every worker through it.

What a forked worker cannot get this way is an environment variable that a library reads when it
is imported or a process starts (OpenMP's thread count, glibc's malloc settings, the Hugging Face
hub's offline switch): the server takes the workers' environment when it starts, so every worker
has the same one. Where a pool sets an ``env`` of its own, or the machine has an NVIDIA GPU (CUDA
must not be initialised before a fork, and torch's import may probe for it), ``auto`` keeps Dask's
``spawn`` (``cluster.worker_start``)."""

from __future__ import annotations

import atexit
import importlib.util
import json
import multiprocessing.forkserver
import os
import signal
import threading
from multiprocessing import resource_tracker
from pathlib import Path

import dask

from streamrl.devices import ENV as DEVICE_ENV
from streamrl.cluster.pool_workers import NICE_ENV, PRE_SPAWN_ENV, STOP_SIGNALS, WORKER_ENV, planned_workers
from streamrl.recipe.recipe import Recipe

#: What every worker imports, loaded once in the server: Dask's own list, then streamrl's worker side.
WORKER_MODULES = ["streamrl.on_worker.task_functions", "streamrl.on_worker.ranker_tasks"]

#: What a worker of a recipe with a real model imports besides: the libraries (most of a worker's
#: start), then the built-in engine's variants and trainer (a plugin's own are imported after the
#: fork; the modules they are registered from import no torch, so they name the real classes).
MODEL_MODULES = ["torch", "transformers", "transformers.modeling_utils", "transformers.generation.utils",
                 "streamrl.engines.continuous", "streamrl.engines.static", "streamrl.engines.slots",
                 "streamrl.engines.seeded", "streamrl.training.trainer"]

#: Loaded last by the server: it ends the server without a slow interpreter teardown (see there).
LAST_MODULE = "streamrl.cluster.warm_server"

#: Worker environment variables that are read at run time (by streamrl, or by CUDA when it starts),
#: so a worker forked from the server gets them right: set after the fork, from the Nanny's spec.
LATE_ENV = {*WORKER_ENV, DEVICE_ENV, NICE_ENV, "CUDA_VISIBLE_DEVICES"}


def wanted(recipe: Recipe) -> bool:
    """Whether this run's workers start warm: only the embedded cluster's (a factory's or an
    existing cluster's workers are started by someone else), as ``cluster.worker_start`` says;
    ``auto`` where no pool's environment needs a fresh process and the machine has no NVIDIA GPU."""
    c = recipe.cluster
    if c.address or c.factory or c.worker_start == "spawn":
        return False
    if c.worker_start == "warm":
        return True
    own_env = any(set(w["env"]) - LATE_ENV for _, w in planned_workers(recipe))
    return not own_env and not has_nvidia_gpu()


def has_nvidia_gpu() -> bool:
    """Whether the NVIDIA driver lists a GPU on this machine (without importing torch)."""
    try:
        return any(Path("/proc/driver/nvidia/gpus").iterdir())
    except OSError:
        return False


def begin(recipe: Recipe) -> bool:
    """Start the fork server for ``recipe``'s workers now, if they start warm (:func:`wanted`),
    and make Dask's Nanny start workers through it; returns whether they do. A second run
    in this process reuses the server when it preloaded what this run's workers import, with
    the same environment; otherwise that server is stopped and another started. Call it from
    the main thread, as early as the recipe is known: the server's imports then overlap this
    process's."""
    c = recipe.cluster
    if c.address or c.factory or not wanted(recipe):
        # (a warm run before this one, in this process, set Dask's start method for the process:
        # a factory's LocalCluster would fork its Nannies from that run's server)
        dask.config.set({"distributed.worker.multiprocessing-method": "spawn"})
        return False  # (workers started by someone else, or cold)
    imports = preload(recipe)  # (what the run's workers import: a moment to list, from the recipe alone)
    from distributed import utils as dask_utils

    dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"})
    # Dask's own first call for the forkserver context (the Nanny's, at each worker's start)
    # imports every package Dask can use here, in this process, to check it is installed before
    # the server preloads it: pandas among them, ~0.4 s of CPU that this process never uses.
    # The server gets the same list (dask_preload: installed, not imported), and this flag
    # tells Dask it is set. (Without pandas and the others in the server, a run started ~10%
    # less CPU but made 4-5% fewer samples a second: docs/benchmarks.md.)
    dask_utils._forkserver_preload_set = True
    ctx = multiprocessing.get_context("forkserver")
    server = multiprocessing.forkserver._forkserver
    env = worker_environment()
    modules = [*dask_preload(), *imports, LAST_MODULE]
    if server._forkserver_pid is not None:
        if set(modules) <= set(_started["modules"]) and env == _started["env"]:
            return True
        # a server started for another run in this process, without what this run's workers
        # import (a simulated engine's run has no torch) or with another environment: each
        # worker would import torch itself, seconds late
        stop_server()
    ctx.set_forkserver_preload(modules)
    _started["env"] = env
    _start_server(server, env)
    # the forkserver context calls this before each worker's fork: a server that died meanwhile
    # is started again there, and must start as this one did
    server.ensure_running = lambda: _ensure_running(server)
    if _started["pid"] is None:
        atexit.register(end_server)
    _started.update(pid=server._forkserver_pid, modules=modules)
    return True


def _start_server(server: multiprocessing.forkserver.ForkServer, env: dict[str, str]) -> None:
    """Start ``server`` (not running) with the workers' environment ``env``."""
    # The server and every worker forked from it start with SIGINT and SIGTERM blocked, as a
    # spawned worker does (run/stopping.py): a worker ends the block once it ignores both
    # (pool_workers.ignore_stop_signals), and the server, whose parent stops it, keeps it. The
    # resource tracker, which the server's start starts, would end the block in this thread.
    resource_tracker.ensure_running()
    saved = {k: os.environ.get(k) for k in env}
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    os.environ.update(env)
    try:
        type(server).ensure_running(server)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


#: One worker start at a time looks at the server (the Nanny's threads start workers).
_server_lock = threading.Lock()


def _ensure_running(server: multiprocessing.forkserver.ForkServer) -> None:
    """Before a worker's fork: the server as :func:`begin` started it. Python's own check starts
    a server that died (killed, or out of memory) again, but with this process's environment
    (the workers' threads, malloc settings and quiet libraries lost for every worker started
    after) and the calling thread's signals: started here with the workers' environment."""
    with _server_lock:
        with server._lock:
            pid = server._forkserver_pid
            try:
                dead = pid is not None and os.waitpid(pid, os.WNOHANG)[0] != 0
            except ChildProcessError:  # (reaped already)
                dead = True
            if dead:  # (what Python's check does with a dead one)
                os.close(server._forkserver_alive_fd)
                server._forkserver_pid = server._forkserver_address = server._forkserver_alive_fd = None
        if server._forkserver_pid is None:
            _start_server(server, _started["env"])
            if dead and _started["pid"] == pid:
                _started["pid"] = server._forkserver_pid


def stop_server() -> None:
    """Stop this process's fork server, if one runs (the next :func:`begin` starts another).
    The workers forked from it go on; a cluster still up would restart one through a new server."""
    server = multiprocessing.forkserver._forkserver
    if server._forkserver_pid is None:
        return
    try:
        server._stop()
    except ChildProcessError:  # (it died, and was reaped, before: nothing to stop)
        server._forkserver_pid = server._forkserver_address = server._forkserver_alive_fd = None


#: The server this process started last: its pid, what it preloaded, the environment it got.
_started: dict = {"pid": None, "modules": [], "env": {}}


def end_server() -> None:
    """At this process's exit, end the server at once. A run that fails before its cluster
    starts (a recipe mistake found while the server imports) would otherwise leave it importing
    torch and transformers for seconds more, on CPU the machine may need, and holding this
    process's output pipes open, so that a script reading them waits that long for the one-line
    error. After a run its workers are gone already: the server only forks them."""
    server = multiprocessing.forkserver._forkserver
    if server._forkserver_pid is None or server._forkserver_pid != _started["pid"]:
        return  # (stopped already, or not ours)
    try:
        os.kill(server._forkserver_pid, signal.SIGKILL)
    except OSError:  # (gone already)
        pass


def dask_preload() -> list[str]:
    """What Dask itself preloads in a fork server: ``distributed`` and every package it can use
    that is installed (found, not imported: see :func:`begin`)."""
    from distributed.versions import optional_packages, required_packages

    return ["distributed", *(p for p in required_packages + optional_packages if importlib.util.find_spec(p))]


def worker_environment() -> dict[str, str]:
    """What the server's environment adds to this process's: what Dask sets before it spawns a
    worker (one OpenMP thread, glibc's malloc settings: read once, when a process starts or
    loads the library) and what every worker gets (quiet libraries, no hub access)."""
    env = {**dask.config.get("distributed.nanny.pre-spawn-environ"), **PRE_SPAWN_ENV,
           **dask.config.get("distributed.nanny.environ"), **WORKER_ENV}
    return {k: str(v) for k, v in env.items()}


def preload(recipe: Recipe) -> list[str]:
    """What the server imports for ``recipe``'s workers: streamrl's worker side, and where the
    recipe has a model (a simulated engine's has none, and its workers never load torch), the
    libraries and the module of the model's architecture (``config.json``'s ``model_type``, when
    the model is a local folder: about a second of a worker's start)."""
    if recipe.model is None or not recipe.model.path:
        return list(WORKER_MODULES)
    modules = [*WORKER_MODULES, *MODEL_MODULES]
    try:
        model_type = json.loads((Path(recipe.model.path) / "config.json").read_text())["model_type"]
    except (OSError, ValueError, KeyError, TypeError):
        return modules
    if str(model_type).isidentifier():
        modules.append(f"transformers.models.{model_type}.modeling_{model_type}")
    return modules
