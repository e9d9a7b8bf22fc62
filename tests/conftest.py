"""Shared fixtures: a tiny model made on the fly, recipes that use it, a real local cluster."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """An untrained tiny addition model + tokenizer saved with save_pretrained."""
    from streamrl.training.model_init import init_model

    out = tmp_path_factory.mktemp("models") / "tiny"
    init_model("addition", str(out), warmstart_steps=0, seed=0)
    return out


TINY_RECIPE = """
[run]
name = "tiny"
steps = 2
out_dir = "{out}"

[cluster]
dashboard_port = 0

[pools.generate]
threads = 4
[pools.train]
threads = 1
[pools.reward]
threads = 1

[model]
path = "{model}"

[task]
name = "addition"

[engine]
name = "hf"
max_new_tokens = 6

[reward]
name = "exact_match"

[trainer]
lr = 1e-3
prompts_per_step = 4
samples_per_prompt = 4
groups_per_micro_batch = 1
"""


@pytest.fixture
def tiny_recipe(tmp_path, tiny_model) -> Path:
    """A small valid recipe file pointing at ``tiny_model``."""
    path = tmp_path / "tiny.toml"
    path.write_text(TINY_RECIPE.format(out=tmp_path / "runs", model=tiny_model))
    return path
