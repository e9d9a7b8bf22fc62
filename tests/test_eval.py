"""Held-out evaluation (``[eval]``): the metrics of one evaluation, and evaluations landing in
``metrics.jsonl`` of a real run (start, every N steps, after the last)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from streamrl.errors import UserError
from streamrl.flow.evaluate import metrics
from tests.conftest import ROOT


def test_pass_at_1_is_the_mean_share_and_pass_at_k_any():
    summaries = [{"rewards": [1.0, 0.0, 0.0], "lengths": [3, 4, 5]},   # one of three right
                 {"rewards": [0.0, 0.0, 0.0], "lengths": [1, 1, 1]},   # none
                 {"rewards": [1.0, 1.0, 0.5], "lengths": [2, 2, 2]}]   # two (0.5 is below pass_reward)
    m = metrics(summaries, k=3)
    assert m["eval/prompts"] == 3 and m["eval/reward_mean"] == pytest.approx(3.5 / 9)
    assert m["eval/pass@1"] == pytest.approx((1 / 3 + 0 + 2 / 3) / 3) and m["eval/pass@3"] == pytest.approx(2 / 3)
    assert m["eval/response_len_mean"] == pytest.approx(21 / 9)
    assert metrics(summaries, k=3, pass_reward=0.5)["eval/pass@1"] == pytest.approx((1 / 3 + 0 + 1) / 3)


def test_a_task_without_held_out_prompts_cannot_be_evaluated(tiny_recipe):
    from streamrl.flow import evaluate
    from streamrl.recipe import load_recipe

    loaded = load_recipe(tiny_recipe, ["eval.every=2", "task.eval_size=0"])
    from streamrl.flow.resolve import resolve

    task = resolve(loaded).task.build()
    with pytest.raises(UserError, match="eval: task 'addition' has no held-out prompts"):
        evaluate.for_run(None, task, loaded.recipe, greedy=False)


def run(tiny_recipe, tmp_path, overrides: list[str]) -> list[dict]:
    out = tmp_path / "out"
    args = [a for kv in overrides + [f'run.out_dir="{out}"'] for a in ("--set", kv)]
    proc = subprocess.run([sys.executable, "-m", "streamrl", "recipe", "run", str(tiny_recipe), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = out.iterdir()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "batch"])
def test_evaluations_land_in_the_records_at_the_start_every_n_steps_and_after_the_last(tiny_recipe, tmp_path, mode):
    records = run(tiny_recipe, tmp_path, [f"run.mode={mode}", "run.steps=5", "eval.every=2", "eval.samples=2",
                                          "eval.greedy=false", "task.eval_size=6"])
    versions = [e["eval/policy_version"] for r in records
                for e in r.get("eval_unrecorded", []) + ([r] if "eval/policy_version" in r else [])]
    assert versions == [0, 2, 4, 5]  # every evaluation recorded once, in order
    last = records[-1]
    assert last["eval/policy_version"] == 5 and last["eval/prompts"] == 6  # the last one is waited for
    assert 0.0 <= last["eval/pass@1"] <= last["eval/pass@2"] <= 1.0 and last["eval/response_len_mean"] > 0
    assert all(r["samples"] == 16 for r in records)  # training took no eval sample
