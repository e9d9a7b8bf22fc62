"""LoRA adapters in the engine: a LoRA learner publishes its adapter alone, every batching of the
``hf`` engine samples the trainer's policy from it over untouched base weights, and the slot
engine decodes requests for different adapters in one step, each with its own."""

from __future__ import annotations

import pytest
import torch

from streamrl.algorithms.grpo import GRPO, GRPOConfig
from streamrl.api import EngineCapabilities, TrainerContext
from streamrl.contracts.adapters import is_adapter
from streamrl.engines.adapters import POLICY
from streamrl.engines.hf import HFEngine, HFEngineConfig
from streamrl.errors import WeightShapeMismatch
from streamrl.sample import Prompt, Sample
from streamrl.training.hf_config import HFTrainerConfig
from streamrl.training.logprobs import naive_token_logprobs, pad_batch
from streamrl.training.trainer import HFTrainer
from tests.helpers import make_groups


def lora_trainer(model, seed=0, rank=4, steps=3) -> HFTrainer:
    """A LoRA learner whose engine holds adapters, trained ``steps`` steps on random groups."""
    config = HFTrainerConfig(lr=5e-2, precision="fp32", lora={"rank": rank, "alpha": 2.0 * rank})
    trainer = HFTrainer(config, TrainerContext(str(model), GRPO(GRPOConfig()), EngineCapabilities(adapters=4),
                                               seed=seed), device="cpu")
    groups = make_groups(trainer, seed=seed)
    for _ in range(steps):
        trainer.micro_batch(groups, 1.0 / sum(len(g) for g in groups))
        trainer.step()
    return trainer


def trainer_logprobs(model, samples) -> list[list[float]]:
    """Each sample's response log-probs under ``model`` (temperature 1)."""
    ids, attn, resp, _ = pad_batch(samples, 0)
    with torch.no_grad():
        lp = naive_token_logprobs(model.eval(), ids, attn)
    return [lp[i][resp[i] > 0].tolist() for i in range(len(samples))]


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4)


@pytest.mark.parametrize("batching", ["static", "continuous", "slots"])
def test_a_lora_learner_publishes_its_adapter_and_the_engine_samples_its_policy_over_the_base(tiny_model, batching):
    from transformers import AutoModelForCausalLM

    trainer = lora_trainer(tiny_model)
    published = trainer.named_weights()
    assert is_adapter(published)
    full = sum(p.numel() * p.element_size() for p in AutoModelForCausalLM.from_pretrained(tiny_model).parameters())
    assert trainer.publish_bytes() == sum(t.numel() * t.element_size() for t in published.values()) < 0.1 * full
    engine = HFEngine(HFEngineConfig(batching=batching, profile=False, slots=4, max_new_tokens=8))
    engine.load(str(tiny_model), device="cpu")
    base = {n: p.clone() for n, p in engine.model.named_parameters()}
    try:
        prompt = Prompt(uid="p", text="12+34=", answer="46")
        before = engine.generate(prompt, 4)
        # before the adapter: the base model's policy
        assert all(close(s.logprobs, lp) for s, lp in zip(before, trainer_logprobs(engine.model, before)))
        engine.load_weights(published, 3)
        assert engine.version == 3
        assert all(torch.equal(p, base[n]) for n, p in engine.model.named_parameters())  # the base untouched
        group = engine.generate(prompt, 4)
        assert all(s.policy_version == 3 for s in group)
        mine = trainer_logprobs(trainer.model, group)
        assert all(close(s.logprobs, lp) for s, lp in zip(group, mine)), [(s.logprobs, lp) for s, lp in zip(group, mine)]
        # and it is not the base's any more
        assert not all(close(s.logprobs, lp) for s, lp in zip(group, trainer_logprobs(
            AutoModelForCausalLM.from_pretrained(tiny_model), group)))
    finally:
        engine.close()


