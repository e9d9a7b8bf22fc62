"""Off-policy corrections (``[algorithm.off_policy]``) and the ``offpolicy/...`` diagnostics: each
loss and each number against a value computed by hand on a batch whose ratios are known, and
a run per correction whose samples really are stale."""

from __future__ import annotations

import math
import re

import pytest
import torch

from streamrl.algorithms.grpo import GRPO, GRPOConfig
from streamrl.algorithms.off_policy import TOKEN_FLAGS
from streamrl.errors import UserError
from streamrl.sample import Sample
from streamrl.telemetry.off_policy import LOW_ESS, lowest_ess_bucket, record_fields
from streamrl.telemetry.stats import TrainTaskStats
from streamrl.training.off_policy_stats import bucket_sums, token_versions
from tests.helpers import parity_recipe, read_records, sets, streamrl

# One sequence of four tokens whose behaviour weights w = pi_trained / pi_behaviour are known:
# the trained policy gives each token probability 1 (log-prob 0), the behaviour one 1 / w.
W = [0.25, 1.0, 3.0, 8.0]


def loss_and_grad(off_policy: dict, w=W, adv=1.0):
    """The per-sample loss, the gradient on ``new`` and the token flags for weights ``w``."""
    new = torch.zeros(1, len(w), requires_grad=True)
    old = -torch.log(torch.tensor([w]))
    algo = GRPO(GRPOConfig(clip=0.2, off_policy=off_policy))
    per_sample, stats = algo.loss(new, old, None, torch.tensor([adv]), torch.ones(1, len(w)))
    (grad,) = torch.autograd.grad(per_sample.sum(), new)
    return per_sample.item(), grad[0].tolist(), {k: v[0].tolist() for k, v in stats[TOKEN_FLAGS].items()}


def test_none_clips_the_ratio_to_the_behaviour_policy():
    loss, grad, flags = loss_and_grad({"correction": "none"})
    # min(r * A, clip(r, 0.8, 1.2) * A) per token: 0.25, 1, 1.2, 1.2; the sample's loss is minus their mean
    assert loss == pytest.approx(-(0.25 + 1 + 1.2 + 1.2) / 4)
    # d/dnew of -r/4 is -r/4 where the clip does not bind; the two clipped tokens teach nothing
    assert grad == pytest.approx([-0.25 / 4, -1 / 4, 0.0, 0.0])
    # (clipped counts the ratios outside the range, CleanRL's clip fraction, whichever side the min took)
    assert flags["clipped"] == [True, False, True, True] and not any(flags["masked"] + flags["truncated"])


def test_tis_weights_by_the_truncated_behaviour_weight():
    loss, grad, flags = loss_and_grad({"correction": "tis", "cap": 2.0})
    weights = [0.25, 1.0, 2.0, 2.0]  # min(w, 2); the ratio to the proximal policy is 1
    assert loss == pytest.approx(-sum(weights) / 4)
    assert grad == pytest.approx([-x / 4 for x in weights])
    assert flags["truncated"] == [False, False, True, True] and not any(flags["clipped"])


def test_the_short_form_is_tis():
    cfg = GRPOConfig(off_policy_cap=2.0)
    assert (cfg.off_policy.correction, cfg.off_policy.cap) == ("tis", 2.0)
    with pytest.raises(ValueError, match="not both"):
        GRPOConfig(off_policy_cap=2.0, off_policy={"correction": "icepop"})
    with pytest.raises(ValueError, match="not both"):  # (tis too: its cap was silently the short form's)
        GRPOConfig(off_policy_cap=2.0, off_policy={"correction": "tis", "cap": 5.0})
    assert GRPOConfig(off_policy_cap=2.0, off_policy={"correction": "tis", "cap": 2.0}).off_policy.cap == 2.0


@pytest.mark.parametrize("table, said", [
    ({"correction": "icepop", "cap": 3.0}, "cap has no effect with correction 'icepop' (it reads low, high)"),
    ({"correction": "tis", "low": 0.1}, "low has no effect with correction 'tis' (it reads cap)"),
    ({"correction": "decoupled", "m2_threshold": 0.1}, "m2_threshold has no effect with correction 'decoupled'"),
    ({"cap": 3.0}, "cap has no effect with correction 'none' (it reads none of them)"),
])
def test_a_setting_the_chosen_correction_does_not_read_is_refused_not_ignored(table, said):
    from streamrl.recipe.recipe import validate_section

    with pytest.raises(UserError, match=re.escape(said)):
        validate_section(GRPOConfig, {"off_policy": table}, "algorithm")


