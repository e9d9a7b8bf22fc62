"""The ``metrics.jsonl`` record of a step, built from the train tasks' stats (no cluster)."""

from __future__ import annotations

import pytest

from streamrl.telemetry.record import last_epoch_stats, summarize
from streamrl.telemetry.stats import StepStats, TrainTaskStats


def micro(samples, **sums):
    """A train task's stats, from what the trainer returned (``sums``: its ``*_sum`` keys)."""
    stats = TrainTaskStats(micro_batches=1, gen_end_max=5.0, policy_version_min=3, reward_errors=0,
                           sample_log=[{"uid": f"4-0-{i}", "version": 3} for i in range(samples)])
    stats.add({"samples": samples, "tokens": 10 * samples, "reward_sum": 0.5 * samples, "loss_sum": 0.0,
               "seconds": 1.0, **sums})
    return stats


def test_record_averages_the_algorithms_own_stats_and_defaults_missing_ones():
    step = StepStats.of({"version": 5, "grad_norm": 1.0, "seconds": 0.5})
    rec = summarize(4, 5, [micro(2, kl_sum=0.2, entropy_sum=1.0), micro(2, entropy_sum=3.0)], step,
                    t0=0.0, t_trained=8.0, t_end=10.0).as_dict()
    assert rec["entropy"] == pytest.approx(1.0) and rec["kl"] == pytest.approx(0.05)
    assert rec["clip_frac"] == 0.0 and rec["behaviour_weight"] == 1.0
    assert rec["samples"] == 4 and rec["staleness_max"] == 1 and rec["train_tail_s"] == pytest.approx(3.0)
    assert [x["staleness"] for x in rec["sample_log"]] == [1, 1, 1, 1]
    assert list(rec)[-1] == "sample_log"


def test_the_algorithms_stats_are_means_over_the_samples_trained_not_those_skipped():
    # half the samples in flat groups (left out of the backward pass): the behaviour weight of
    # the trained ones is 1, not 0.5; a task whose samples were all skipped adds only to skipped
    step = StepStats.of({"version": 5, "grad_norm": 1.0, "seconds": 0.5})
    rec = summarize(4, 5, [micro(4, behaviour_weight_sum=2.0, clip_frac_sum=0.5, skipped_sum=2, stopped_early_sum=1),
                           micro(4, skipped_sum=4)], step, t0=0.0, t_trained=8.0, t_end=10.0).as_dict()
    assert rec["behaviour_weight"] == pytest.approx(1.0) and rec["clip_frac"] == pytest.approx(0.25)
    assert rec["skipped"] == pytest.approx(0.75) and rec["stopped_early"] == pytest.approx(0.125)
    everything_skipped = summarize(4, 5, [micro(2, skipped_sum=2)], step, t0=0.0, t_trained=8.0, t_end=10.0).as_dict()
    assert everything_skipped["skipped"] == 1.0 and everything_skipped["behaviour_weight"] == 1.0
    out = last_epoch_stats([micro(4, clip_frac_sum=0.5, skipped_sum=2)], epochs=2)
    assert out["last_epoch_clip_frac"] == pytest.approx(0.25)


def test_last_epoch_stats_are_per_sample_means_of_the_last_pass():
    out = last_epoch_stats([micro(2, clip_frac_sum=0.5, loss_sum=1.0), micro(2, loss_sum=3.0)], epochs=3)
    assert out == {"epochs": 3, "last_epoch_clip_frac": pytest.approx(0.125), "last_epoch_loss": pytest.approx(1.0)}
    # a step of no samples (a stop ended it): zeros, not a ZeroDivisionError ending the run
    assert last_epoch_stats([], epochs=2) == {"epochs": 2, "last_epoch_clip_frac": 0.0, "last_epoch_loss": 0.0}


def test_train_stats_keep_the_trainers_sums_and_pickle_as_dask_sends_them():
    import pickle

    task = micro(2, clip_frac_sum=0.5, skipped_sum=1, note=7)  # (a key that is no sum is not recorded)
    task.add({"samples": 1, "tokens": 3, "reward_sum": 1.0, "loss_sum": 0.25, "seconds": 0.5, "clip_frac_sum": 0.25})
    assert (task.samples, task.tokens, task.reward_sum, task.loss_sum) == (3, 23, 2.0, 0.25)
    assert task.sums == {"clip_frac": 0.75, "skipped": 1.0}
    step = StepStats.of({"version": 2, "grad_norm": 0.5, "critic_grad_norm": 0.1, "seconds": 1.0})
    assert (step.version, step.extra) == (2, {"critic_grad_norm": 0.1})
    assert pickle.loads(pickle.dumps(task)) == task and pickle.loads(pickle.dumps(step)) == step


def test_flat_groups_is_the_share_of_multi_sample_groups_whose_rewards_were_all_equal():
    a, b = micro(4), micro(4)
    a.groups, a.flat_groups = 2, 2
    b.groups, b.flat_groups = 2, 0
    step = StepStats.of({"version": 5, "grad_norm": 1.0, "seconds": 0.5})
    assert summarize(4, 5, [a, b], step, t0=0.0, t_trained=8.0, t_end=10.0).as_dict()["flat_groups"] == 0.5
    b.flat_groups = 2
    assert summarize(4, 5, [a, b], step, t0=0.0, t_trained=8.0, t_end=10.0).flat_groups == 1.0
    a.groups = a.flat_groups = b.groups = b.flat_groups = 0  # groups of one sample: nothing to say
    assert summarize(4, 5, [a, b], step, t0=0.0, t_trained=8.0, t_end=10.0).flat_groups is None


def test_a_plugins_text_in_a_record_is_bounded():
    # (an algorithm's or an extension's 10 MB string went whole into every metrics line)
    step = StepStats.of({"version": 5, "grad_norm": 1.0, "seconds": 0.5})
    rec = summarize(4, 5, [micro(2)], step, t0=0.0, t_trained=8.0, t_end=10.0)
    rec.extra["note"] = "x" * 10_000_000
    rec.extra["table"] = {"k" * 10_000: "y" * 5000}
    d = rec.as_dict()
    assert len(d["note"]) == 4096 and d["note"].endswith("…")
    ((key, value),) = d["table"].items()
    assert len(key) == 256 and len(value) == 4096