def test_the_slot_engine_decodes_requests_for_different_adapters_in_one_step_each_with_its_own(tiny_model):
    from transformers import AutoModelForCausalLM

    one, two = lora_trainer(tiny_model, seed=0), lora_trainer(tiny_model, seed=1, rank=8)  # (two ranks: padded)
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    engine = HFEngine(HFEngineConfig(batching="slots", profile=False, slots=8, max_new_tokens=10))
    engine.load(str(tiny_model), device="cpu")
    engine.decoder.stop_ids.fill_(-1)  # every response runs its 10 tokens: they share steps
    mixed = []
    real_step = engine.decoder.step

    def step(b):
        active = engine.decoder.active[:b]
        mixed.append(len(set(engine.decoder.adapter[:b][active].tolist())))
        real_step(b)
    engine.decoder.step = step
    try:
        engine.load_weights(one.named_weights(), 5)  # the served policy's
        engine.load_adapter("two", two.named_weights(), 7)  # a learner's variant
        ids = engine.encode("12+34=")
        asked = [(f"{a}-{i}", a) for i in range(2) for a in (POLICY, "two", "nobody")]
        futures = {rid: engine.stream(rid, ids, 10, adapter=a) for rid, a in asked}
        out = {rid: f.result(timeout=60) for rid, f in futures.items()}
        assert max(mixed) == 3  # the three adapters' requests decoded in the same steps
        for rid, adapter in asked:
            r = out[rid]
            want = {POLICY: one.model, "two": two.model, "nobody": base}[adapter]
            s = Sample(uid=rid, prompt=None, prompt_ids=ids, response_ids=r.tokens, logprobs=r.logprobs)
            assert close(r.logprobs, trainer_logprobs(want, [s])[0]), (rid, r.logprobs)
            assert set(r.token_versions) == {{POLICY: 5, "two": 7, "nobody": 0}[adapter]}  # (no adapter yet: the base, v0)
    finally:
        engine.close()


def test_an_adapter_for_another_model_or_one_too_many_is_refused_and_the_engine_keeps_what_it_had(tiny_model):
    trainer = lora_trainer(tiny_model, steps=1)
    engine = HFEngine(HFEngineConfig(batching="static", profile=False, adapters=1))
    engine.load(str(tiny_model), device="cpu")
    try:
        good = trainer.named_weights()
        engine.load_weights(good, 1)
        layer = next(n for n in good if n.endswith(".lora_A")).removesuffix(".lora_A")
        wrong = dict(good, **{f"{layer}.lora_A": torch.zeros(4, 3)})
        with pytest.raises(WeightShapeMismatch, match=layer):
            engine.load_weights(wrong, 2)
        with pytest.raises(WeightShapeMismatch, match="no linear layer 'model.nope'"):
            engine.load_weights({"model.nope.lora_A": torch.zeros(1, 1), "model.nope.lora_B": torch.zeros(1, 1),
                                 "model.nope.lora_scale": torch.tensor(1.0)}, 2)
        with pytest.raises(ValueError, match="lacks lora_B, lora_scale"):
            engine.load_weights({f"{layer}.lora_A": good[f"{layer}.lora_A"]}, 2)
        with pytest.raises(ValueError, match=r"holds 1 adapters .*'two' is one more \(engine.adapters\)"):
            engine.load_adapter("two", good, 2)
        assert engine.version == 1 and engine.adapters.versions == {POLICY: 1}
        layers = engine.adapters.layers
        assert torch.equal(layers[layer]["A"][1, :4], good[f"{layer}.lora_A"])
        # a late load of an older version leaves the newer one
        engine.load_weights(good, 3)
        engine.load_weights({n: t * 2 for n, t in good.items()}, 2)
        assert engine.adapters.versions == {POLICY: 3} and engine.version == 3
        assert torch.equal(layers[layer]["A"][1, :4], good[f"{layer}.lora_A"])
    finally:
        engine.close()
    none = HFEngine(HFEngineConfig(batching="static", profile=False, adapters=0))
    none.load(str(tiny_model), device="cpu")
    try:
        with pytest.raises(ValueError, match=r"engine.adapters = 0"):
            none.load_weights(good, 1)
    finally:
        none.close()


def test_a_lora_learner_publishes_merged_weights_to_an_engine_without_adapters(tiny_model):
    from transformers import AutoModelForCausalLM

    config = HFTrainerConfig(lr=5e-2, precision="fp32", lora={"rank": 4})
    trainer = HFTrainer(config, TrainerContext(str(tiny_model), GRPO(GRPOConfig()), EngineCapabilities(adapters=0)),
                        device="cpu")
    published = trainer.named_weights()
    assert not is_adapter(published)
    assert set(published) == {n for n, _ in AutoModelForCausalLM.from_pretrained(tiny_model).named_parameters()}
    assert trainer.publish_bytes() == sum(t.numel() * t.element_size() for t in published.values())


