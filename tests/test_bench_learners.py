"""``streamrl bench learners``: the two variants' overrides, and the command end to end."""

from __future__ import annotations

import json

import pytest

from streamrl.bench.learner_variants import learner_overrides, parse_learners, variant_overrides
from streamrl.errors import UserError
from streamrl.recipe.learners import LearnerConfig
from streamrl.recipe.recipe import apply_overrides
from tests.helpers import streamrl


def test_variants_give_the_recipes_algorithm_its_options_and_others_a_bare_table():
    recipe = {"algorithm": {"name": "ppo", "gamma": 0.99, "lam": 0.95},
              "learners": [{"name": "old"}], "trainer": {"lr": 1e-3}}
    per = learner_overrides(["dpo.trainer.lr=1e-4", "dpo.algorithm.beta=0.2", "dpo.when_full=\"pace\""],
                            ["ppo", "grpo", "dpo"])
    v = variant_overrides(recipe["algorithm"], ["ppo", "grpo", "dpo"], per, add_eval=True, steps=3)

    together = apply_overrides(json.loads(json.dumps(recipe)), v["together"])
    assert together["run"] == {"steps": 3, "serve": "ppo"} and together["eval"] == {"every": 10}
    assert together["learners"] == [  # the recipe's own tables replaced; ppo takes [algorithm]
        {"name": "ppo"}, {"name": "grpo", "algorithm": {"name": "grpo"}},
        {"name": "dpo", "algorithm": {"name": "dpo", "beta": 0.2}, "trainer": {"lr": 1e-4}, "when_full": "pace"}]
    for table in together["learners"]:
        LearnerConfig.model_validate(table)
    assert together["algorithm"] == recipe["algorithm"] and together["trainer"] == {"lr": 1e-3}

    assert set(v["apart"]) == {"ppo", "grpo", "dpo"}
    alone = {n: apply_overrides(json.loads(json.dumps(recipe)), ov) for n, ov in v["apart"].items()}
    assert alone["ppo"]["algorithm"] == {"name": "ppo", "gamma": 0.99, "lam": 0.95}
    assert alone["grpo"]["algorithm"] == {"name": "grpo"}  # ppo's gamma/lam are unknown to grpo
    assert alone["dpo"]["algorithm"] == {"name": "dpo", "beta": 0.2} and alone["dpo"]["trainer"] == {"lr": 1e-4}
    for a in alone.values():
        assert a["learners"] == [] and a["run"] == {"steps": 3, "serve": ""} and a["eval"] == {"every": 10}
    assert alone["ppo"]["trainer"] == {"lr": 1e-3}

    # the recipe's algorithm with a changed option: written out in full, over its options
    v = variant_overrides(recipe["algorithm"], ["ppo"], learner_overrides(["ppo.algorithm.lam=0.9"], ["ppo"]))
    assert apply_overrides({}, v["together"])["learners"] == [
        {"name": "ppo", "algorithm": {"name": "ppo", "gamma": 0.99, "lam": 0.9}}]
    assert "eval" not in apply_overrides({}, v["together"])


def test_several_learners_of_one_algorithm_and_lora_learners_in_both_variants():
    names, algorithms = parse_learners(["grpo", "g2=grpo", " d = dpo "])
    assert names == ["grpo", "g2", "d"] and algorithms == {"grpo": "grpo", "g2": "grpo", "d": "dpo"}
    lora = {"lora": {"rank": 4, "alpha": 8.0}}
    per = learner_overrides(["d.trainer.lr=1e-4"], names)
    v = variant_overrides({"name": "grpo", "beta": 0.1}, names, per, algorithms=algorithms, trainer=lora)
    together = apply_overrides({}, v["together"])
    assert together["learners"] == [
        {"name": "grpo", "trainer": lora}, {"name": "g2", "trainer": lora},  # grpo: the recipe's [algorithm]
        {"name": "d", "algorithm": {"name": "dpo"}, "trainer": {**lora, "lr": 1e-4}}]
    for table in together["learners"]:
        LearnerConfig.model_validate(table)
    alone = apply_overrides({}, v["apart"]["g2"])
    assert alone["algorithm"] == {"name": "grpo", "beta": 0.1} and alone["trainer"] == lora