def test_decoupled_masks_the_tokens_over_the_cap():
    loss, grad, flags = loss_and_grad({"correction": "decoupled", "cap": 2.0})
    weights = [0.25, 1.0, 0.0, 0.0]  # w where w <= 2, else masked (AReaL's cap)
    assert loss == pytest.approx(-sum(weights) / 4)
    assert grad == pytest.approx([-x / 4 for x in weights])
    assert flags["masked"] == [False, False, True, True]


def test_icepop_masks_both_tails_of_the_band():
    loss, grad, flags = loss_and_grad({"correction": "icepop"})  # the default band [0.5, 5]
    weights = [0.0, 1.0, 3.0, 0.0]
    assert loss == pytest.approx(-sum(weights) / 4)
    assert grad == pytest.approx([-x / 4 for x in weights])
    assert flags["masked"] == [True, False, False, True]


def test_geo_reject_drops_whole_sequences_by_their_geometric_mean_weight():
    new = torch.zeros(2, 4, requires_grad=True)
    # sequence 0: geometric mean (0.25 * 1 * 3 * 8) ** (1/4) = 1.565, inside [0.5, 2]; sequence 1: 4, outside
    old = -torch.log(torch.tensor([W, [4.0] * 4]))
    algo = GRPO(GRPOConfig(off_policy={"correction": "geo_reject"}))
    per_sample, stats = algo.loss(new, old, None, torch.tensor([1.0, 1.0]), torch.ones(2, 4))
    assert per_sample.tolist() == pytest.approx([-sum(W) / 4, 0.0])
    assert stats[TOKEN_FLAGS]["masked"].tolist() == [[False] * 4, [True] * 4]
    assert 6 ** 0.25 == pytest.approx(1.565, abs=1e-3)  # (the geometric mean the test relies on)


def test_m2po_masks_the_largest_second_moments_until_the_rest_is_under_the_threshold():
    # (log w)^2 = 1.922, 0, 1.207, 4.324; sorted 0, 1.207, 1.922, 4.324 have running means
    # 0, 0.603, 1.043, 1.863: with a threshold of 1.0 the tokens of w = 1 and w = 3 are kept
    loss, grad, flags = loss_and_grad({"correction": "m2po", "m2_threshold": 1.0})
    assert flags["masked"] == [True, False, False, True]
    # the kept tokens' surrogate is PPO's to the behaviour policy: 1 and min(3, 1.2)
    assert loss == pytest.approx(-(1.0 + 1.2) / 4)
    assert grad == pytest.approx([0.0, -1 / 4, 0.0, 0.0])  # w = 3 is clipped
    _, _, flags = loss_and_grad({"correction": "m2po"})  # M2PO's 0.04: only the on-policy token stays
    assert flags["masked"] == [True, False, True, True]


def test_a_band_that_is_empty_is_refused():
    with pytest.raises(ValueError, match="must be below"):
        GRPOConfig(off_policy={"correction": "icepop", "low": 2.0, "high": 1.0})


@pytest.mark.parametrize("correction", ["tis", "decoupled", "icepop", "geo_reject"])
def test_more_epochs_than_one_need_a_correction_clipped_to_the_behaviour_policy(correction):
    # these take the weights before each optimizer step as the proximal policy: in a second epoch
    # the ratio to it is exactly 1, so no token is ever clipped, however far the first step went
    new = torch.zeros(1, 4, requires_grad=True)
    old = -torch.log(torch.tensor([W]))
    moved = (new + 3.0).detach().requires_grad_()  # (epoch 2: the first step made every token e^3 likelier)
    _, stats = GRPO(GRPOConfig(clip=0.2, off_policy={"correction": correction})).loss(
        moved, old, None, torch.tensor([1.0]), torch.ones(1, 4))
    assert not stats[TOKEN_FLAGS]["clipped"].any()  # what a second epoch would have trained with
    with pytest.raises(ValueError, match=f"epochs = 2 with off_policy correction '{correction}'"):
        GRPOConfig(epochs=2, off_policy={"correction": correction})
    with pytest.raises(ValueError, match="epochs = 3 with off_policy correction 'tis'"):
        GRPOConfig(epochs=3, off_policy_cap=2.0)
    for fine in ("none", "m2po"):  # (clipped to the generating policy: every epoch keeps its trust region)
        assert GRPOConfig(epochs=2, off_policy={"correction": fine}).epochs == 2


