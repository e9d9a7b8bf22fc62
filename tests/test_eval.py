"""Held-out evaluation (``[eval]``): the metrics of one evaluation, and evaluations landing in
``metrics.jsonl`` of a real run (start, every N steps, after the last)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from streamrl.errors import UserError
from streamrl.extensions.evaluate import metrics
from tests.helpers import run_recipe, sets, streamrl, write_tiny_recipe


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
    from streamrl.extensions import evaluate
    from streamrl.recipe.recipe import load_recipe

    loaded = load_recipe(tiny_recipe, ["eval.every=2", "task.eval_size=0"])
    from streamrl.plugins.resolve import resolve

    task = resolve(loaded).task.build()
    with pytest.raises(UserError, match="eval: task 'addition' has no held-out prompts"):
        evaluate.for_run(None, task, loaded.recipe, greedy=False)
    # a task (a plugin's) whose held-out prompts share a uid: their results would be one prompt's
    from streamrl.sample import Prompt

    task.eval_prompts = lambda: [Prompt(uid=f"e{i % 3}", text="1+1=") for i in range(5)]
    with pytest.raises(UserError, match="task 'addition': eval_prompts\\(\\) repeats uid 'e0'; each held-out"):
        evaluate.for_run(None, task, loaded.recipe, greedy=False)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "batch"])
def test_evaluations_land_in_the_records_at_the_start_every_n_steps_and_after_the_last(tiny_recipe, tmp_path, mode,
                                                                                       shared_cluster):
    # every step: evaluations overlap (the same held-out prompts in flight twice at once)
    records = run_recipe(tiny_recipe, f"run.mode={mode}", "run.steps=5", "eval.every=1", "eval.samples=2",
                         "eval.greedy=false", "task.eval_size=6", *shared_cluster.sets, out=tmp_path / "out").records
    versions = [e["eval/policy_version"] for r in records
                for e in r.get("eval_unrecorded", []) + ([r] if "eval/policy_version" in r else [])]
    assert versions == [0, 1, 2, 3, 4, 5]  # every evaluation recorded once, in order
    # and the versions the engines decoded it with: the one asked for, or a later one come first
    evals = [e for r in records for e in r.get("eval_unrecorded", []) + ([r] if "eval/policy_version" in r else [])]
    assert all(e["eval/policy_version"] <= e["eval/decoded_version_min"] <= e["eval/decoded_version_max"] <= 5
               for e in evals)
    last = records[-1]
    assert last["eval/policy_version"] == 5 and last["eval/prompts"] == 6  # the last one is waited for
    assert 0.0 <= last["eval/pass@1"] <= last["eval/pass@2"] <= 1.0 and last["eval/response_len_mean"] > 0
    assert all(r["samples"] == 16 for r in records)  # training took no eval sample


@pytest.fixture(scope="module")
def greedy_run(tiny_model, tmp_path_factory, shared_cluster):
    """An async run of 3 steps with a greedy evaluation every step (the default engine), on 4
    held-out prompts: its records, and its folder as a finished run to score."""
    folder = tmp_path_factory.mktemp("eval")
    return run_recipe(write_tiny_recipe(folder, tiny_model), "run.mode=async", "run.steps=3", "eval.every=1",
                      "task.eval_size=4", *shared_cluster.sets, out=folder / "out")


@pytest.mark.slow
def test_streamrl_eval_scores_a_model_and_a_run_folder_for_a_before_after_table(greedy_run, tiny_recipe, tiny_model,
                                                                                tmp_path, shared_cluster):
    run_dir = greedy_run.dir  # (a finished run of the tiny model: its policy is what is scored)
    out = tmp_path / "eval.json"
    proc = streamrl("eval", str(tiny_model), str(run_dir), "--recipe", str(tiny_recipe), "--set", "task.eval_size=5",
                    "--set", "eval.samples=3", *sets(*shared_cluster.sets), "--out", str(out), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["model"] for r in rows] == [str(tiny_model), str(run_dir)]
    assert all(r["eval/prompts"] == 5 and 0.0 <= r["eval/pass@1"] <= r["eval/pass@3"] <= 1.0 for r in rows)
    assert not any("version" in key for r in rows for key in r)  # (one model each: no versions to tell apart)
    proc = streamrl("eval", str(tmp_path), timeout=60)
    assert proc.returncode == 2 and "neither a model folder" in proc.stderr and "Traceback" not in proc.stderr


def test_what_the_reward_reports_beside_the_score_is_averaged_by_name():
    summaries = [{"rewards": [1.0, 0.0], "lengths": [1, 1], "info": [{"answered": 1.0}, {"answered": 0.0}]},
                 {"rewards": [1.0], "lengths": [1], "info": [{"answered": 1.0, "timeout": 0.0}]}]
    m = metrics(summaries, k=2)
    assert m["eval/reward/answered/mean"] == pytest.approx(2 / 3) and m["eval/reward/timeout/mean"] == 0.0


@pytest.mark.slow
def test_bench_eval_runs_the_recipe_without_and_with_eval_and_reports_the_ratio(tiny_recipe, tmp_path, shared_cluster):
    out = tmp_path / "bench.json"
    proc = streamrl("bench", "eval", str(tiny_recipe), "--every", "1", "--steps", "2", "--warmup", "0", "--repeats", "2",
                    "--set", "task.eval_size=4", *sets(*shared_cluster.sets), "--out", str(out), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["passes"]) == len(result["ratios"]) == 2 and result["median_ratio"] > 0
    for p, ratio in zip(result["passes"], result["ratios"]):
        assert ratio == pytest.approx(p["eval every 1"]["samples_per_s"] / p["no eval"]["samples_per_s"])
        with_eval = (Path(p["eval every 1"]["run_dir"]) / "metrics.jsonl").read_text()
        assert "eval/pass@1" in with_eval and "eval/" not in (Path(p["no eval"]["run_dir"]) / "metrics.jsonl").read_text()


def test_two_evaluations_in_flight_ask_the_engine_under_different_request_ids():
    """The engine keys requests by prompt uid (a second request under a waiting id is refused):
    evaluations of two versions at once must not share uids. The Dask client is faked (it only
    records what would be submitted)."""
    from streamrl.extensions.evaluate import Evaluator, eval_groups
    from streamrl.recipe.recipe import EvalConfig
    from streamrl.sample import Prompt

    class RecordingClient:
        def __init__(self):
            self.asked = []

        def submit(self, fn, *args, **kwargs):
            if fn is eval_groups:
                self.asked.append([p.uid for p in args[0]])
            return object()

    client = RecordingClient()
    held_out = [Prompt(uid=f"eval-{i}", text=f"{i}+1=", answer=str(i + 1)) for i in range(3)]
    evaluator = Evaluator(client, held_out, EvalConfig(every=1), groups_per_task=2, greedy=False)
    evaluator.submit(1)
    evaluator.submit(2)
    uids = [u for bundle in client.asked for u in bundle]
    assert len(client.asked) == 4 and len(uids) == len(set(uids)) == 6
    assert [p.uid for p in held_out] == ["eval-0", "eval-1", "eval-2"]  # the task's own prompts untouched


@pytest.mark.slow
def test_greedy_evaluation_on_the_default_continuous_engine_runs_end_to_end(greedy_run):
    records = greedy_run.records
    evals = [e for r in records for e in r.get("eval_unrecorded", []) + ([r] if "eval/policy_version" in r else [])]
    assert [e["eval/policy_version"] for e in evals] == [0, 1, 2, 3] and not any("eval_error" in e for e in evals)
    assert all(e["eval/prompts"] == 4 and 0.0 <= e["eval/pass@1"] <= 1.0 for e in evals)


def test_evaluations_a_checkpoint_still_ran_are_run_again_or_said_lost_after_a_resume(tmp_path):
    # the default checkpoint_every = 50 and eval.every = 10: version 50's evaluation ran while
    # the checkpoint after it was written, and a resumed run never evaluated it (nor said so)
    from streamrl.checkpoints.integrity import json_problem
    from streamrl.extensions.evaluate import EVAL_FILE, Evaluator, HeldOutEvaluation
    from streamrl.recipe.recipe import EvalConfig

    class Recorded(Evaluator):  # (no cluster: what is submitted is noted, and finishes at once)
        def __init__(self):
            super().__init__(None, [], EvalConfig(every=10), 1, greedy=False)
            self.submitted = []

        def submit(self, version, after=None):
            self.submitted.append(version)
            self.pending.append((version, []))
            self.lost[version] = "(stands in for its metrics)"

    running = HeldOutEvaluation(Recorded(), steps=100)
    running.evaluator.pending = [(40, []), (50, [])]  # 40 finished, not recorded yet; 50 running
    (tmp_path / "controller.json").write_text(json.dumps({"next_step": 50, "policy_version": 50, "records": 50}))
    running.checkpoint(50, None)(tmp_path)
    assert json.loads((tmp_path / EVAL_FILE).read_text()) == {"pending": [40, 50]} and json_problem(tmp_path) is None
    resumed = HeldOutEvaluation(Recorded(), steps=100)
    resumed.resume(tmp_path)
    resumed.trained(50, [])
    assert resumed.evaluator.submitted == [50]  # the policy the engines hold again: evaluated anew
    record = SimpleNamespace(extra={})
    resumed.record(50, record)
    assert record.extra["eval/policy_version"] == 40 and "not evaluated: the run resumed" in record.extra["eval_error"]
    resumed.trained(51, [])
    assert resumed.evaluator.submitted == [50]  # (once)
    (tmp_path / EVAL_FILE).write_text(json.dumps({"pending": ["x"]}))
    assert "eval.json does not hold what a checkpoint writes there" in json_problem(tmp_path)
