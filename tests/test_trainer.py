"""The trainer in-process: response alignment, and gradient accumulation that does not depend on
how a batch is cut into micro-batches or in which order they arrive (stream == batch)."""

from __future__ import annotations

import random

import pytest
import torch

from streamrl.algorithms.grpo import GRPO, GRPOConfig
from streamrl.api import EngineCapabilities, TrainerContext
from streamrl.training.trainer import HFTrainer, HFTrainerConfig, pad_batch, token_logprobs
from tests.helpers import make_groups


def new_trainer(model_path):
    return HFTrainer(HFTrainerConfig(lr=1e-2), TrainerContext(str(model_path), GRPO(GRPOConfig()), EngineCapabilities(temperature=1.0)))


def test_response_mask_lines_up_with_logprobs(tiny_model):
    trainer = new_trainer(tiny_model)
    groups = make_groups(trainer, n_groups=1)
    # per-sample recomputation (no padding) equals the padded batch's masked positions
    ids, attn, resp, old = pad_batch(groups[0], trainer.tokenizer.pad_token_id)
    with torch.no_grad():
        batched = token_logprobs(trainer.model, ids, attn)
    for i, s in enumerate(groups[0]):
        assert resp[i].sum().item() == len(s.response_ids)
        assert torch.allclose(batched[i][resp[i] > 0], torch.tensor(s.logprobs), atol=1e-5)
        assert torch.allclose(old[i][resp[i] > 0], torch.tensor(s.logprobs))


def test_micro_batching_and_order_do_not_change_the_update(tiny_model):
    reference = new_trainer(tiny_model)
    groups = make_groups(reference)
    total = sum(len(g) for g in groups)

    def train(chunks):
        t = new_trainer(tiny_model)
        for chunk in chunks:
            t.micro_batch(chunk, scale=1.0 / total)
        grads = {n: p.grad.clone() for n, p in t.model.named_parameters()}
        t.step()
        return grads, {n: p.detach().clone() for n, p in t.model.named_parameters()}

    grads_b, whole = train([groups])                       # batch: one micro-batch, prompt order
    shuffled = groups[:]
    random.Random(1).shuffle(shuffled)
    grads_s, streamed = train([[g] for g in shuffled])     # stream: one group at a time, arrival order
    moved = max((whole[n] - p.detach()).abs().max().item() for n, p in reference.model.named_parameters())
    assert moved > 1e-3, "the step must change the parameters for this test to mean anything"
    for name in whole:
        # the accumulated gradient is the same up to float summation order ...
        assert torch.allclose(grads_b[name], grads_s[name], rtol=1e-4, atol=1e-7), name
        # ... and so is the AdamW step, whose size is ~lr per element. Adam's first step is
        # ~lr * g / |g|, so an entry whose gradient is summation noise (|g| ~ 1e-8, both orders
        # agreeing to the atol above) may move by anything up to a step: compare the step where
        # the gradient is well above that noise, and bound it by one step elsewhere
        clear = grads_b[name].abs() > 1e-6
        assert torch.allclose(whole[name][clear], streamed[name][clear], atol=0.02 * 1e-2), name
        assert (whole[name] - streamed[name]).abs().max().item() <= 2 * 1e-2 + 1e-6, name


def test_gae_spreads_the_final_reward_over_the_response_tokens():
    from streamrl.algorithms.ppo import PPO, PPOConfig

    ppo = PPO(PPOConfig(gamma=1.0, lam=0.5))
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]])  # a prompt position, 3 response tokens, padding
    values = torch.tensor([[9.0, 0.2, 0.4, 0.6, 9.0]])
    adv, ret = ppo.token_advantages(torch.tensor([1.0]), values, mask)
    # deltas: t3 = 1 - 0.6 = 0.4; t2 = 0.6 - 0.4 = 0.2; t1 = 0.4 - 0.2 = 0.2
    expected = [0.0, 0.2 + 0.5 * (0.2 + 0.5 * 0.4), 0.2 + 0.5 * 0.4, 0.4, 0.0]
    assert adv[0].tolist() == pytest.approx(expected)
    assert ret[0].tolist() == pytest.approx([0.0] + [a + v for a, v in zip(expected[1:4], [0.2, 0.4, 0.6])] + [0.0])
    # lam = 1, gamma = 1: the Monte-Carlo return minus the value, at every response token
    mc, _ = PPO(PPOConfig(gamma=1.0, lam=1.0)).token_advantages(torch.tensor([1.0]), values, mask)
    assert mc[0, 1:4].tolist() == pytest.approx([0.8, 0.6, 0.4])
    # an agent's tool result between two replies (mask 0 inside the response) is skipped, not
    # a restart: the first reply's tokens still see the final reward
    gap = torch.tensor([[0.0, 1.0, 0.0, 1.0, 0.0]])
    with_gap, _ = PPO(PPOConfig(gamma=1.0, lam=1.0)).token_advantages(torch.tensor([1.0]), values, gap)
    assert with_gap[0].tolist() == pytest.approx([0.0, 0.8, 0.0, 0.4, 0.0])