def test_a_bad_adapter_or_a_failed_grow_leaves_the_bank_as_it_was_and_an_unloaded_index_is_free(tiny_model, monkeypatch):
    trainer = lora_trainer(tiny_model, steps=1)
    engine = HFEngine(HFEngineConfig(batching="static", profile=False, adapters=2))
    engine.load(str(tiny_model), device="cpu")
    try:
        good = trainer.named_weights()
        engine.load_weights(good, 1)
        bank = engine.adapters
        layer = next(n for n in good if n.endswith(".lora_A")).removesuffix(".lora_A")
        held = {n: {k: t.clone() for k, t in st.items()} for n, st in bank.layers.items()}

        def unchanged() -> bool:
            return (bank.versions == {POLICY: 1} and bank.rank == 4 and set(bank.layers) == set(held)
                    and all(torch.equal(bank.layers[n][k], held[n][k]) for n in held for k in held[n]))

        last = sorted(good)[-1]  # (a layer after others: nothing of the ones before may be copied either)
        bad = {"a scale of two numbers": ({f"{layer}.lora_scale": torch.tensor([1.0, 2.0])}, "scale"),
               "NaN in A": ({last: good[last] * float("nan")}, "NaN or infinite"),
               "an integer B": ({f"{layer}.lora_B": good[f"{layer}.lora_B"].long()}, "not floating")}
        for what, (change, says) in bad.items():
            with pytest.raises((ValueError, WeightShapeMismatch), match=says):
                engine.load_weights(dict(good, **change), 2)
            assert unchanged(), what
        # a higher rank whose stacks cannot all be made (device memory): nothing swapped in
        made, zeros = [], torch.zeros

        def fails_on_the_third(*args, **kwargs):
            made.append(args)
            if len(made) == 3:
                raise torch.OutOfMemoryError("out of memory (made to fail)")
            return zeros(*args, **kwargs)
        higher = lora_trainer(tiny_model, rank=8, steps=1).named_weights()
        monkeypatch.setattr(torch, "zeros", fails_on_the_third)
        with pytest.raises(torch.OutOfMemoryError):
            engine.load_weights(higher, 2)
        monkeypatch.setattr(torch, "zeros", zeros)
        assert unchanged() and bank.layout == 1
        engine.load_weights(higher, 2)  # and the grow goes through once there is room
        assert bank.rank == 8 and bank.versions == {POLICY: 2}
        # full (the policy and 'a'), 'a' unloaded: 'b' takes its index, and 'a' can come back after it leaves
        engine.load_adapter("a", good, 1)
        held = bank.slots["a"]
        engine.unload_adapter("a")
        # while a request still decodes with 'a's index, 'b' gets none (it would go on with b's weights)
        assert bank.slot("b", busy=frozenset({held})) == 0 and "b" not in bank.slots
        with pytest.raises(ValueError, match="held by an adapter or by requests of an unloaded one"):
            bank.load("b", good, 1, busy=frozenset({held}))  # (never into index 0, the base every row reads)
        assert "b" not in bank.slots and "b" not in bank.versions
        engine.load_adapter("b", good, 1)
        engine.adapters.unload("b")
        engine.load_adapter("a", good, 1)
        assert bank.versions == {POLICY: 2, "a": 1}
    finally:
        engine.close()


def test_rows_of_several_adapters_are_scaled_as_one_adapters_rows_are_in_bf16():
    # the gather path (every GPU batch, a CPU batch of several adapters) scaled by alpha / rank
    # rounded to bf16 first: 16 / 12 moved a third of the outputs off those of the path a single
    # adapter takes, which is the trainer's (peft's) arithmetic
    from streamrl.engines.adapters import AdapterBank

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48, bias=False).to(torch.bfloat16)
    bank = AdapterBank(torch.nn.Sequential(lin), 2)
    rank = 12
    bank.layers["0"] = {"A": torch.randn(3, rank, 64, dtype=torch.bfloat16),
                        "B": torch.randn(3, 48, rank, dtype=torch.bfloat16),
                        "scale": torch.tensor([0.0, 16 / 12, 16 / 12], dtype=torch.float32)}
    hook = bank._hook("0")
    x = torch.randn(2, 1, 64, dtype=torch.bfloat16)
    out = lin(x)
    with bank.rows(torch.tensor([1, 2])):
        mixed = hook(lin, (x,), out)
    for i, k in enumerate([1, 2]):
        with bank.rows(k):
            alone = hook(lin, (x[i:i + 1],), out[i:i + 1])
        assert torch.equal(mixed[i], alone[0]), i
