"""LoRA learners (``[trainer] lora``): only the adapter learns, what the trainer publishes is the
merged policy under the plain model's names, ``policy/`` loads with transformers (merged) and
peft (the adapter) and gives the trainer's log-probs, and a run trains with it."""

from __future__ import annotations

import pytest
import torch

from streamrl.algorithms.grpo import GRPO, GRPOConfig
from streamrl.api import EngineCapabilities, TrainerContext
from streamrl.training.hf_config import HFTrainerConfig
from streamrl.training.lora import merged_weights
from streamrl.training.logprobs import naive_token_logprobs, pad_batch
from streamrl.training.trainer import HFTrainer
from tests.helpers import make_groups, read_records, sets, streamrl


def lora_trainer(model, **lora) -> HFTrainer:
    config = HFTrainerConfig(lr=5e-2, precision="fp32", lora={"rank": 4, "alpha": 8, **lora})
    return HFTrainer(config, TrainerContext(str(model), GRPO(GRPOConfig()), EngineCapabilities(temperature=1.0)),
                     device="cpu")


def assert_merged_gives_the_trainers_logprobs(trainer, plain, merged, groups) -> None:
    """``merged`` loaded into the plain model ``plain`` gives the trainer's own log-probs of ``groups``."""
    plain.load_state_dict(merged, strict=False)
    samples = [s for g in groups for s in g]
    ids, attn, resp, _ = pad_batch(samples, trainer.tokenizer.pad_token_id)
    with torch.no_grad():
        ours = naive_token_logprobs(trainer.model.eval(), ids, attn)
        theirs = naive_token_logprobs(plain.eval(), ids, attn)
    assert torch.allclose(ours[resp > 0], theirs[resp > 0], atol=1e-5)


def test_only_the_adapter_learns_and_the_merged_weights_are_the_policy(tiny_model):
    from transformers import AutoModelForCausalLM

    trainer = lora_trainer(tiny_model)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    base_before = {k: v.clone() for k, v in plain.state_dict().items()}
    trained = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_" in n for n in trained)
    groups = make_groups(trainer)
    for _ in range(3):
        trainer.micro_batch(groups, 1.0 / sum(len(g) for g in groups))
        trainer.step()
    # the frozen base did not move; the adapters did
    frozen = {n: p for n, p in trainer.model.named_parameters() if not p.requires_grad}
    for name, p in frozen.items():
        assert torch.equal(p, base_before[name.replace(".base_layer.", ".")]), name
    merged = trainer.named_weights()
    assert set(merged) == {n for n, _ in plain.named_parameters()}  # the plain model's names, tied once
    assert any(not torch.equal(merged[n], base_before[n]) for n in merged)
    # loaded into a plain model, the merged weights give the trainer's own log-probs
    assert_merged_gives_the_trainers_logprobs(trainer, plain, merged, groups)
    assert merged_weights(trainer.model).keys() == merged.keys()


def test_bad_lora_settings_are_refused_by_name(tiny_model):
    with pytest.raises(ValueError, match="bf16-autocast"):
        HFTrainerConfig(lora={"rank": 4}, precision="bf16-params")
    with pytest.raises(ValueError, match="trainer.lora.targets"):
        lora_trainer(tiny_model, targets=["no_such_layer"])


@pytest.mark.slow
@pytest.mark.parametrize("transfer", ["dask", "torch_distributed"])
def test_a_lora_run_trains_and_leaves_a_merged_policy_and_its_adapter(tiny_model, tmp_path, shared_cluster, transfer):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.helpers import parity_recipe

    parity_recipe(tmp_path, tiny_model)
    proc = streamrl("recipe", "run", str(tmp_path / "tiny.toml"), *sets(
        "run.steps=3", "trainer.lr=5e-2", "trainer.lora={rank=4, alpha=8}", f"transfer.name={transfer}",
        *shared_cluster.sets), "--plain")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    records = read_records(run_dir)
    assert [r["policy_version"] for r in records] == [1, 2, 3] and all(r["samples"] == 16 for r in records)
    # each publication was the adapter alone (the engine holds adapters), a sliver of the model...
    full = sum(p.numel() * p.element_size() for p in AutoModelForCausalLM.from_pretrained(tiny_model).parameters())
    assert all(0 < r["publish_bytes"] < 0.1 * full for r in records)
    # ...and the engines sampled the trainer's policy from it: on the weights a step trained from,
    # engine and trainer agree (an adapter not applied would leave the engine on the base)
    assert all(r["offpolicy/mismatch_k3"] < 1e-6 for r in records[1:] if "offpolicy/mismatch_k3" in r)
    assert any("offpolicy/mismatch_k3" in r for r in records[1:])
    policy = run_dir / "policy"
    merged = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
                                        policy / "adapter").eval()
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    attn = torch.ones_like(ids)
    with torch.no_grad():
        a = naive_token_logprobs(merged, ids, attn)
        b = naive_token_logprobs(adapted, ids, attn)
        base = naive_token_logprobs(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval(),
                                    ids, attn)
    assert torch.allclose(a, b, atol=1e-5)  # the merged model is the adapter over the base
    assert not torch.allclose(a, base, atol=1e-4)  # and it learned something


