"""GRPO's math: group-normalised advantages and the clipped surrogate."""

from __future__ import annotations

import torch

from streamrl.algorithms.grpo import GRPO, GRPOConfig


def test_advantages_are_group_normalised():
    adv = GRPO(GRPOConfig()).advantages([1.0, 0.0, 0.0, 1.0])
    assert abs(sum(adv)) < 1e-6
    assert adv[0] > 0 > adv[1]
    assert abs(torch.tensor(adv).std().item() - 1.0) < 1e-4


def test_equal_rewards_give_no_signal():
    assert GRPO(GRPOConfig()).advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]


def test_loss_is_token_mean_and_clipped():
    algo = GRPO(GRPOConfig(clip=0.2))
    old = torch.zeros(2, 3)
    new = torch.log(torch.tensor([[2.0, 1.0, 1.0], [0.5, 1.0, 1.0]]))  # ratios 2 and 0.5 at t=0
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    per_sample, stats = algo.loss(new, old, None, adv, mask)
    # sample 0: A>0, ratio 2 clipped to 1.2 at t0, ratio 1 at t1 -> -(1.2 + 1)/2
    # sample 1: A<0, ratio .5 -> min(-.5, -.8) = -.8 -> loss .8
    assert torch.allclose(per_sample, torch.tensor([-1.1, 0.8]))
    assert abs(stats["clip_frac_sum"].item() - (0.5 + 1.0)) < 1e-6


def test_kl_penalty_needs_reference_and_is_zero_at_reference():
    algo = GRPO(GRPOConfig(kl_coef=0.1))
    assert algo.needs_reference
    lp = torch.log(torch.full((1, 2), 0.3))
    per_sample, stats = algo.loss(lp, lp, lp, torch.tensor([0.0]), torch.ones(1, 2))
    assert per_sample.item() == 0.0 and stats["kl_sum"].item() == 0.0
