"""``run.seed``: it fills every unset ``seed`` field of the components, and a run repeated with
the same seed gives the same metrics while another seed gives others."""

from __future__ import annotations

import pytest

from streamrl.plugins.resolve import resolve
from streamrl.recipe.recipe import load_recipe
from tests.helpers import ROOT, run_recipe

W3 = str(ROOT / "recipes" / "paper-7b-20k.toml")
SMALL = ["pools.generate.workers=2", "pools.generate.threads=8", "trainer.prompts_per_step=8",
         "trainer.samples_per_prompt=2", "engine.time_scale=0.0002", "run.steps=2", "cluster.dashboard_port=0"]


def test_run_seed_fills_unset_seed_fields_only():
    resolved = resolve(load_recipe(W3, ["run.seed=7"]))
    assert resolved.task.config.seed == 7 and resolved.engine.config.seed == 7
    resolved = resolve(load_recipe(W3, ["run.seed=7", "task.seed=3"]))
    assert resolved.task.config.seed == 3 and resolved.engine.config.seed == 7  # the recipe's own wins


def run(tmp_path, seed: int) -> list[tuple]:
    out = tmp_path / f"seed{seed}-{len(list(tmp_path.iterdir()))}"
    records = run_recipe(W3, *SMALL, f"run.seed={seed}", out=out, timeout=300).records
    # what the seed decides (prompts, sampled lengths, rewards), not wall-clock timings
    return [(r["reward_mean"], r["response_len_mean"], sorted((x["uid"], x["response_len"]) for x in r["sample_log"]))
            for r in records]


@pytest.mark.slow
def test_same_seed_same_metrics_other_seed_other_metrics(tmp_path):
    first, again, other = run(tmp_path, 1), run(tmp_path, 1), run(tmp_path, 2)
    assert first == again
    assert first != other