def test_side_learners_on_one_worker_share_the_base_and_learn_as_they_would_alone(tiny_model, tmp_path):
    # two LoRA learners of one process train over one copy of the base weights, taking turns; each
    # ends exactly where a learner with a base of its own ends from the same start and data
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from streamrl.training.lora import own_parameters

    def trainer(learner: str, rank: int) -> HFTrainer:
        config = HFTrainerConfig(lr=5e-2, precision="fp32", lora={"rank": rank, "alpha": 2.0 * rank})
        return HFTrainer(config, TrainerContext(str(tiny_model), GRPO(GRPOConfig()),
                                                EngineCapabilities(temperature=1.0), learner=learner), device="cpu")

    a, b = trainer("a", 4), trainer("b", 8)
    assert a.model is b.model and a.lora.peft is b.lora.peft and a.lora.shared is b.lora.shared  # one base in memory
    alone = {"a": trainer("", 4), "b": trainer("", 8)}
    assert alone["a"].model is not a.model
    for shared, own in ((a, alone["a"]), (b, alone["b"])):  # the same starting adapter
        with torch.no_grad():
            for p, q in zip(own_parameters(shared.model, shared.lora.name), own_parameters(own.model, "default")):
                q.copy_(p)
    ga, gb = make_groups(alone["a"], seed=1), make_groups(alone["b"], seed=2)
    for _ in range(3):  # interleaved: a's gradients wait while b computes
        a.micro_batch(ga, 1.0 / 24)
        b.micro_batch(gb, 1.0 / 24)
        a.step()
        b.step()
        alone["a"].micro_batch(ga, 1.0 / 24)
        alone["a"].step()
        alone["b"].micro_batch(gb, 1.0 / 24)
        alone["b"].step()
    for shared, own in ((a, alone["a"]), (b, alone["b"])):
        mine, theirs = shared.named_weights(), own.named_weights()
        assert mine.keys() == theirs.keys() and all(torch.allclose(mine[n], theirs[n], atol=1e-6) for n in mine)
    assert any(not torch.equal(a.named_weights()[n], b.named_weights()[n]) for n in a.named_weights())
    # each one's policy/ is its own: the merged model, and its adapter over the base
    a.save(str(tmp_path / "a"))
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
                                        tmp_path / "a" / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "a", dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        want = naive_token_logprobs(alone["a"].model.eval(), ids, torch.ones_like(ids))
        assert torch.allclose(naive_token_logprobs(adapted, ids, torch.ones_like(ids)), want, atol=1e-5)
        assert torch.allclose(naive_token_logprobs(merged, ids, torch.ones_like(ids)), want, atol=1e-5)


def test_a_learner_whose_update_broke_its_adapter_does_not_fail_the_others_on_its_base(tiny_model):
    # the checks after a step (finite weights, the change of their norm) are of the learner's own
    # adapter: a NaN another learner's failed update left in its adapter is not this one's
    from streamrl.errors import UpdateBroke
    from streamrl.training.lora import own_parameters

    def trainer(learner: str, lr: float) -> HFTrainer:
        config = HFTrainerConfig(lr=lr, precision="fp32", lora={"rank": 4, "alpha": 8.0})
        return HFTrainer(config, TrainerContext(str(tiny_model), GRPO(GRPOConfig()),
                                                EngineCapabilities(temperature=1.0), learner=learner), device="cpu")

    a, b = trainer("a", 5e-2), trainer("b", 1e4)
    groups = make_groups(a, seed=1)
    b.micro_batch(groups, 1.0 / 24)
    with pytest.raises(UpdateBroke, match="changed the weights' norm"):
        b.step()  # (applied: its adapter is broken in the shared model)
    with torch.no_grad():
        own_parameters(b.model, b.lora.name)[0].fill_(float("nan"))
    a.micro_batch(groups, 1.0 / 24)
    a.step()  # a's own adapter is sane: it steps
    assert all(torch.isfinite(p).all() for p in own_parameters(a.model, a.lora.name))


def test_an_adapted_embedding_is_in_the_merged_policy_and_one_tied_to_the_head_is_refused(tiny_model, tmp_path):
    # its adapter is in lora_embedding_A/B, not lora_A: the merged weights left its delta out
    # (the engines decoded another policy than the trainer's), and its learner never trained it
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with pytest.raises(ValueError, match="trainer.lora.targets: embed_tokens shares its weight with the other end"):
        lora_trainer(tiny_model, targets=["q_proj", "embed_tokens"])
    with pytest.raises(ValueError, match="trainer.lora.targets: lm_head shares its weight with the other end"):
        lora_trainer(tiny_model, targets=["q_proj", "lm_head"])  # (the other side of the one tensor)
    untied = tmp_path / "untied"
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    model.save_pretrained(untied)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(untied)
    trainer = lora_trainer(untied, targets=["q_proj", "embed_tokens"])
    assert any("lora_embedding_A" in n for n, p in trainer.model.named_parameters() if p.requires_grad)
    groups = make_groups(trainer)
    for _ in range(3):
        trainer.micro_batch(groups, 1.0 / sum(len(g) for g in groups))
        trainer.step()
    plain = AutoModelForCausalLM.from_pretrained(untied, dtype=torch.float32)
    merged = merged_weights(trainer.model)
    assert not torch.equal(merged["model.embed_tokens.weight"], plain.model.embed_tokens.weight)  # (it learned)
    assert_merged_gives_the_trainers_logprobs(trainer, plain, merged, groups)


