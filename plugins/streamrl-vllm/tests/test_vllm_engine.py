"""The vllm engine, run for real on vLLM (the CPU build in CI: ``install-cpu.sh``).

Engines are started with ``enforce_eager=True`` (no torch.compile: seconds to start instead of
tens) -- the kernels and the scheduler are vLLM's either way.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from streamrl_vllm.engine import VLLMEngine, VLLMEngineConfig

from streamrl.api import Prompt
from streamrl.training.trainer import pad_batch, token_logprobs

MODEL = Path(__file__).resolve().parents[3] / "models" / "tiny-addition-1d"


@pytest.fixture(scope="module")
def engine():
    """One engine for the module (vLLM takes seconds to start); tests leave it at a known state."""
    e = VLLMEngine(VLLMEngineConfig(max_new_tokens=6, temperature=0.7, enforce_eager=True, profile=True))
    e.load(str(MODEL))
    yield e
    e.close()


def hold(engine) -> threading.Event:
    """Block the engine's loop (as a long step would) until the returned event is set; returns
    once the loop is held, so requests submitted now wait in the inbox."""
    gate, held = threading.Event(), threading.Event()
    engine._submit(lambda e: (held.set(), gate.wait(30)), [])
    assert held.wait(30)
    return gate


def prompts(tag: str, k: int) -> list[Prompt]:
    return [Prompt(uid=f"{tag}-{i}", text=f"{i % 10}+{(3 * i) % 10}=", answer="") for i in range(k)]


def trainer_gap(model, samples, temperature: float) -> float:
    """Largest |engine logprob - trainer logprob| over the response tokens of ``samples``."""
    ids, attn, resp, old = pad_batch(samples, 0)
    with torch.no_grad():
        new = token_logprobs(model, ids, attn, temperature)
    return float(((new - old) * resp).abs().max())


def test_groups_have_per_token_logprobs_that_match_the_trainer_also_after_a_weight_swap(engine):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    groups = engine.generate_groups(prompts("a", 4), 8, [0.0] * 4)
    samples = [s for g in groups for s in g]
    assert [len(g) for g in groups] == [8] * 4 and len({s.uid for s in samples}) == 32
    assert all(s.prompt_ids[0] == engine.tokenizer.bos_token_id for s in samples)  # ours, once: vLLM adds none
    assert all(len(s.response_ids) == len(s.logprobs) > 0 and s.policy_version == engine.version for s in samples)
    assert trainer_gap(model, samples, 0.7) < 1e-4  # fp32 on CPU, tempered as the trainer computes

    # a new policy, loaded in place: the tied lm_head must follow the embedding (the CPU trap)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p, generator=torch.Generator().manual_seed(1)) * 0.05)
    old_version = engine.version
    engine.load_weights(dict(model.named_parameters()), old_version + 1)
    samples = [s for g in engine.generate_groups(prompts("b", 4), 8, [0.0] * 4) for s in g]
    assert {s.policy_version for s in samples} == {old_version + 1}
    assert trainer_gap(model, samples, 0.7) < 1e-4


def test_without_the_lm_head_repack_a_swap_leaves_logprobs_off(monkeypatch, engine):
    # the check above must be able to fail: skip the re-pack and the tied lm_head keeps old weights
    import streamrl_vllm.weights as weights
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(3.0)
    monkeypatch.setattr(weights, "_repack_lm_head", lambda worker: None)
    engine.load_weights(dict(model.named_parameters()), engine.version + 1)
    samples = [s for g in engine.generate_groups(prompts("c", 2), 8, [0.0] * 2) for s in g]
    assert trainer_gap(model, samples, 0.7) > 1e-2
    monkeypatch.undo()
    engine.load_weights(dict(model.named_parameters()), engine.version + 1)  # leave it consistent
    samples = [s for g in engine.generate_groups(prompts("d", 2), 8, [0.0] * 2) for s in g]
    assert trainer_gap(model, samples, 0.7) < 1e-4


def test_concurrent_tasks_are_batched_and_the_profile_fits_a_latency(engine):
    out: dict[int, list] = {}

    def task(i):
        out[i] = engine.generate_groups(prompts(f"t{i}", 8), 4, [0.0] * 8)

    threads = [threading.Thread(target=task, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(out) == [0, 1, 2, 3] and all(len(g) == 4 for gs in out.values() for g in gs)
    latency = engine.decode_latency()
    assert latency is not None and 0 < latency(100.0) <= latency(5000.0) < 1.0


def test_higher_priority_is_admitted_first_under_max_running():
    engine = VLLMEngine(VLLMEngineConfig(max_new_tokens=4, enforce_eager=True, profile=False, max_running=1))
    engine.load(str(MODEL))
    try:
        gate = hold(engine)  # the requests queue up meanwhile
        done: dict[str, float] = {}

        def ask(uid, priority):
            done[uid] = engine.generate(Prompt(uid=uid, text="1+2=", answer="3"), 1, priority)[0].times["gen_end"]

        threads = [threading.Thread(target=ask, args=a) for a in [("low", 1.0), ("high", 9.0), ("mid", 5.0)]]
        for t in threads:
            t.start()
        deadline = time.time() + 10
        while len(engine._inbox) < 3:
            assert time.time() < deadline
            time.sleep(0.01)
        gate.set()
        for t in threads:
            t.join(timeout=30)
        assert sorted(done, key=done.get) == ["high", "mid", "low"]
    finally:
        engine.close()


def test_close_fails_waiting_requests_and_leaves_no_engine_process():
    import psutil

    engine = VLLMEngine(VLLMEngineConfig(max_new_tokens=4, enforce_eager=True, profile=False))
    engine.load(str(MODEL))
    assert psutil.Process().children(recursive=True) == []  # vLLM runs inside this process
    gate = hold(engine)
    errors = []

    def ask():
        try:
            engine.generate(Prompt(uid="never", text="1+2=", answer="3"), 2)
        except RuntimeError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=ask)
    t.start()
    while len(engine._inbox) < 1:
        time.sleep(0.01)
    closer = threading.Thread(target=engine.close)
    closer.start()
    gate.set()
    closer.join(timeout=60)
    t.join(timeout=60)
    assert errors and "closed before" in errors[0]
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate(Prompt(uid="late", text="1+2=", answer="3"), 1)


def test_a_folder_vllm_cannot_load_is_a_one_line_error(tmp_path):
    import json
    import shutil

    for f in MODEL.iterdir():  # a real tokenizer and weights, a config naming no known architecture
        shutil.copy(f, tmp_path / f.name)
    config = json.loads((MODEL / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchForCausalLM"]}))
    engine = VLLMEngine(VLLMEngineConfig(enforce_eager=True, profile=False))
    with pytest.raises(RuntimeError, match=f"vllm cannot load the model at {tmp_path}") as err:
        engine.load(str(tmp_path))
    assert "\n" not in str(err.value) and "NoSuchForCausalLM" in str(err.value)
