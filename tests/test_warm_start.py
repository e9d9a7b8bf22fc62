"""Warm worker start (``cluster/warm_start.py``): which runs start their workers from the fork
server, and that a worker forked from it is the worker a spawned one would be -- its libraries
already loaded, the pools' environment, the stop signals ignored, and restarted through the same
server when it dies."""

from __future__ import annotations

import multiprocessing.forkserver
import os
import signal
import sys
import time

import pytest

from streamrl.cluster import lifecycle, warm_start
from streamrl.recipe.recipe import load_recipe
from tests.helpers import ROOT, until


def recipe_with(tiny_recipe, *overrides):
    return load_recipe(tiny_recipe, list(overrides)).recipe


def test_auto_starts_warm_only_the_embedded_clusters_workers_without_an_env_of_their_own(tiny_recipe, monkeypatch):
    monkeypatch.setattr(warm_start, "has_nvidia_gpu", lambda: False)
    assert warm_start.wanted(recipe_with(tiny_recipe))
    # (the pools' usual settings are set after the fork: no reason to spawn)
    assert warm_start.wanted(recipe_with(tiny_recipe, "pools.train.nice=5", "pools.generate.device=cpu"))
    # a variable a library may read when imported: only a fresh process gets it right
    assert not warm_start.wanted(recipe_with(tiny_recipe, 'pools.train.env={OMP_NUM_THREADS="2"}'))
    assert warm_start.wanted(recipe_with(tiny_recipe, 'pools.train.env={OMP_NUM_THREADS="2"}',
                                         "cluster.worker_start=warm"))
    assert not warm_start.wanted(recipe_with(tiny_recipe, "cluster.worker_start=spawn"))
    # workers someone else starts
    assert not warm_start.wanted(recipe_with(tiny_recipe, "cluster.address=tcp://127.0.0.1:8786",
                                             "cluster.worker_start=warm"))
    assert not warm_start.wanted(recipe_with(tiny_recipe, "cluster.factory=distributed.LocalCluster"))
    # a GPU machine: CUDA must not start before a fork
    monkeypatch.setattr(warm_start, "has_nvidia_gpu", lambda: True)
    assert not warm_start.wanted(recipe_with(tiny_recipe))
    assert warm_start.wanted(recipe_with(tiny_recipe, "cluster.worker_start=warm"))


def test_a_factory_run_after_a_warm_one_in_the_process_starts_its_workers_spawned(tiny_recipe):
    # a warm run set Dask's start method for the process; a later factory's LocalCluster forked
    # its Nannies from that run's server, with its environment
    import dask

    with dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"}):
        assert not warm_start.begin(recipe_with(tiny_recipe, "cluster.factory=distributed.LocalCluster"))
        assert dask.config.get("distributed.worker.multiprocessing-method") == "spawn"


def test_a_bad_worker_start_is_one_line(tiny_recipe):
    from streamrl.errors import UserError

    with pytest.raises(UserError, match="cluster.worker_start") as err:
        recipe_with(tiny_recipe, "cluster.worker_start=fork")
    assert "\n" not in str(err.value)


