"""Shared fixtures: a tiny model made on the fly, recipes that use it, real local clusters.

(The helpers the test modules share are in ``tests/helpers.py``.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import write_tiny_recipe

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """An untrained tiny addition model + tokenizer saved with save_pretrained."""
    from streamrl.training.model_init import init_model

    out = tmp_path_factory.mktemp("models") / "tiny"
    init_model("addition", str(out), warmstart_steps=0, seed=0)
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
    client.close()
    cluster.close()