def test_learner_overrides_name_learners_of_the_bench_and_table_keys():
    with pytest.raises(UserError, match="not in --learners"):
        learner_overrides(["rloo.trainer.lr=1"], ["grpo"])
    with pytest.raises(UserError, match="expected NAME.trainer.KEY"):
        learner_overrides(["grpo.lr=1"], ["grpo"])
    with pytest.raises(UserError, match="its algorithm"):
        learner_overrides(["grpo.algorithm.name=\"rloo\""], ["grpo"])
    with pytest.raises(UserError, match="twice"):
        variant_overrides({"name": "grpo"}, ["grpo", "grpo"])


@pytest.mark.slow
def test_bench_learners_runs_together_and_apart(tiny_recipe, tmp_path):
    out = tmp_path / "bench.json"
    proc = streamrl("bench", "learners", str(tiny_recipe),
                    "--learners", "grpo,rloo", "--steps", "2", "--out", str(out), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    assert "has no [eval]" in proc.stdout and "tokens together / apart" in proc.stdout
    result = json.loads(out.read_text())
    together, apart = result["variants"]["together"], result["variants"]["apart"]
    assert result["learners"] == ["grpo", "rloo"] and result["eval_added"]
    assert set(apart["runs"]) == {"grpo", "rloo"} and set(together["learners"]) == {"grpo", "rloo"}
    assert together["steps"] == 2 and all(r["steps"] == 2 for r in apart["runs"].values())
    # two runs alone generate from the same prompts with the same seeds: about twice the stream
    assert together["generated_tokens"] > 0
    assert 1.5 <= apart["generated_tokens"] / together["generated_tokens"] <= 2.5
    assert apart["generated_tokens"] == pytest.approx(sum(r["generated_tokens"] for r in apart["runs"].values()),
                                                      abs=0.5)
    assert apart["wall_s"] == pytest.approx(sum(r["wall_s"] for r in apart["runs"].values()), abs=0.05)
    assert result["ratios"]["wall_together_over_apart"] == pytest.approx(together["wall_s"] / apart["wall_s"])
    assert result["ratios"]["tokens_together_over_apart"] == pytest.approx(
        together["generated_tokens"] / apart["generated_tokens"])
    assert together["learners"]["grpo"]["served"] and not together["learners"]["rloo"]["served"]
    for name in ("grpo", "rloo"):
        mine, alone = together["learners"][name], apart["runs"][name]["learner"]
        for lr in (mine, alone):
            assert lr["train_reward"] is not None and lr["eval_first"] is not None
            assert lr["eval_first_version"] == 0
        assert alone["eval_last_version"] == 2 and mine["steps_trained"] >= 1
    assert together["learners"]["grpo"]["eval_last_version"] == 2


@pytest.mark.slow
def test_bench_learners_with_lora_compares_adapters_with_whole_weights(tiny_recipe, tmp_path):
    out = tmp_path / "bench.json"
    proc = streamrl("bench", "learners", str(tiny_recipe), "--learners", "grpo,g2=grpo", "--lora", "4",
                    "--no-apart", "--steps", "2", "--out", str(out), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    result = json.loads(out.read_text())
    assert set(result["variants"]) == {"together", "together-full"} and result["lora_rank"] == 4
    lora, full = result["variants"]["together"], result["variants"]["together-full"]
    assert 0 < lora["publish_bytes"] < 0.2 * full["publish_bytes"]  # the adapter, not the model
    assert result["ratios"]["publish_bytes_ratio"] == pytest.approx(lora["publish_bytes"] / full["publish_bytes"])
    for v in (lora, full):  # each learner's worker measured: the served one's train worker, the other's own
        assert set(v["learners"]) == {"grpo", "g2"} and all(lr["rss_mb"] > 50 for lr in v["learners"].values())
        assert {"train-0", "learner-g2"} <= set(v["worker_rss_mb"])
    assert "publish bytes LoRA / full" in proc.stdout
