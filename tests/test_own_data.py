"""A user's own data and reward, end to end through the real CLI, with no code but the reward
file: a verl-layout parquet with a ``compute_score`` file, a TRL-layout JSONL with a TRL reward
function; a run interrupted mid-epoch resumes without repeating or skipping a row; the GPU recipe
for users with a hub validates with local stand-ins."""

from __future__ import annotations

import json

import pytest

from tests.helpers import ROOT, TINY_RECIPE, run_recipe

VERL_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature; the dict's other values are logged (the row index shows which rows ran)."""
    return {"score": float(solution_str.strip() == ground_truth), "row": extra_info["index"],
            "arith": float(data_source == "arith")}
'''

TRL_REWARD = '''
def correct(prompts, completions, solution, level, **kwargs):
    """TRL's batch form: one list per column."""
    assert len(prompts) == len(completions) == len(solution) == len(level)
    return [float(c.strip() == s) for c, s in zip(completions, solution)]


def short(prompts, completions, **kwargs):
    return [-len(c) / 10 for c in completions]
'''


def write_verl(folder, n: int) -> None:
    import datasets

    rows = [{"data_source": "arith", "prompt": [{"role": "user", "content": f"{i % 10}+{i // 10}="}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i % 10 + i // 10)},
             "extra_info": {"split": "train", "index": i}} for i in range(n)]
    datasets.Dataset.from_list(rows).to_parquet(str(folder / "train.parquet"))


def recipe(folder, tiny_model, task: str, reward: str) -> str:
    text = TINY_RECIPE.format(out=folder / "runs", model=tiny_model)
    text = text.replace('[task]\nname = "addition"\n', task).replace('[reward]\nname = "exact_match"\n', reward)
    (folder / "recipe.toml").write_text(text)
    return str(folder / "recipe.toml")


@pytest.mark.slow
def test_a_verl_parquet_with_a_compute_score_file_runs_and_resumes_mid_epoch_without_repeating_a_row(
        tmp_path, tiny_model, shared_cluster):
    write_verl(tmp_path, 24)
    (tmp_path / "reward.py").write_text(VERL_REWARD)
    file = recipe(tmp_path, tiny_model, '[task]\nname = "dataset"\npath = "train.parquet"\n',
                  '[reward]\nname = "python"\npath = "reward.py"\n')
    whole = run_recipe(file, "run.steps=8", *shared_cluster.sets).records
    assert all(r["reward_errors"] == 0 and r["reward/arith/mean"] == 1.0 for r in whole)
    rows = [round(r["reward/row/mean"] * 4) for r in whole]  # 4 prompts a step: the sum of their rows
    assert sum(rows[:6]) == sum(range(24))  # steps 0-5 are one epoch: every row once
    # stopped after step 4 (mid-epoch, its last checkpoint), then resumed to 8: the same rows
    run_recipe(file, "run.steps=4", "run.mode=batch", *shared_cluster.sets)
    (first,) = [p for p in (tmp_path / "runs").iterdir() if (p / "metrics.jsonl").read_text().count("\n") == 4]
    resumed = run_recipe(first, "run.steps=8", *shared_cluster.sets, command="resume").records
    assert [round(r["reward/row/mean"] * 4) for r in resumed] == rows


@pytest.mark.slow
@pytest.mark.smoke
def test_a_trl_jsonl_with_trl_reward_functions_runs(tmp_path, tiny_model):
    (tmp_path / "data.jsonl").write_text("".join(
        json.dumps({"prompt": f"{i}+{j}=", "solution": str(i + j), "level": i % 3}) + "\n"
        for i in range(10) for j in range(3)))
    (tmp_path / "trl_rewards.py").write_text(TRL_REWARD)
    file = recipe(tmp_path, tiny_model, '[task]\nname = "dataset"\npath = "data.jsonl"\neval_fraction = 0.2\n',
                  '[reward]\nname = "python"\npath = "trl_rewards.py"\n'
                  '[[reward.functions]]\nfunction = "correct"\n[[reward.functions]]\nfunction = "short"\nweight = 0.1\n')
    records = run_recipe(file, "run.steps=3", "eval.every=2", "eval.greedy=false").records
    assert all(r["reward_errors"] == 0 for r in records)
    assert all(r["reward_mean"] == pytest.approx(r["reward/correct/mean"] + 0.1 * r["reward/short/mean"])
               for r in records)
    assert records[-1]["eval/policy_version"] == 3 and records[-1]["eval/prompts"] == 6


def test_the_gpu_recipe_validates_with_local_stand_ins(tmp_path, tiny_model, capsys):
    from streamrl.cli import main

    write_verl(tmp_path, 8)
    code = main(["recipe", "validate", str(ROOT / "recipes" / "gpu-qwen-gsm8k.toml"),
                 "--set", f'model.path="{tiny_model}"', "--set", f'task.path="{tmp_path / "train.parquet"}"',
                 "--set", f'task.eval_path="{tmp_path / "train.parquet"}"',
                 "--set", "engine.max_new_tokens=32"])  # (the stand-in model has 64 positions)
    out = capsys.readouterr()
    assert code == 0 and out.out.strip().endswith(": ok"), out.err


def test_a_missing_local_model_is_one_line_and_a_hub_id_is_left_to_the_hub(tmp_path, tiny_model):
    from streamrl.errors import UserError
    from streamrl.plugins.resolve import resolve
    from streamrl.recipe.recipe import load_recipe

    (tmp_path / "models").mkdir()
    file = recipe(tmp_path, tiny_model, '[task]\nname = "addition"\n', '[reward]\nname = "exact_match"\n')
    with pytest.raises(UserError, match="model.path: no transformers model at .*model init --task addition"):
        resolve(load_recipe(file, ['model.path="models/missing"']))
    # a folder named after a known architecture is made with its shapes, not as a tiny task model
    with pytest.raises(UserError, match=r"random weights and its shapes: streamrl model init --arch qwen2.5-0.5b "
                                        r"--random --out"):
        resolve(load_recipe(file, ['model.path="models/qwen2.5-0.5b-random"']))
    with pytest.raises(UserError, match=r"model init --task addition"):  # (a trained model's name: no random weights)
        resolve(load_recipe(file, ['model.path="models/qwen2.5-0.5b-instruct"']))
    resolved = resolve(load_recipe(file, ['model.path="Qwen/Qwen2.5-0.5B-Instruct"']))
    assert resolved.model_path == "Qwen/Qwen2.5-0.5B-Instruct"