def test_ppo_trainer_fits_its_critic_and_reports_it(tiny_model):
    from streamrl.algorithms.ppo import PPO, PPOConfig

    # (weight decay and a learning-rate warm-up: the critic's warm-up moves neither the policy nor its schedule)
    trainer = HFTrainer(HFTrainerConfig(lr=1e-3, critic_lr=3e-3, weight_decay=0.1, warmup_steps=3),
                        TrainerContext(str(tiny_model), PPO(PPOConfig(critic_warmup_steps=2)), EngineCapabilities(temperature=1.0)))
    groups = make_groups(trainer)
    for g, group in enumerate(groups):  # a return the critic can learn: it depends on the prompt
        for s in group:
            s.reward = float(g % 2)
    before = {n: p.clone() for n, p in trainer.named_weights().items()}
    losses = []
    for _ in range(8):
        stats = trainer.micro_batch(groups, 1.0 / 24)
        losses.append(stats["value_loss_sum"] / stats["samples"])
        if trainer.version in (1, 2):  # the critic warmed up: the policy has not moved, nor its schedule
            assert all(torch.equal(before[n], p) for n, p in trainer.named_weights().items())
            assert trainer.lr_schedule.last_epoch == 0 and not trainer.optimizer.state
        out = trainer.step()
        assert out["critic_grad_norm"] > 0
    assert losses[-1] < 0.5 * losses[0], losses  # the critic learns the returns
    assert any(not torch.equal(before[n], p) for n, p in trainer.named_weights().items())  # then the policy moves
    assert "explained_variance_sum" in stats


@pytest.mark.parametrize("algorithm", ["ppo", "reinforce_pp"])
def test_a_checkpoint_restores_the_trainer_exactly(tiny_model, tmp_path, algorithm):
    """Save after one step, load into a fresh trainer; both take the same next step bit for bit."""
    from streamrl.algorithms.ppo import PPO, PPOConfig
    from streamrl.algorithms.reinforce_pp import ReinforcePP, ReinforcePPConfig

    def trainer():
        algo = PPO(PPOConfig()) if algorithm == "ppo" else ReinforcePP(ReinforcePPConfig())
        context = TrainerContext(str(tiny_model), algo, EngineCapabilities(temperature=1.0))
        return HFTrainer(HFTrainerConfig(lr=1e-3, warmup_steps=3), context)

    a = trainer()
    groups = make_groups(a, n_groups=2)

    a.micro_batch(groups, 1 / 8)
    a.step()
    a.save_checkpoint(str(tmp_path / "ckpt"))
    b = trainer()
    b.load_checkpoint(str(tmp_path / "ckpt"))
    assert b.version == a.version == 1 and b.lr_schedule.last_epoch == a.lr_schedule.last_epoch
    for t in (a, b):
        t.micro_batch(groups, 1 / 8)
        t.step()
    wa, wb = a.named_weights(), b.named_weights()
    assert all(torch.equal(wa[n], wb[n]) for n in wa)
    fresh = trainer()  # and the checkpoint carried state: a fresh trainer's step differs
    fresh.micro_batch(groups, 1 / 8)
    fresh.step()
    assert any(not torch.equal(fresh.named_weights()[n], wb[n]) for n in wb)
    # weights saved in one dtype are not loaded into another: DCP cast them without a word
    other = trainer()
    other.model.to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"embed_tokens.weight was saved as float32 and this trainer holds it as "
                                         r"bfloat16 \(trainer.precision or the model's dtype changed since\)"):
        other.load_checkpoint(str(tmp_path / "ckpt"))