def test_a_run_that_fails_after_the_server_started_ends_it_too(tiny_recipe):
    # the server starts as soon as the recipe is read; a mistake found after that (a component's
    # config) ends the command at once, and the server with it: not seconds later, once torch's
    # import is done, with the command's output pipes held open until then
    import psutil

    from tests.helpers import start, stop

    proc = start("recipe", "run", str(tiny_recipe), "--set", "trainer.lr=-1")  # (its own process group)
    try:
        proc.wait(timeout=120)
        # (the server, not Python's resource tracker: that one ends by itself once it reads that
        # every process that shares it is gone, which may be a moment after the command)
        def servers():
            return [p for p in psutil.process_iter(["status", "cmdline"]) if p.info["status"] != psutil.STATUS_ZOMBIE
                    and _group_of(p.pid) == proc.pid and "multiprocessing.forkserver" in " ".join(p.info["cmdline"] or [])]

        deadline = time.monotonic() + 3.0  # (a kill takes effect within moments; the imports took seconds more)
        while (left := servers()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, [p.info["cmdline"] for p in left]
        _, err = proc.communicate(timeout=10)
        assert proc.returncode == 2 and err.strip().splitlines()[-1].startswith("streamrl: error: trainer.lr"), err
    finally:
        stop(proc)  # (the whole group: what the check found, if it failed)


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def test_the_server_loads_the_libraries_and_the_model_architecture_only_for_a_recipe_with_a_model(tiny_recipe,
                                                                                                 tmp_path):
    modules = warm_start.preload(recipe_with(tiny_recipe))
    assert {"torch", "transformers", "transformers.models.llama.modeling_llama", "streamrl.engines.continuous",
            "streamrl.training.trainer"} <= set(modules)
    assert "transformers.models.llama.modeling_llama" not in warm_start.preload(
        recipe_with(tiny_recipe, f'model.path="{tmp_path}/none"'))
    # a simulated engine's workers never load torch: neither does the server for them
    sim = load_recipe(ROOT / "recipes" / "paper-7b-20k.toml").recipe
    assert sim.model is None and not {"torch", "transformers"} & set(warm_start.preload(sim))


def about_the_worker(dask_worker) -> dict:
    """What a test asks each worker (run there by ``client.run``, which passes the worker)."""
    return {"ppid": os.getppid(), "pid": os.getpid(), "torch": "torch" in sys.modules,
            "omp": os.environ.get("OMP_NUM_THREADS"), "malloc": os.environ.get("MALLOC_TOP_PAD_"),
            "offline": os.environ.get("HF_HUB_OFFLINE"), "device": os.environ.get("STREAMRL_DEVICE"),
            # (read when huggingface_hub is imported: in a warm worker, by its server)
            "hub_offline": sys.modules["huggingface_hub.constants"].HF_HUB_OFFLINE
            if "huggingface_hub.constants" in sys.modules else None,
            "sigint": signal.getsignal(signal.SIGINT) == signal.SIG_IGN,
            "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_IGN,
            "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
            "watchers_ms": watchers_ms(dask_worker)}


def watchers_ms(server) -> dict:
    """How often a Dask server (scheduler, nanny, worker) runs its watchers, in ms."""
    return {name: pc.callback_time for name, pc in server.periodic_callbacks.items()
            if name in ("tick", "monitor", "memory_monitor", "profile")}


_HELD: list[bytearray] = []


def hold_memory(share: float) -> dict:
    """On a worker: hold memory until the process is at ``share`` of its Dask memory limit, let
    Dask's memory monitor look, and say whether the worker still takes tasks."""
    import time

    import psutil
    from distributed import get_worker

    worker = get_worker()
    limit = worker.memory_manager.memory_limit
    need = int(share * limit) - psutil.Process().memory_info().rss
    if need > 0:
        block = bytearray(need)
        block[::4096] = b"x" * len(block[::4096])  # (touched: resident, not just reserved)
        _HELD.append(block)
    time.sleep(1.0)  # (the monitor looks every 100 ms)
    return {"limit": limit, "rss": psutil.Process().memory_info().rss, "status": worker.status.name}


def let_go() -> None:
    _HELD.clear()


@pytest.mark.slow
def test_warm_workers_are_forked_from_the_server_with_the_pools_environment_and_restart_through_it(tiny_recipe):
    recipe = recipe_with(tiny_recipe, "cluster.worker_start=warm", "pools.reward.device=cpu",
                         'pools.reward.memory_limit="1.5GiB"')
    cluster, client = lifecycle.start(recipe)
    try:
        server = multiprocessing.forkserver._forkserver._forkserver_pid
        assert server is not None and server != os.getpid()
        names = {a: w["name"] for a, w in lifecycle.workers(client).items()}
        seen = {names[a]: got for a, got in client.run(about_the_worker).items()}
        assert set(seen) == {"generate-0", "train-0", "reward-0"}
        for name, got in seen.items():
            assert got["ppid"] == server, (name, got)
            # the reward worker never imports torch itself: the server had
            assert got["torch"] and got["omp"] == "1" and got["offline"] == "1", (name, got)
            assert got["malloc"] == lifecycle.PRE_SPAWN_ENV["MALLOC_TOP_PAD_"], (name, got)
            # a Ctrl-C to the process group is the streamrl process's to handle
            assert got["sigint"] and got["sigterm"] and got["blocked"] == [], (name, got)
            # Dask's watchers at streamrl's pace (lifecycle.WATCHERS), not every 20 / 500 / 100 ms,
            # and its profiler every 100 ms, not 10
            assert got["watchers_ms"] == {"tick": 1000, "monitor": 2000, "profile": 100}, (name, got)  # (its nanny watches its memory)
        assert seen["reward-0"]["device"] == "cpu" and seen["train-0"]["device"] == "auto"
        assert watchers_ms(cluster.scheduler) == {"tick": 1000, "monitor": 2000}
        assert all(watchers_ms(nanny) == {"tick": 1000, "monitor": 2000, "memory_monitor": 1000}
                   for nanny in cluster.workers.values())

        # a worker past 80% of its memory limit (a model's, which waiting never frees) goes on
        # taking tasks: Dask would pause it, and the run could neither step nor stop
        reward = next(a for a, n in names.items() if n == "reward-0")
        held = client.submit(hold_memory, 0.85, workers=[reward], pure=False).result(timeout=60)
        assert held["rss"] > 0.8 * held["limit"] and held["status"] == "running", held
        assert client.submit(lambda: 1 + 1, workers=[reward], pure=False).result(timeout=10) == 2
        client.run(let_go, workers=[reward])

        # a worker that dies is restarted by its nanny, forked from the same server
        os.kill(seen["reward-0"]["pid"], signal.SIGKILL)

        def restarted():
            now = {w["name"]: a for a, w in lifecycle.workers(client).items()}
            return now.get("reward-0") if now.get("reward-0") and now["reward-0"] not in names else None

        address = until(restarted, within=60, every=0.1)
        again = client.run(about_the_worker, workers=[address])[address]
        assert again["ppid"] == server and again["pid"] != seen["reward-0"]["pid"] and again["sigint"]

        # a server that dies (killed, out of memory) is started again for the next worker, as
        # the first was: with the workers' environment, not this process's (where the hub is
        # not offline: what the server's imports read then is what every worker has)
        assert seen["reward-0"]["hub_offline"] is True and "HF_HUB_OFFLINE" not in os.environ
        os.kill(server, signal.SIGKILL)
        os.kill(again["pid"], signal.SIGKILL)

        def restarted_again():
            now = {w["name"]: a for a, w in lifecycle.workers(client).items()}
            return now.get("reward-0") if now.get("reward-0") not in (None, address) else None

        address = until(restarted_again, within=60, every=0.1)
        third = client.run(about_the_worker, workers=[address])[address]
        new_server = multiprocessing.forkserver._forkserver._forkserver_pid
        assert new_server not in (None, server) and third["ppid"] == new_server, (third, server, new_server)
        assert third["omp"] == "1" and third["offline"] == "1" and third["hub_offline"] is True, third
        assert third["malloc"] == lifecycle.PRE_SPAWN_ENV["MALLOC_TOP_PAD_"], third
        assert third["sigint"] and third["sigterm"] and third["blocked"] == [], third
    finally:
        lifecycle.stop(cluster, client)


@pytest.mark.slow
def test_spawned_workers_are_children_of_their_nanny(tiny_recipe):
    cluster, client = lifecycle.start(recipe_with(tiny_recipe, "cluster.worker_start=spawn"))
    try:
        seen = client.run(about_the_worker)
        assert len(seen) == 3
        for got in seen.values():
            assert got["ppid"] == os.getpid() and got["sigint"] and got["blocked"] == [], got
    finally:
        lifecycle.stop(cluster, client)


@pytest.mark.slow
def test_a_second_run_in_a_process_gets_a_server_with_what_its_workers_import(tiny_recipe):
    # a simulated engine's run preloads no torch; a later run with a real model in the same
    # process (a notebook, a script running both) must not fork its workers from that server
    simulated = load_recipe(ROOT / "recipes" / "paper-7b-20k.toml", []).recipe
    server = multiprocessing.forkserver._forkserver
    warm_start.stop_server()  # (one an earlier test in this process started)
    assert server._forkserver_pid is None
    assert warm_start.begin(simulated)
    first = server._forkserver_pid
    assert "torch" not in warm_start._started["modules"]
    model = recipe_with(tiny_recipe, "cluster.worker_start=warm")
    assert warm_start.begin(model)
    second = server._forkserver_pid
    assert second != first and "torch" in warm_start._started["modules"]
    assert not os.path.exists(f"/proc/{first}")  # stopped and reaped
    assert warm_start.begin(model) and warm_start.begin(simulated)  # what it has: reused
    assert server._forkserver_pid == second