# -- the diagnostics ---------------------------------------------------------------------------------
def test_bucket_sums_and_record_fields_on_a_batch_whose_ratios_are_known():
    # row 0: four tokens of staleness 0, 1, 2 and 5 with weights W; row 1: two tokens of staleness 1
    # with weights 2 and 0.5, then padding
    new = torch.zeros(2, 4)
    old = -torch.log(torch.tensor([W, [2.0, 0.5, 1.0, 1.0]]))
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0]])
    staleness = torch.tensor([[0, 1, 2, 5], [1, 1, 0, 0]])
    flags = {"clipped": torch.tensor([[False, False, True, True], [True, False, True, True]]),
             "masked": torch.tensor([[False, False, False, True], [False, False, False, False]])}
    sums = bucket_sums(new, old, mask, staleness, flags)
    assert set(sums) == {"0", "1", "2-3", "4+"}
    b1 = sums["1"]  # weights 1, 2, 0.5
    assert b1["tokens"] == 3 and b1["staleness"] == 3
    assert b1["log_ratio"] == pytest.approx(0 + math.log(2) + math.log(0.5))
    assert b1["k3"] == pytest.approx((1 - 1 - 0) + (2 - 1 - math.log(2)) + (0.5 - 1 - math.log(0.5)))
    assert (b1["w"], b1["w2"]) == pytest.approx((3.5, 1 + 4 + 0.25))
    assert b1["clipped"] == 1 and b1["masked"] == 0  # the padding's flags are not counted
    assert sums["4+"]["masked"] == 1 and sums["4+"]["staleness"] == 5

    stats = TrainTaskStats()  # two micro-batches of the same tokens add up
    stats.add({"offpolicy": sums})
    stats.add({"offpolicy": sums})
    fields = record_fields(stats.offpolicy)
    assert fields["offpolicy/1/tokens"] == 6
    assert fields["offpolicy/1/ess"] == pytest.approx(3.5 ** 2 / (3 * 5.25))  # 0.778
    assert fields["offpolicy/1/log_ratio"] == pytest.approx(0.0)
    assert fields["offpolicy/1/clipped"] == pytest.approx(1 / 3)
    assert fields["offpolicy/0/k3"] == pytest.approx(0.25 - 1 - math.log(0.25))
    assert fields["offpolicy/mismatch_k3"] == fields["offpolicy/0/k3"]
    assert fields["offpolicy/4+/masked"] == 1.0
    assert fields["offpolicy/token_staleness_mean"] == pytest.approx((0 + 1 + 2 + 5 + 1 + 1) / 6)
    total_w, total_w2 = sum(W) + 2.5, sum(x * x for x in W) + 4.25
    assert fields["offpolicy/ess"] == pytest.approx(total_w ** 2 / (6 * total_w2))
    # one token per bucket has ESS 1: no bucket is flagged, and bucket 1 (0.778) is above the bar
    assert fields["offpolicy/low_ess"] == 0 and lowest_ess_bucket(fields) is None
    skewed = record_fields({"2-3": {"tokens": 4, "w": 8.0 + 3 * 0.01, "w2": 64 + 3e-4}})
    assert skewed["offpolicy/low_ess"] == 1 and lowest_ess_bucket(skewed)[0] == "2-3"
    assert lowest_ess_bucket(skewed)[1] < LOW_ESS


def test_token_versions_line_up_with_the_response_mask():
    a = Sample(uid="a", prompt=None, prompt_ids=[1, 2], response_ids=[3, 4, 5], logprobs=[0.0] * 3,
               policy_version=4)
    b = Sample(uid="b", prompt=None, prompt_ids=[1], response_ids=[3, 4], logprobs=[0.0] * 2,
               policy_version=2, token_versions=[2, 3])
    v = token_versions([a, b], width=5)
    assert v.tolist() == [[0, 4, 4, 4], [2, 3, 0, 0]]


def test_a_trainer_without_diagnostics_leaves_the_record_without_them():
    stats = TrainTaskStats()
    stats.add({"samples": 2, "offpolicy": ["not", "a", "dict"]})  # a plugin's odd value is left out
    assert stats.offpolicy == {} and record_fields(stats.offpolicy) == {}