def test_skipping_zero_advantage_groups_gives_the_same_update(tiny_model):
    def train(skip: bool, groups_of):
        trainer = new_trainer(tiny_model)
        trainer.algorithm.zero_advantage_no_gradient = skip
        groups = groups_of(trainer)
        stats = [trainer.micro_batch(groups[i:i + 2], 1.0 / 24) for i in range(0, len(groups), 2)]
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
        trainer.step()
        return grads, trainer.named_weights(), {k: sum(s[k] for s in stats)
                                                for k in ["samples", "tokens", "reward_sum", "skipped_sum"]}

    def some_flat(trainer):  # groups 0 and 1 (one whole micro-batch) and 4 have all-equal rewards
        groups = make_groups(trainer)
        for g, value in [(0, 1.0), (1, 0.0), (4, 1.0)]:
            for s in groups[g]:
                s.reward = value
        return groups

    skipped_grads, skipped, skipped_stats = train(True, some_flat)
    full_grads, full, full_stats = train(False, some_flat)
    # every sample still counted; the flat groups' samples really left out of the backward
    assert {**skipped_stats, "skipped_sum": 0} == full_stats and full_stats["skipped_sum"] == 0
    flat = [g for g in some_flat(new_trainer(tiny_model)) if len({s.reward for s in g}) == 1]
    assert len(flat) >= 3 and skipped_stats["skipped_sum"] == sum(len(g) for g in flat)
    initial = new_trainer(tiny_model).named_weights()
    assert max((full[n] - initial[n]).abs().max().item() for n in full) > 1e-3  # the step moved
    for n in full:  # the same gradient up to float summation order, so the same AdamW step
        assert torch.allclose(skipped_grads[n], full_grads[n], rtol=1e-4, atol=1e-7), n
        assert torch.allclose(skipped[n], full[n], atol=0.02 * 1e-2), n
    # a batch with no signal at all still steps AdamW as a zero gradient would
    a = train(True, lambda trainer: some_flat(trainer)[:2])
    b = train(False, lambda trainer: some_flat(trainer)[:2])
    assert all(torch.equal(a[0][n], b[0][n]) and torch.equal(a[1][n], b[1][n]) for n in a[1])


def test_a_step_that_trained_no_sample_moves_nothing_and_counts_as_a_version(tiny_model, tmp_path):
    # (a serving run stopped before any rewarded traffic came): weights, AdamW and the schedule stay
    trainer = HFTrainer(HFTrainerConfig(lr=1e-2, warmup_steps=4),
                        TrainerContext(str(tiny_model), GRPO(GRPOConfig()), EngineCapabilities(temperature=1.0)))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    lr_before = trainer.lr_schedule.get_last_lr()
    out = trainer.step()
    assert out["version"] == 1 and trainer.version == 1
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    assert trainer.lr_schedule.get_last_lr() == lr_before and not trainer.optimizer.state
    # a checkpoint written now leaves AdamW as it is, and a resume from it has it so too: DCP's
    # reading of an optimizer that never stepped stepped it, and the first update was the second's
    trainer.save_checkpoint(str(tmp_path / "ckpt"))
    assert not trainer.optimizer.state
    resumed = HFTrainer(HFTrainerConfig(lr=1e-2, warmup_steps=4),
                        TrainerContext(str(tiny_model), GRPO(GRPOConfig()), EngineCapabilities(temperature=1.0)))
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert not resumed.optimizer.state
    groups = make_groups(resumed)
    resumed.micro_batch(groups, 1.0 / sum(len(g) for g in groups))
    resumed.step()
    groups = make_groups(trainer)  # and a step that trains moves them as ever
    trainer.micro_batch(groups, 1.0 / sum(len(g) for g in groups))
    trainer.step()
    assert trainer.lr_schedule.get_last_lr() != lr_before
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    assert all(torch.equal(p, dict(resumed.model.named_parameters())[n]) for n, p in trainer.model.named_parameters())


@pytest.mark.parametrize("wrong", [lambda r: r[:-1], lambda r: [], lambda r: r + [0.5], lambda r: None,
                                   lambda r: ["a"] * len(r)])
def test_an_algorithm_whose_advantages_do_not_fit_its_group_stops_the_step_in_one_line(tiny_model, wrong):
    # one advantage short lined samples up with other samples' advantages and trained on it
    # without a word (and an empty list looked like a group with no signal)
    from streamrl.errors import RunStopped

    trainer = new_trainer(tiny_model)
    before = trainer.named_weights()
    right = trainer.algorithm.advantages
    trainer.algorithm.advantages = lambda rewards: wrong(list(right(rewards)))
    with pytest.raises(RunStopped, match=r"algorithm GRPO: advantages\(\) gave .* for a group of 4 samples; "
                                         "expected one number per sample"):
        trainer.micro_batch(make_groups(trainer), 1.0 / 24)
    assert all(torch.equal(w, before[n]) for n, w in trainer.named_weights().items())


