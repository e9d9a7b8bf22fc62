"""Shared fixtures: a tiny model made on the fly, recipes that use it, real local clusters.

(The helpers the test modules share are in ``tests/helpers.py``.)"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests import in_process
from tests.helpers import close_cluster, hand_started_cluster, sets, watch_listeners, write_tiny_recipe

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# Tests stop runs with Ctrl-C (SIGINT), in this process and in the commands they start. A shell
# without job control starts a background command (`pytest ... &`, a CI script run that way) with
# SIGINT ignored, which Python then leaves ignored and every process started from here inherits:
# each such stop would be lost and its test wait until its timeout. Ctrl-C is what a user's
# terminal has, so that is what the tests get.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def smoke_tests_start_the_real_command(request):
    """A smoke test starts ``streamrl`` as a user does, in a process of its own; the other tests
    run it in the test's process where they can (tests/in_process.py)."""
    in_process.fresh_only = request.node.get_closest_marker("smoke") is not None


@pytest.fixture(scope="session", autouse=True)
def temporary_files_in_pytests_folder(tmp_path_factory):
    """What this process puts in the system's temporary folder (a bench's run folders, which it
    keeps for the user to read) goes under pytest's own folder, which pytest prunes, so the
    tests do not leave their runs in /tmp."""
    import tempfile

    saved = tempfile.tempdir
    tempfile.tempdir = str(tmp_path_factory.mktemp("tmp"))
    yield
    tempfile.tempdir = saved


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """An untrained tiny addition model + tokenizer saved with save_pretrained."""
    from streamrl.run.model_init import init_model

    out = tmp_path_factory.mktemp("models") / "tiny"
    init_model("addition", str(out), warmstart_steps=0, seed=0)
    return out


@pytest.fixture(scope="session")
def qwen_model(tmp_path_factory) -> Path:
    """A small random Qwen2 (biases on q, k, v; grouped-query attention; tied head) in float32:
    the slot decoder's other architecture."""
    from streamrl.tasks.arch import random_model

    out = tmp_path_factory.mktemp("models") / "qwen-small"
    random_model("qwen2.5-0.5b", str(out), dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                                num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
                 dtype="float32")
    return out


@pytest.fixture
def tiny_recipe(tmp_path, tiny_model) -> Path:
    """A small valid recipe file pointing at ``tiny_model`` (its runs go to ``tmp_path / "runs"``)."""
    return write_tiny_recipe(tmp_path, tiny_model)


@pytest.fixture
def scheduler_only():
    """A real scheduler with its dashboard on a free port of 127.0.0.1, as cluster/lifecycle.py starts it
    (no workers: the page needs none), and a client of it."""
    from distributed import Client, Scheduler, SpecCluster

    cluster = SpecCluster(workers={}, scheduler={"cls": Scheduler, "options": {
        "host": "127.0.0.1", "dashboard_address": "127.0.0.1:0"}}, name="streamrl-test")
    client = Client(cluster)
    yield client
    close_cluster(client, cluster)


@pytest.fixture(scope="session")
def shared_cluster(tmp_path_factory):
    """One cluster started by hand (``dask scheduler`` and a worker per pool of ``TINY_RECIPE``)
    that tests run small recipes on, with ``*shared_cluster.sets``, one run at a time (one per
    pytest-xdist process). It saves each such run the start and stop of a cluster of its own,
    most of a small run's CPU. A run leaves nothing of itself on a cluster it did not start
    (tests/test_cluster_cli.py checks that), so runs on it do not see each other. Not for a test
    that kills a worker, needs other pools, or is about the embedded cluster's start and stop."""
    with hand_started_cluster(tmp_path_factory.mktemp("shared-cluster")) as cluster:
        yield cluster


# -- runs that several test modules read ------------------------------------------------------------
@pytest.fixture(scope="session")
def torch_distributed_run(tiny_model, tmp_path_factory) -> dict:
    """A 3-step run publishing through the torch_distributed transfer, with two train workers and
    two generate workers, its process tree's listening sockets watched all along (every 50 ms):
    ``{"proc": the finished command, "dir": its run folder, "listeners": {(pid, address, port)}}``.
    tests/test_security.py checks where it listened, tests/test_transfer.py what it trained."""
    folder = tmp_path_factory.mktemp("torch-distributed")
    recipe = write_tiny_recipe(folder, tiny_model)
    proc, seen = watch_listeners(["recipe", "run", str(recipe), *sets(
        "pools.train.workers=2", "pools.generate.workers=2", 'transfer={name="torch_distributed", timeout_s=60}',
        "run.steps=3"), "--plain", "--no-report"])
    runs = list((folder / "runs").iterdir()) if (folder / "runs").exists() else []
    return {"proc": proc, "dir": runs[0] if len(runs) == 1 else None, "listeners": seen}