# -- runs: stale samples, really -------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("correction", ["none", "tis", "decoupled", "icepop", "geo_reject", "m2po"])
def test_a_run_at_staleness_two_records_its_tokens_by_staleness(correction, tiny_model, tmp_path, shared_cluster):
    # a reproducible engine decodes each step's groups with the version admitted for them, so
    # at max_staleness 2 the third step trains tokens exactly two versions old (a reward with
    # variance: an untrained model's flat groups would train no token)
    parity_recipe(tmp_path, tiny_model)
    proc = streamrl("recipe", "run", str(tmp_path / "tiny.toml"), *sets(
        "run.mode=async", "run.max_staleness=2", "run.steps=3", "engine.reproducible=true",
        f'algorithm={{name="grpo", off_policy={{correction="{correction}"}}}}', *shared_cluster.sets), "--plain")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    recs = read_records(run_dir)
    trained = [r for r in recs if "offpolicy/token_staleness_mean" in r]
    assert len(trained) == 3
    for r in trained:
        # every trained token is in one bucket, and the buckets agree with the samples' staleness
        buckets = {k.split("/")[1] for k in r if k.startswith("offpolicy/") and k.endswith("/tokens")}
        named = {0: "0", 1: "1", 2: "2-3", 3: "2-3"}
        assert buckets <= {named.get(s["staleness"], "4+") for s in r["sample_log"]}
        assert 0 < r["offpolicy/ess"] <= 1 and r["offpolicy/token_staleness_mean"] <= 2
    last = recs[-1]
    assert last["offpolicy/token_staleness_mean"] == 2 and "offpolicy/2-3/tokens" in last
    # the masks and truncation belong to their corrections
    masking = {"none": False, "tis": False, "decoupled": True, "icepop": True, "geo_reject": True, "m2po": True}
    for r in trained:
        for k, v in r.items():
            if k.endswith("/truncated"):
                assert correction == "tis" or v == 0
            if k.endswith("/masked"):
                assert masking[correction] or v == 0


@pytest.mark.parametrize("correction", ["none", "tis", "decoupled", "icepop", "geo_reject", "m2po"])
@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_a_token_far_off_its_behaviour_policy_keeps_the_loss_and_every_gradient_finite(correction, adv):
    # a token 99.9 nats likelier now than when it was sampled (a stale sample, a mismatched engine):
    # exp(new - old) is a float32 infinity, and its backward 0 * inf put NaN in every gradient --
    # also where the clip or the response mask leaves the token out -- and the step was refused
    new = torch.tensor([[-0.1, -0.5, -90.0]], requires_grad=True)
    old = torch.tensor([[-100.0, -0.5, -0.4]])
    ref = torch.tensor([[-0.1, -0.6, -1.0]])  # (the KL term: 89 nats below the reference at t=2)
    mask = torch.tensor([[0.0, 1.0, 1.0]])  # (the far token masked out, as a tool's output would be)
    for kl_coef, behaviour_kl in [(0.0, 0.0), (0.1, 0.0), (0.0, 0.1)]:
        algo = GRPO(GRPOConfig(clip=0.2, kl_coef=kl_coef, behaviour_kl=behaviour_kl,
                               off_policy={"correction": correction}))
        for m in (mask, torch.ones_like(mask)):
            per_sample, stats = algo.loss(new, old, ref if kl_coef else None, torch.tensor([adv]), m)
            (grad,) = torch.autograd.grad(per_sample.sum(), new)
            assert torch.isfinite(per_sample).all() and torch.isfinite(grad).all(), (kl_coef, behaviour_kl, m, grad)
            assert all(torch.isfinite(v).all() for k, v in stats.items() if k != TOKEN_FLAGS)
        if kl_coef:  # the KL term still pulls a token far below its reference up towards it, with
            # the pull it has at the bound (e^20 - 1 per nat, over the sample's 3 tokens)
            per_sample, _ = algo.loss(new, old, ref, torch.tensor([0.0]), torch.ones_like(mask))
            (grad,) = torch.autograd.grad(per_sample.sum(), new)
            assert grad[0, 2].item() == pytest.approx(-kl_coef * math.expm1(20.0) / 3, rel=1e-3)
        if behaviour_kl:  # the anchor pulls a token far likelier than when it was sampled down
            far = torch.tensor([[-0.1, -0.5, -70.0]], requires_grad=True)
            per_sample, _ = algo.loss(far, torch.tensor([[-0.1, -0.5, -99.0]]), None, torch.tensor([0.0]),
                                      torch.ones_like(mask))
            (grad,) = torch.autograd.grad(per_sample.sum(), far)
            assert grad[0, 2].item() == pytest.approx(behaviour_kl * math.expm1(20.0) / 3, rel=1e-3)
        # and the tokens within reach are untouched by the bound: t=1's gradient is the plain one
        plain = GRPO(GRPOConfig(clip=0.2, off_policy={"correction": correction}))
        per_sample, _ = plain.loss(new[:, 1:2], old[:, 1:2], None, torch.tensor([adv]), mask[:, 1:2])
        (near,) = torch.autograd.grad(per_sample.sum(), new)
        assert near[0, 1].item() == pytest.approx(-adv)