def test_a_micro_batch_without_a_trainable_token_adds_nothing_and_does_not_stop_the_run(tiny_model):
    # empty responses, or an agent's turn whose tokens are all tool output (loss_mask 0): the
    # chunked log-probs computed no position and came back without a gradient, which the trainer
    # took for an algorithm's mistake and stopped the run
    from streamrl.sample import Prompt, Sample

    trainer = new_trainer(tiny_model)
    ids = [trainer.tokenizer.bos_token_id] + trainer.tokenizer("1+2=", add_special_tokens=False).input_ids
    prompt = Prompt(uid="0-0", text="1+2=", answer="3")
    empty = [Sample(uid=f"0-0-{k}", prompt=prompt, prompt_ids=ids, response_ids=[], logprobs=[], reward=float(k))
             for k in range(2)]
    masked = [Sample(uid=f"0-1-{k}", prompt=prompt, prompt_ids=ids, response_ids=[5, 6], logprobs=[-1.0, -1.0],
                     loss_mask=[0, 0], reward=float(k)) for k in range(2)]
    for group in (empty, masked):
        out = trainer.micro_batch([group], 1.0 / 4)
        assert out["samples"] == 2 and out["loss_sum"] == 0.0
        assert all(p.grad is None or not p.grad.any() for p in trainer.model.parameters())
    assert trainer.step()["version"] == 1


def test_later_epochs_train_the_first_passs_advantages_and_count_each_group_once(tiny_model):
    # REINFORCE++'s running statistics took every group once per epoch, so a sample's advantage
    # changed from one epoch to the next; PPO's value clip was measured from the values of the
    # pass itself (old_values = values.detach()), so it never clipped
    from streamrl.algorithms.ppo import PPO, PPOConfig
    from streamrl.algorithms.reinforce_pp import ReinforcePP, ReinforcePPConfig

    rpp = HFTrainer(HFTrainerConfig(lr=1e-2), TrainerContext(str(tiny_model), ReinforcePP(ReinforcePPConfig(epochs=3)),
                                                            EngineCapabilities(temperature=1.0)))
    groups = make_groups(rpp)
    seen = []
    real = rpp.algorithm.advantages
    rpp.algorithm.advantages = lambda rewards: seen.append(list(rewards)) or real(rewards)
    for _ in range(2):  # two steps of three epochs
        for _ in range(3):
            rpp.micro_batch(groups, 1.0 / 24)
            rpp.step()
    assert rpp.algorithm.n == 2 * 24 and len(seen) == 2 * len(groups)  # once per step, not per epoch
    assert rpp.first is None  # (nothing kept past a step)

    ppo = HFTrainer(HFTrainerConfig(lr=1e-2, critic_lr=1e-1),
                    TrainerContext(str(tiny_model), PPO(PPOConfig(epochs=2, value_clip=0.01, critic_warmup_steps=0)),
                                   EngineCapabilities(temperature=1.0)))
    groups = make_groups(ppo)
    calls = []
    value_loss = ppo.algorithm.value_loss
    ppo.algorithm.value_loss = lambda v, old, ret, m: calls.append((v.detach().clone(), old.clone(), m)) or \
        value_loss(v, old, ret, m)
    ppo.micro_batch(groups, 1.0 / 24)
    ppo.step()
    ppo.micro_batch(groups, 1.0 / 24)
    (v1, old1, mask), (v2, old2, _) = calls
    on = mask > 0
    assert torch.equal(old1[on], v1[on]) and torch.equal(old2[on], v1[on])  # epoch 2 clips around epoch 1's values
    assert (v2[on] - v1[on]).abs().max() > 0.01  # (the critic moved past the clip: the clip binds)


def test_the_models_own_dropout_is_off_in_training_so_its_log_probs_are_the_engines(tiny_model, tmp_path):
    # a model configured with dropout (GPT-2, OPT, Phi: 0.1) trained with it on: its log-probs of
    # the weights that sampled were noise away from the engine's, a ratio off 1 on-policy
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from streamrl.training.logprobs import naive_token_logprobs

    dropped = tmp_path / "dropout"
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model.config.attention_dropout = 0.5
    model.save_pretrained(dropped)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(dropped)
    trainer = HFTrainer(HFTrainerConfig(precision="fp32"), TrainerContext(str(dropped), GRPO(GRPOConfig()),
                                                                           EngineCapabilities(temperature=1.0)))
    assert trainer.model.training
    samples = [s for g in make_groups(trainer) for s in g]
    ids, attn, resp, _ = pad_batch(samples, trainer.tokenizer.pad_token_id)
    with torch.no_grad():
        first, second = (naive_token_logprobs(trainer.model, ids, attn) for _ in range(2))
        evaluated = naive_token_logprobs(model.eval(), ids, attn)
    assert torch.equal(first, second) and torch.allclose(first[resp > 0], evaluated[resp > 0], atol=1e-5)
    from streamrl.algorithms.ppo import PPO, PPOConfig  # (and a critic's values, without noise either)

    critic = HFTrainer(HFTrainerConfig(precision="fp32"), TrainerContext(str(dropped), PPO(PPOConfig()),
                                                                          EngineCapabilities(temperature=1.0))).critic
    with torch.no_grad():
        torch.nn.init.normal_(critic.head.weight)  # (its head starts at zero: every value 0, dropout or not)
        assert critic.training and torch.equal(critic.values(ids, attn), critic.values(ids, attn))