def test_a_lora_learners_state_resumes_whether_its_base_is_shared_or_its_own(tiny_model, tmp_path):
    # a side learner's adapter is named after it on a shared base and "default" on a base of its
    # own; a checkpoint names it one way, so `learners add --resume` and a resume with another
    # placement load it (its checkpoint held the other learners' adapters too, and loading it
    # where the names differed failed)
    from streamrl.training import trainer_state
    from streamrl.training.lora import own_parameters
    from streamrl.training.trainer_state import read_metadata

    def trainer(learner: str, rank: int = 4) -> HFTrainer:
        config = HFTrainerConfig(lr=5e-2, precision="fp32", lora={"rank": rank, "alpha": 2.0 * rank})
        return HFTrainer(config, TrainerContext(str(tiny_model), GRPO(GRPOConfig()),
                                                EngineCapabilities(temperature=1.0), learner=learner), device="cpu")

    def same_adapter(x: HFTrainer, y: HFTrainer) -> bool:
        return all(torch.allclose(p, q, atol=1e-6) for p, q in zip(own_parameters(x.model, x.lora.name),
                                                                    own_parameters(y.model, y.lora.name)))

    a, b = trainer("a"), trainer("b", 8)
    for t, seed in ((a, 1), (b, 2)):
        t.micro_batch(make_groups(t, seed=seed), 1.0 / 24)
        t.step()
    trainer_state.save(a, str(tmp_path / "a"))
    saved = set(read_metadata(tmp_path / "a" / "dcp").state_dict_metadata)
    assert not any(".lora_A.b." in k or ".lora_A.a." in k for k in saved)  # b's is not a's state; a's is "default"
    assert any(".lora_A.default." in k for k in saved)
    alone = trainer("")
    trainer_state.load(alone, str(tmp_path / "a"))
    assert same_adapter(a, alone)
    groups = make_groups(alone, seed=3)  # (AdamW's moments came too: the next step is the same)
    for t in (a, alone):
        t.micro_batch(groups, 1.0 / 24)
        t.step()
    assert same_adapter(a, alone)
    # and back: a state saved on a base of its own resumes on a shared one
    trainer_state.save(alone, str(tmp_path / "alone"))
    c = trainer("c")
    trainer_state.load(c, str(tmp_path / "alone"))
    assert same_adapter(alone, c)
    # a state of the adapter alone (its learner published its adapter to engines holding
    # adapters) resumes into one placed to publish merged weights (`learners add --resume` of a
    # recipe learner): the base is the same model folder's
    def publishing(learner: str, adapters: int) -> HFTrainer:
        config = HFTrainerConfig(lr=5e-2, precision="fp32", lora={"rank": 4, "alpha": 8.0})
        return HFTrainer(config, TrainerContext(str(tiny_model), GRPO(GRPOConfig()),
                                                EngineCapabilities(temperature=1.0, adapters=adapters),
                                                learner=learner), device="cpu")

    d = publishing("d", 2)
    assert d.lora.publishes_adapter
    d.micro_batch(make_groups(d, seed=4), 1.0 / 24)
    d.step()
    trainer_state.save(d, str(tmp_path / "d"))
    assert "policy.model.model.layers.0.self_attn.q_proj.base_layer.weight" not in \
        read_metadata(tmp_path / "d" / "dcp").state_dict_metadata  # (the adapter alone)
    added = publishing("", 0)
    assert not added.lora.publishes_adapter
    trainer_state.load(added, str(tmp_path / "d"))
    assert same_adapter(d, added)
    # a checkpoint written before (every adapter under its own name) still resumes where it was written
    real = trainer_state._adapter
    trainer_state._adapter = lambda trainer, saved_keys=None: None
    try:
        trainer_state.save(a, str(tmp_path / "before"))
    finally:
        trainer_state._adapter = real
    assert any(".lora_A.a." in k for k in read_metadata(tmp_path / "before" / "dcp").state_dict_metadata)
    trained = [p.detach().clone() for p in own_parameters(a.model, "a")]
    again = trainer("a")  # (placed anew on the worker: its adapter replaced by a fresh one)
    assert not all(torch.equal(p, q) for p, q in zip(trained, own_parameters(again.model, "a")))
    trainer_state.load(again, str(tmp_path / "before"))
    assert all(torch.equal(p, q) for p, q in zip(trained, own_parameters(again.model, "a")))
