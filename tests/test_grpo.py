"""GRPO's math: group-normalised advantages and the clipped surrogate."""

from __future__ import annotations

import pytest
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


def test_off_policy_cap_weights_stale_tokens_by_the_capped_behaviour_ratio():
    # the trainer's policy gives the token 3x the probability the (stale) generating policy gave
    new = torch.zeros(1, 2, requires_grad=True)
    old = torch.full((1, 2), -torch.log(torch.tensor(3.0)).item())
    mask = torch.ones(1, 2)
    adv = torch.tensor([1.0])

    plain, _ = GRPO(GRPOConfig(clip=0.2)).loss(new, old, None, adv, mask)
    (g_plain,) = torch.autograd.grad(plain.sum(), new)
    # plain GRPO: ratio 3 is clipped at 1.2 for A > 0, so the stale sample teaches nothing
    assert torch.allclose(g_plain, torch.zeros(1, 2))

    decoupled, stats = GRPO(GRPOConfig(clip=0.2, off_policy_cap=2.0)).loss(new, old, None, adv, mask)
    (g,) = torch.autograd.grad(decoupled.sum(), new)
    # decoupled: gradient of -A * w * ratio_prox with ratio_prox = 1, w = min(3, 2) = 2, token mean
    assert torch.allclose(g, torch.full((1, 2), -2.0 * 1.0 / 2))
    assert torch.isclose(stats["behaviour_weight_sum"], torch.tensor(2.0))


def test_off_policy_cap_is_plain_policy_gradient_on_fresh_samples():
    new = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_()
    old = new.detach().clone()
    mask, adv = torch.ones(1, 2), torch.tensor([-0.7])
    a, _ = GRPO(GRPOConfig()).loss(new, old, None, adv, mask)
    b, _ = GRPO(GRPOConfig(off_policy_cap=2.0)).loss(new, old, None, adv, mask)
    (ga,) = torch.autograd.grad(a.sum(), new)
    (gb,) = torch.autograd.grad(b.sum(), new)
    assert torch.allclose(a, b) and torch.allclose(ga, gb)


def test_rloo_dr_grpo_and_reinforce_pp_advantages():
    from streamrl.algorithms.dr_grpo import DrGRPO, DrGRPOConfig
    from streamrl.algorithms.reinforce_pp import ReinforcePP, ReinforcePPConfig
    from streamrl.algorithms.rloo import RLOO, RLOOConfig

    assert RLOO(RLOOConfig()).advantages([1.0, 0.0, 0.0]) == [1.0, -0.5, -0.5]
    assert DrGRPO(DrGRPOConfig()).advantages([1.0, 0.0, 0.0, 1.0]) == [0.5, -0.5, -0.5, 0.5]  # no std
    rpp = ReinforcePP(ReinforcePPConfig())
    first = rpp.advantages([1.0, 0.0, 0.0, 1.0])
    assert first == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)  # centred, then unit std
    # the normalisation is global: a later group is scaled by the statistics of everything seen
    later = rpp.advantages([1.0, 1.0, 1.0, 0.0])
    centred = [0.25, 0.25, 0.25, -0.75]
    seen = [0.5, -0.5, -0.5, 0.5] + centred
    mu = sum(seen) / 8
    sd = (sum((x - mu) ** 2 for x in seen) / 8) ** 0.5
    assert later == pytest.approx([(x - mu) / sd for x in centred], abs=1e-5)


def test_dr_grpo_loss_is_token_level():
    from streamrl.algorithms.dr_grpo import DrGRPO, DrGRPOConfig

    new = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    per_sample, _ = DrGRPO(DrGRPOConfig(max_tokens=4)).loss(new, torch.zeros(2, 3), None,
                                                            torch.tensor([1.0, -1.0]), mask)
    # ratio 1: each token contributes -A; the sums (-2 and +1) are divided by L_max = 4, not by length
    assert per_sample.tolist() == pytest.approx([-0.5, 0.25])