def test_the_reference_models_forward_is_told_done_so_a_sharded_one_lets_its_weights_go(tiny_model):
    # FSDP keeps a root's weights gathered after a forward for the backward it expects; the frozen
    # reference's never comes, and its whole weights stayed gathered on every rank (the policy's
    # probe already said so; the reference did not)
    config = HFTrainerConfig(lr=1e-3, precision="fp32")
    trainer = HFTrainer(config, TrainerContext(str(tiny_model), GRPO(GRPOConfig(kl_coef=0.1)),
                                               EngineCapabilities(temperature=1.0)), device="cpu")
    assert trainer.reference_policy is not None
    done = []
    trainer.strategy.forward_only_done = done.append
    trainer.micro_batch(make_groups(trainer), 1.0 / 24)
    assert trainer.reference_policy in done and trainer.policy not in done


def test_a_tokenizer_without_a_pad_token_trains(tiny_model, tmp_path):
    # GPT-2's, Llama 3's and Mistral's tokenizers name no pad token: the engines decoded with
    # them, and the trainer's first batch failed (torch.full of None); the masks come from the
    # rows' lengths, so any token pads
    import json
    import shutil

    folder = tmp_path / "no-pad"
    shutil.copytree(tiny_model, folder)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = folder / name
        if path.exists():
            config = json.loads(path.read_text())
            config.pop("pad_token", None)
            path.write_text(json.dumps(config))
    trainer = new_trainer(folder)
    assert trainer.tokenizer.pad_token_id is None
    groups = make_groups(trainer)
    trainer.micro_batch(groups, 1.0 / 24)
    stats = trainer.step()
    assert trainer.version == 1 and stats is not None


def test_weight_decay_is_the_recipes_for_the_critic_too_and_on_a_resume(tiny_model, tmp_path):
    from streamrl.algorithms.ppo import PPO, PPOConfig

    def trainer(decay: float) -> HFTrainer:
        return HFTrainer(HFTrainerConfig(lr=1e-3, weight_decay=decay),
                         TrainerContext(str(tiny_model), PPO(PPOConfig()), EngineCapabilities(temperature=1.0)))

    def decays(t: HFTrainer) -> set[float]:
        return {g["weight_decay"] for o in (t.optimizer, t.critic.optimizer) for g in o.param_groups}

    a = trainer(0.0)
    assert decays(a) == {0.0}  # (torch's AdamW alone decays by 0.01)
    a = trainer(0.1)
    a.micro_batch(make_groups(a, n_groups=2), 1 / 8)
    a.step()
    a.save_checkpoint(str(tmp_path / "ckpt"))
    b = trainer(0.0)  # resumed with --set trainer.weight_decay=0: the checkpoint's 0.1 is not kept
    b.load_checkpoint(str(tmp_path / "ckpt"))
    assert decays(b) == {0.0} and b.optimizer.state


def test_a_sample_without_the_engines_log_probs_stops_the_step_in_one_line(tiny_model):
    # (a plugin engine that gives none, as the simulated one does): a shape error naming nothing before
    from streamrl.errors import RunStopped

    trainer = HFTrainer(HFTrainerConfig(lr=1e-3),
                        TrainerContext(str(tiny_model), GRPO(GRPOConfig()), EngineCapabilities(temperature=1.0)))
    groups = make_groups(trainer, n_groups=2)
    groups[1][0].reward, groups[1][2].logprobs = 7.0, []  # (not a flat group: it is trained)
    uid, n = groups[1][2].uid, len(groups[1][2].response_ids)
    with pytest.raises(RunStopped, match=f"^trainer: sample '{uid}' has {n} response tokens and 0 log-probs; this trainer"):
        trainer.micro_batch(groups, 1 / 8)
