"""``streamrl bench staleness``: how a run becomes a row, how rows fold seeds, what it refuses,
and the command end to end on the tiny model."""

from __future__ import annotations

import json

import pytest

from streamrl.bench.staleness import held_out, run_row, summarize, variant_overrides
from streamrl.errors import UserError
from tests.helpers import last_error_line, parity_recipe, streamrl


def record(step, samples=16, window=2.0, reward=0.5, **more):
    return {"step": step, "samples": samples, "accounting_window_s": window, "reward_mean": reward,
            "staleness_max": min(step, 2), **more}


def test_a_run_becomes_a_row_of_its_end_score_curve_area_throughput_and_diagnostics():
    records = [
        record(0, window=100.0, reward=0.1, **{"offpolicy/0/tokens": 10, "offpolicy/0/clipped": 0.0,
                                               "offpolicy/token_staleness_mean": 0.0, "offpolicy/ess": 1.0}),
        record(1, reward=0.3, **{"offpolicy/1/tokens": 30, "offpolicy/1/clipped": 0.5, "offpolicy/0/tokens": 10,
                                 "offpolicy/0/clipped": 0.1, "offpolicy/1/masked": 0.2,
                                 "offpolicy/token_staleness_mean": 0.75, "offpolicy/ess": 0.8,
                                 "offpolicy/low_ess": 0}),
        record(2, reward=0.5, **{"offpolicy/2-3/tokens": 20, "offpolicy/2-3/truncated": 0.25,
                                 "offpolicy/token_staleness_mean": 2.0, "offpolicy/ess": 0.4,
                                 "offpolicy/low_ess": 1, "eval/pass@1": 0.625, "eval/reward_mean": 0.5}),
    ]
    row = run_row(records)
    assert row["held_out"] == 0.625  # pass@1 of the evaluation after the last step
    assert row["reward_area"] == pytest.approx(0.3)
    assert row["samples_per_s"] == pytest.approx(32 / 4.0)  # the first step (model loads) left out
    assert row["token_staleness_mean"] == pytest.approx(2.75 / 3) and row["ess_mean"] == pytest.approx(2.2 / 3)
    # per step, the share over every bucket's tokens; then the mean over steps
    assert row["clipped_mean"] == pytest.approx((0 + (0.5 * 30 + 0.1 * 10) / 40 + 0) / 3)
    assert row["masked_mean"] == pytest.approx((0.2 * 30 / 40) / 3)
    assert row["truncated_mean"] == pytest.approx(0.25 / 3)
    assert row["low_ess_steps"] == 1 and row["staleness_max"] == 2
    assert held_out([record(0, **{"eval/reward_mean": 0.4})]) == 0.4 and held_out([record(0)]) is None


def test_rows_fold_their_seeds_into_mean_and_spread():
    runs = [{"held_out": 0.5, "reward_area": 0.2, "samples_per_s": 100.0, "token_staleness_mean": 1.0,
             "ess_mean": 0.9, "clipped_mean": 0.1, "truncated_mean": 0.0, "masked_mean": 0.0, "low_ess_steps": 0},
            {"held_out": 0.7, "reward_area": 0.4, "samples_per_s": 120.0, "token_staleness_mean": 1.0,
             "ess_mean": 0.7, "clipped_mean": 0.3, "truncated_mean": 0.0, "masked_mean": 0.0, "low_ess_steps": 2}]
    row = summarize(runs)
    assert row["seeds"] == [0.5, 0.7] and row["held_out_mean"] == pytest.approx(0.6)
    assert row["held_out_spread"] == pytest.approx(0.2) and row["samples_per_s"] == pytest.approx(110.0)
    assert row["ess_mean"] == pytest.approx(0.8) and row["low_ess_steps"] == 2
    no_eval = summarize([dict(runs[0], held_out=None)])
    assert no_eval["seeds"] == [None] and no_eval["held_out_mean"] is None


def test_staleness_zero_is_stream_mode_and_the_rest_async_with_the_bound():
    assert variant_overrides(0, "none", 1, 30)[0] == "run.mode=stream"
    over = variant_overrides(4, "tis", 2, 30)
    assert over[:2] == ["run.mode=async", "run.max_staleness=4"]
    assert 'algorithm.off_policy={correction="tis"}' in over and "run.seed=2" in over and "run.steps=30" in over


def test_bad_arguments_are_one_line(tiny_recipe):
    from streamrl.bench import staleness

    with pytest.raises(UserError, match="unknown correction 'clip'"):
        staleness.bench(str(tiny_recipe), [], corrections=("none", "clip"))
    with pytest.raises(UserError, match="--seeds"):
        staleness.bench(str(tiny_recipe), [], seeds=0)
    proc = streamrl("bench", "staleness", str(tiny_recipe), "--staleness", "1,two")
    assert last_error_line(proc, 2) == "streamrl: error: --staleness: expected whole numbers separated by commas, got '1,two'"


@pytest.mark.slow
def test_bench_staleness_runs_each_row_on_one_cluster_and_forces_the_staleness(tiny_model, tmp_path):
    out = tmp_path / "stale.json"
    parity_recipe(tmp_path, tiny_model)  # (a reward with variance: the rows train tokens)
    proc = streamrl("bench", "staleness", str(tmp_path / "tiny.toml"), "--staleness", "0,2", "--corrections", "none,icepop",
                    "--seeds", "1", "--steps", "3", "--eval-prompts", "4", "--out", str(out), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["default"] == "none" and result["forced_staleness"] is True
    # staleness 0 runs once, uncorrected: on-policy every correction weighs 1
    assert [(r["staleness"], r["correction"]) for r in result["rows"]] == [(0, "none"), (2, "none"), (2, "icepop")]
    for r in result["rows"]:
        assert len(r["seeds"]) == 1 and r["seeds"][0] is not None  # the held-out score after the last step
        assert r["samples_per_s"] > 0 and 0 < r["ess_mean"] <= 1
    zero, two = result["rows"][0], result["rows"][1]
    assert zero["token_staleness_mean"] == 0 and zero["runs"][0]["staleness_max"] == 0
    # forced: the third step trains tokens exactly two versions old (steps 1 and 2: 0 and 1 behind)
    assert two["runs"][0]["staleness_max"] == 2
    assert "streamrl bench staleness" in proc.stderr and "held-out per seed" in proc.stderr