@pytest.mark.parametrize("rewards", [[0.7] * 8, [890.62] * 3, [0.1] * 5, [-1e6] * 4, [1 / 3] * 6])
def test_a_group_of_equal_rewards_gets_exact_zeros_from_every_group_baseline(rewards):
    # computed, the mean of equal values can be an ulp off while their std is exactly 0: GRPO gave
    # [0.7] * 8 an advantage of 0.056 each, the whole group pushed one way by rounding, and the
    # trainer's skip of zero-advantage samples never fired for it
    from streamrl.algorithms.dr_grpo import DrGRPO, DrGRPOConfig
    from streamrl.algorithms.reinforce_pp import ReinforcePP, ReinforcePPConfig
    from streamrl.algorithms.rloo import RLOO, RLOOConfig

    rpp = ReinforcePP(ReinforcePPConfig())
    rpp.advantages([1.0, 0.0, 0.0, 1.0])  # (running statistics away from zero)
    for algo in (GRPO(GRPOConfig()), GRPO(GRPOConfig(scale_rewards=False)), RLOO(RLOOConfig()),
                 DrGRPO(DrGRPOConfig()), rpp):
        assert algo.advantages(list(rewards)) == [0.0] * len(rewards), type(algo).__name__


def test_grpo_advantages_are_torchs_normalisation_in_double_precision():
    rewards = [0.3, 0.7, 0.7, 0.1, 1e-3, 2.5]
    r = torch.tensor(rewards, dtype=torch.float64)
    expected = ((r - r.mean()) / (r.std() + 1e-6)).tolist()
    assert GRPO(GRPOConfig()).advantages(rewards) == pytest.approx(expected, rel=1e-12)
    assert GRPO(GRPOConfig(scale_rewards=False)).advantages(rewards) == pytest.approx((r - r.mean()).tolist())
    assert GRPO(GRPOConfig()).advantages([0.5]) == [0.0]  # a sample alone: no baseline


def test_dr_grpo_whose_l_max_is_not_the_generation_budget_is_warned_about():
    # its loss divides each sample's token sum by max_tokens (default 16): set to anything but the
    # engine's max_new_tokens, every step's loss was that much off the paper's, without a word
    from tests.helpers import ROOT, streamrl

    off = streamrl("recipe", "validate", str(ROOT / "recipes" / "ppo.toml"), "--set", 'algorithm={name="dr_grpo"}')
    assert off.returncode == 0 and ("algorithm 'dr_grpo': max_tokens = 16 (L_max, each sample's token sum is divided "
                                    "by it) is not the engine's max_new_tokens = 4") in off.stderr, off.stderr
    fits = streamrl("recipe", "validate", str(ROOT / "recipes" / "ppo.toml"), "--set",
                    'algorithm={name="dr_grpo", max_tokens=4}')
    assert fits.returncode == 0 and "dr_grpo" not in fits.stderr, fits.stderr


def test_an_agents_rollout_split_into_segments_is_one_rollout_in_its_groups_baseline():
    # rollout 0 split in two segments (uids 7-0 and 7-0.1, the rollout's reward on each), rollout
    # 1 whole: the baseline is over rollouts, and every segment trains the rollout's advantage
    from streamrl.algorithms.dpo import DPO, DPOConfig
    from streamrl.algorithms.rloo import RLOO, RLOOConfig
    from streamrl.sample import Prompt, Sample
    from streamrl.training.backward_pass import advantages, rollouts

    prompt = Prompt(uid="7", text="x")
    group = [Sample(uid=uid, prompt=prompt, prompt_ids=[1], response_ids=[2], logprobs=[-0.5], reward=r)
             for uid, r in (("7-0", 1.0), ("7-0.1", 1.0), ("7-1", 0.0), ("7-2", 0.5))]
    assert rollouts(group) == [[0, 1], [2], [3]]
    assert advantages(RLOO(RLOOConfig()), group) == pytest.approx([0.75, 0.75, -0.75, 0.0])
    grpo = advantages(GRPO(GRPOConfig()), group)
    assert grpo[0] == grpo[1] > 0 > grpo[2] and grpo[3] == pytest.approx(0.0, abs=1e-6)
    # DPO's pair: the chosen rollout's last segment (its answer) and the rejected rollout
    assert advantages(DPO(DPOConfig()), group) == [0.0, 1.0, -1.0, 0.0]
    # uids that only look like segments (no first segment in the group) are rollouts of their own
    loose = [Sample(uid=u, prompt=prompt, prompt_ids=[1], response_ids=[2], logprobs=[-0.5], reward=r)
             for u, r in (("a.1", 1.0), ("b.1", 0.0))]
    assert rollouts(loose) == [[0], [1]]
