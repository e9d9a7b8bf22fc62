"""DPO: pair advantages of a group, the pairwise loss against the reference, training the real
``hf`` trainer on fixed preference pairs, and a recipe that names it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from streamrl.algorithms.dpo import DPO, DPOConfig
from streamrl.api import EngineCapabilities, TrainerContext
from streamrl.sample import Prompt, Sample

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "tiny-addition-1d"


# -- advantages ---------------------------------------------------------------------------------

def test_advantages_mark_the_best_and_the_worst_sample_of_a_group():
    algo = DPO(DPOConfig())
    assert algo.advantages([0.0, 1.0, 0.5]) == [-1.0, 1.0, 0.0]
    assert algo.advantages([1.0, 0.0]) == [1.0, -1.0]
    # ties: the first highest is chosen, the first lowest rejected
    assert algo.advantages([0.0, 1.0, 0.0, 1.0]) == [-1.0, 1.0, 0.0, 0.0]
    assert algo.advantages([0.2, 0.9, -3.0, 0.9, -3.0]) == [0.0, 1.0, -1.0, 0.0, 0.0]
    # all equal (or alone): no pair, nothing learned
    assert algo.advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    assert algo.advantages([0.7]) == [0.0]


def test_class_contract():
    algo = DPO(DPOConfig(epochs=3))
    assert algo.needs_reference and algo.zero_advantage_no_gradient
    assert algo.min_group_size == 2 and algo.epochs == 3 and not algo.needs_critic
    with pytest.raises(ValueError):
        DPOConfig(beta=0.0)
    with pytest.raises(ValueError):
        DPOConfig(label_smoothing=0.5)
    with pytest.raises(ValueError):
        DPOConfig(lr=1.0)  # extra="forbid"


# -- loss ---------------------------------------------------------------------------------------

# row 0: z = (-0.5 + 1) + (-1 + 1) = 0.5 (the third token is masked); row 1: z = -2 + 1 = -1
NEW = [[-0.5, -1.0, -9.0], [-2.0, -7.0, -7.0]]
REF = [[-1.0, -1.0, 0.0], [-1.0, 0.0, 0.0]]
MASK = [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))  # -logsigmoid(-x)


@pytest.mark.parametrize("ls", [0.0, 0.2])
def test_loss_is_the_dpo_loss_of_the_pair_on_the_chosen_sample(ls):
    beta = 0.5
    algo = DPO(DPOConfig(beta=beta, label_smoothing=ls))
    new = torch.tensor(NEW, requires_grad=True)
    # old is never read: DPO is off-policy (NaN would poison any use of it)
    old = torch.full((2, 3), float("nan"))
    per_sample, stats = algo.loss(new, old, torch.tensor(REF), torch.tensor([1.0, -1.0]), torch.tensor(MASK))
    d = beta * (0.5 - (-1.0))  # 0.75
    expected = (1 - ls) * softplus(-d) + ls * softplus(d)
    assert per_sample.shape == (2,)
    assert per_sample[0].item() == pytest.approx(expected, rel=1e-6)
    assert per_sample[1].item() == 0.0
    # (twice the pair's: a step divides by the samples trained, the pair's two)
    assert stats["reward_margin_sum"].item() == pytest.approx(2 * d)
    assert stats["pair_accuracy_sum"].item() == 2.0 and stats["pairs_sum"].item() == 1.0
    assert not any(v.requires_grad for v in stats.values())


def test_gradient_raises_the_chosen_and_lowers_the_rejected_response():
    algo = DPO(DPOConfig(beta=0.5))
    new = torch.tensor(NEW, requires_grad=True)
    mask = torch.tensor(MASK)
    per_sample, _ = algo.loss(new, torch.zeros(2, 3), torch.tensor(REF), torch.tensor([1.0, -1.0]), mask)
    per_sample.sum().backward()
    g = new.grad
    assert (g[0][mask[0] > 0] < 0).all()  # descent raises the chosen tokens' logprobs
    assert (g[1][mask[1] > 0] > 0).all()  # ... and lowers the rejected ones'
    assert (g[mask == 0] == 0).all()
    # d(-logsigmoid(d))/dz_c = -beta * sigmoid(-d), the same on every response token
    assert torch.allclose(g[0][:2], torch.full((2,), -0.5 * torch.sigmoid(torch.tensor(-0.75)).item()))


def test_chosen_after_rejected_in_a_group_pairs_the_same():
    algo = DPO(DPOConfig(beta=0.5))
    first, _ = algo.loss(torch.tensor(NEW), torch.zeros(2, 3), torch.tensor(REF), torch.tensor([1.0, -1.0]),
                         torch.tensor(MASK))
    swapped, _ = algo.loss(torch.tensor(NEW[::-1]), torch.zeros(2, 3), torch.tensor(REF[::-1]),
                           torch.tensor([-1.0, 1.0]), torch.tensor(MASK[::-1]))
    assert swapped[0].item() == 0.0
    assert swapped[1].item() == pytest.approx(first[0].item(), rel=1e-6)


def test_two_groups_in_one_micro_batch_pair_within_their_groups():
    algo = DPO(DPOConfig(beta=0.3, label_smoothing=0.1))
    torch.manual_seed(0)
    new, ref = -torch.rand(4, 5) * 3, -torch.rand(4, 5) * 3
    mask = (torch.rand(4, 5) > 0.3).float()
    mask[:, 0] = 1.0
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])  # group A: chosen, rejected; group B: rejected, chosen
    together, stats = algo.loss(new, None, ref, adv, mask)
    a, stats_a = algo.loss(new[:2], None, ref[:2], adv[:2], mask[:2])
    b, stats_b = algo.loss(new[2:], None, ref[2:], adv[2:], mask[2:])
    assert torch.allclose(together, torch.cat([a, b]))
    assert together[1] == 0 and together[2] == 0 and together[0] > 0 and together[3] > 0
    for key in stats:
        assert stats[key].item() == pytest.approx(stats_a[key].item() + stats_b[key].item(), rel=1e-6)
    assert stats["pairs_sum"].item() == 2.0
    # a sample outside any pair (advantage 0, if a trainer keeps it) is ignored
    with_neutral, _ = algo.loss(torch.cat([new[:1], new[2:3], new[1:2]]), None,
                                torch.cat([ref[:1], ref[2:3], ref[1:2]]), torch.tensor([1.0, 0.0, -1.0]),
                                torch.cat([mask[:1], mask[2:3], mask[1:2]]))
    assert torch.allclose(with_neutral, torch.stack([a[0], torch.tensor(0.0), torch.tensor(0.0)]))


def test_unpaired_advantages_are_refused():
    algo = DPO(DPOConfig())
    with pytest.raises(ValueError, match="as many chosen"):
        algo.loss(torch.zeros(3, 2), None, torch.zeros(3, 2), torch.tensor([1.0, -1.0, 1.0]), torch.ones(3, 2))


def test_empty_pass_is_a_finite_zero_in_the_graph():
    # the trainer's empty pass: one dummy sample, advantage zeros(1), backward of sum * 0
    algo = DPO(DPOConfig())
    new = torch.tensor([[-1.5, -0.2]], requires_grad=True)
    per_sample, _ = algo.loss(new, torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1), torch.tensor([[0.0, 1.0]]))
    assert per_sample.shape == (1,) and per_sample.item() == 0.0
    assert per_sample.requires_grad
    (per_sample.sum() * 0.0).backward()
    assert torch.equal(new.grad, torch.zeros(1, 2))


# -- the real trainer ---------------------------------------------------------------------------

def _group(trainer, uid: str, a: int, b: int, responses: list[tuple[str, float]]):
    tok = trainer.tokenizer
    prompt = Prompt(uid=uid, text=f"{a}+{b}=", answer=str(a + b))
    ids = [tok.bos_token_id] + tok(prompt.text, add_special_tokens=False).input_ids
    group = []
    for k, (text, reward) in enumerate(responses):
        resp = tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id]
        s = Sample(uid=f"{uid}-{k}", prompt=prompt, prompt_ids=ids, response_ids=resp, logprobs=[0.0] * len(resp),
                   reward=reward)
        s.logprobs = trainer.logprobs([s])[0]  # as if the trainer's policy had generated it
        group.append(s)
    return group


def _margins(trainer, groups):
    """Summed logprob of each group's chosen response minus its rejected one's."""
    out = []
    for g in groups:
        total = [sum(lp) for lp in trainer.logprobs(g)]
        rewards = [s.reward for s in g]
        out.append(total[rewards.index(max(rewards))] - total[rewards.index(min(rewards))])
    return out


def test_hf_trainer_learns_the_preferred_response_against_a_fixed_reference():
    from streamrl.training.trainer import HFTrainer, HFTrainerConfig

    algo = DPO(DPOConfig(beta=0.5))
    trainer = HFTrainer(HFTrainerConfig(lr=2e-3, precision="fp32"),
                        TrainerContext(str(MODEL), algo, EngineCapabilities(temperature=1.0)), device="cpu")
    assert trainer.reference is not None
    # groups of 2 to 4, the chosen sample anywhere in its group; a wrong answer is rewarded over
    # the right one in one group, so the margin cannot grow just by the model getting better at sums
    groups = [
        _group(trainer, "0", 12, 34, [("46", 1.0), ("47", 0.0)]),
        _group(trainer, "1", 5, 7, [("13", 0.0), ("12", 1.0), ("11", 0.5)]),
        _group(trainer, "2", 20, 21, [("40", 0.0), ("41", 0.5), ("43", 0.5), ("41", 1.0)]),
        _group(trainer, "3", 3, 3, [("6", 0.0), ("7", 1.0)]),
    ]
    total = sum(len(g) for g in groups)
    ref_before = {n: p.detach().clone() for n, p in trainer.reference.named_parameters()}
    before = _margins(trainer, groups)
    for step in range(6):
        stats = trainer.micro_batch(groups[:2], scale=1.0 / total)
        more = trainer.micro_batch(groups[2:], scale=1.0 / total)
        assert stats["pairs_sum"] == 2.0 and more["pairs_sum"] == 2.0
        assert stats["skipped_sum"] == 1 and more["skipped_sum"] == 2  # samples outside the pairs
        trainer.step()
    after = _margins(trainer, groups)
    for b, a in zip(before, after):
        assert a > b + 0.5, (before, after)
    # the loss's log-ratio to the reference is the growth of the margin: the reference is where
    # the policy started, and every pair is now ahead of it
    final = trainer.micro_batch(groups, scale=1.0 / total)
    assert final["pair_accuracy_sum"] == 8.0  # (twice the pairs': see above)
    assert final["reward_margin_sum"] == pytest.approx(sum(a - b for a, b in zip(after, before)), rel=1e-3)
    for n, p in trainer.reference.named_parameters():
        assert torch.equal(p, ref_before[n]), n
    # a group whose rewards are all equal has no pair; the empty pass (a rank with nothing to
    # train: one dummy sample, advantage 0) runs the loss and backward and adds no gradient
    trainer.optimizer.zero_grad(set_to_none=False)
    flat = _group(trainer, "4", 1, 1, [("2", 1.0), ("3", 1.0)])
    out = trainer.micro_batch([flat], scale=0.5)
    assert out["loss_sum"] == 0.0 and out["skipped_sum"] == 2
    out = trainer.micro_batch([], scale=0.5)
    assert out["samples"] == 0 and out["loss_sum"] == 0.0
    assert all(p.grad is not None and not p.grad.any() for p in trainer.model.parameters())


# -- recipes ------------------------------------------------------------------------------------

def test_a_recipe_names_dpo(capsys, tiny_recipe):
    from streamrl.cli import main
    from streamrl.plugins.resolve import resolve
    from streamrl.recipe.recipe import load_recipe

    text = tiny_recipe.read_text() + '\n[algorithm]\nname = "dpo"\nbeta = 0.05\nlabel_smoothing = 0.1\n'
    tiny_recipe.write_text(text)
    assert main(["recipe", "validate", str(tiny_recipe)]) == 0, capsys.readouterr().err
    resolved = resolve(load_recipe(tiny_recipe))
    algo = resolved.algorithm.build()
    assert isinstance(algo, DPO) and algo.config.beta == 0.05 and algo.config.label_smoothing == 0.1
    # a pair needs two samples of a prompt; an unknown option is refused
    assert main(["recipe", "validate", str(tiny_recipe), "--set", "trainer.samples_per_prompt=1"]) == 2
    assert "samples_per_prompt" in capsys.readouterr().err
    assert main(["recipe", "validate", str(tiny_recipe), "--set", "algorithm.clip=0.2"]) == 2
    assert "algorithm.clip" in capsys.readouterr().err


def test_nll_coef_adds_the_chosen_responses_mean_token_nll():
    """RPO: the pair's loss gains ``-nll * mean_t logp_chosen``, on the chosen sample only, and
    its gradient raises every chosen token by ``nll / tokens`` more than plain DPO does."""
    new = torch.tensor(NEW, requires_grad=True)
    args = (torch.zeros(2, 3), torch.tensor(REF), torch.tensor([1.0, -1.0]), torch.tensor(MASK))
    plain, _ = DPO(DPOConfig(beta=0.5)).loss(new, *args)
    rpo, _ = DPO(DPOConfig(beta=0.5, nll_coef=2.0)).loss(new, *args)
    assert rpo[0].item() == pytest.approx(plain[0].item() + 2.0 * (0.5 + 1.0) / 2, rel=1e-6)  # chosen: mean of -0.5, -1
    assert rpo[1].item() == 0.0
    (g_plain,) = torch.autograd.grad(plain.sum(), new)
    (g_rpo,) = torch.autograd.grad(rpo.sum(), new)
    assert torch.allclose(g_rpo[0, :2] - g_plain[0, :2], torch.full((2,), -1.0))  # -2.0 / 2 tokens
    assert torch.equal(g_rpo[1], g_plain[1]) and g_rpo[0, 2] == 0  # rejected and masked untouched
