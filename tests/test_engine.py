"""The hf engine in-process (the dataflow tests drive it on real workers)."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from streamrl.api import EngineCapabilities
from streamrl.engines import static
from streamrl.engines.continuous import ContinuousEngine
from streamrl.engines.hf import HFEngine, HFEngineConfig
from streamrl.engines.seeded import SeededEngine
from streamrl.engines.slots import SlotEngine
from streamrl.engines.static import StaticEngine
from streamrl.sample import Prompt
from tests.helpers import finish_order, until


@pytest.mark.parametrize("config,variant,kv_tokens", [
    ({}, ContinuousEngine, 256 * 32),
    ({"kv_memory_fraction": 0.5}, ContinuousEngine, 0),  # sized from free memory once built
    ({"batching": "static"}, StaticEngine, 0),
    ({"batching": "slots"}, SlotEngine, 64 * (512 + 16)),  # slots x (max_prompt_tokens + max_new_tokens)
    ({"reproducible": True}, SeededEngine, 0),
    ({"reproducible": True, "batching": "static"}, SeededEngine, 0),  # reproducible wins
])
def test_the_config_picks_the_variant_and_its_capabilities(config, variant, kv_tokens):
    config = HFEngineConfig(temperature=0.7, max_running=3, **config)
    engine = HFEngine(config)  # what the registered factory does
    assert type(engine) is variant and engine.config is config and engine.requests_in_flight() == (0, 0)
    assert HFEngine.capabilities(config) == EngineCapabilities(
        temperature=0.7, max_running=3, max_new_tokens=16, kv_capacity_tokens=kv_tokens,
        max_prompt_tokens=512 if variant is SlotEngine else None,  # (a slot holds no longer prompt)
        repeatable=config.reproducible, greedy=True, streams=variant is SlotEngine, moves_samples=variant is SlotEngine,
        adapters=4)  # (every variant holds LoRA adapters: engine.adapters)
    engine.close()  # before load: nothing started, nothing to fail
    assert engine.is_closed()


def test_hf_engine_generates_a_group_with_a_logprob_per_token(tiny_model):
    engine = HFEngine(HFEngineConfig(max_new_tokens=4))
    engine.load(str(tiny_model))
    try:
        group = engine.generate(Prompt(uid="p0", text="1+2=", answer="3"), 2)
        assert [len(s.response_ids) == len(s.logprobs) for s in group] == [True, True]
        assert engine.requests_in_flight() == (0, 0)
    finally:
        engine.close()
    assert engine.is_closed()


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_closing_the_engine_fails_the_requests_still_waiting(tiny_model, monkeypatch, batching):
    # requests the loop will not finish (as when a new engine replaces this one mid-step): closing
    # must fail them, or the task waiting on them would hang its worker thread for good. The loop
    # is held while the engine closes: the manager paused (continuous), the batch's decode
    # waiting (static); max_running 1 leaves the group's second request in the engine's queue
    go = threading.Event()
    real = static.decode_batch

    def held(*a, **k):
        go.wait(30)
        return real(*a, **k)

    monkeypatch.setattr(static, "decode_batch", held)
    engine = HFEngine(HFEngineConfig(max_new_tokens=4, max_running=1, batching=batching, profile=False))
    engine.load(str(tiny_model))
    errors = []

    def ask():
        try:
            engine.generate(Prompt(uid="p1", text="1+2=", answer="3"), 2)
        except RuntimeError as e:
            errors.append(str(e))

    asker, closer = threading.Thread(target=ask, daemon=True), threading.Thread(target=engine.close, daemon=True)
    if batching == "continuous":
        with engine.manager.pause():
            asker.start()
            until(lambda: engine.requests_in_flight() == (1, 1))
            closer.start()
            until(engine.is_closed)
    else:
        asker.start()
        until(lambda: engine.requests_in_flight() == (1, 1))
        closer.start()
        until(engine.is_closed)
    go.set()
    closer.join(30)
    asker.join(30)
    assert not asker.is_alive() and not closer.is_alive()
    (error,) = errors
    if batching == "static":  # the held batch finishes; the queued request is failed
        assert error == "hf engine: request p1-1 did not finish: the engine closed"
    else:  # failed by close, or refused by the stopping loop if the router was still there to route p1-0
        assert error in ("hf engine: request p1-0 did not finish: the engine closed",
                         "hf engine refused request p1-1: its generation loop is not running"), error


def test_hf_engine_admits_by_priority_under_max_running(tiny_model):
    engine = HFEngine(HFEngineConfig(max_new_tokens=3, max_running=1))
    engine.load(str(tiny_model))
    order = finish_order(engine)

    def ask(uid, priority):
        engine.generate(Prompt(uid=uid, text="1+2=", answer="3"), 1, priority=priority)

    threads = []
    try:
        with engine.manager.pause():  # nothing finishes while the queue fills up
            for uid, priority in [("first", 0.0), ("low", 1.0), ("high", 9.0), ("mid", 5.0)]:
                threads.append(threading.Thread(target=ask, args=(uid, priority)))
                threads[-1].start()
                until(lambda: sum(engine.requests_in_flight()) == len(threads))
            assert engine.requests_in_flight() == (1, 3)  # the cap holds the rest back
        for t in threads:
            t.join(timeout=30)
        assert order == ["first-0", "high-0", "mid-0", "low-0"]
    finally:
        engine.close()


def test_reproducible_engine_draws_the_same_samples_for_a_seed_whatever_runs_beside_it(tiny_model):
    import torch

    from streamrl.training.trainer import pad_batch, token_logprobs

    prompt = Prompt(uid="7-3", text="2+5=", answer="7")

    def engine(seed):
        e = HFEngine(HFEngineConfig(max_new_tokens=5, reproducible=True, seed=seed))
        e.load(str(tiny_model))
        return e

    a, b = engine(1), engine(1)
    alone = a.generate(prompt, 4)
    # the same group while other groups are decoded on the same engine from other threads
    others = [threading.Thread(target=b.generate, args=(Prompt(uid=f"x{i}", text="1+1=", answer="2"), 3))
              for i in range(3)]
    for t in others:
        t.start()
    crowded = b.generate(prompt, 4)
    for t in others:
        t.join()
    assert [s.response_ids for s in alone] == [s.response_ids for s in crowded]
    assert [s.logprobs for s in alone] == [s.logprobs for s in crowded]
    other_seed = engine(2).generate(prompt, 4)
    assert [s.response_ids for s in other_seed] != [s.response_ids for s in alone]
    # the logprobs are the ones the trainer computes for the same tokens
    ids, attn, resp, old = pad_batch(alone, a.tokenizer.pad_token_id)
    new = token_logprobs(a.model, ids, attn, 1.0)
    assert torch.allclose(new[resp.bool()], old[resp.bool()], atol=1e-4)


def test_a_request_that_never_finishes_fails_after_request_timeout(tiny_model):
    engine = HFEngine(HFEngineConfig(max_new_tokens=3, request_timeout=0.5))
    engine.load(str(tiny_model))
    try:
        with engine.manager.pause():  # a stuck generation loop
            with pytest.raises(RuntimeError, match=r"request s-0 got no response within 0 s \(engine.request_timeout\)"):
                engine.generate(Prompt(uid="s", text="1+2=", answer="3"), 1)
    finally:
        engine.close()


def test_static_batching_logprobs_match_the_trainer_on_left_padded_prompts_and_after_a_weight_load(tiny_model):
    import torch

    from streamrl.training.trainer import pad_batch, token_logprobs

    engine = HFEngine(HFEngineConfig(max_new_tokens=5, batching="static", temperature=0.7, profile=False))
    engine.load(str(tiny_model))
    # prompts of 4, 5 and 6 characters asked from three threads land in one padded batch
    prompts = [Prompt(uid=f"p{i}", text=t, answer="") for i, t in enumerate(["1+2=", "12+3=", "12+34="])]

    def check(groups):
        samples = [s for g in groups for s in g]
        assert len({len(s.prompt_ids) for s in samples}) == 3
        ids, attn, resp, old = pad_batch(samples, engine.tokenizer.pad_token_id)
        new = token_logprobs(engine.model, ids, attn, 0.7)
        assert resp.sum() > 0 and torch.allclose(new[resp.bool()], old[resp.bool()], atol=1e-4)

    def ask_all():
        out = [None] * len(prompts)

        def ask(i):
            out[i] = engine.generate(prompts[i], 3)
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        return out

    try:
        check(ask_all())
        # new weights, in place: the same check holds under them (and the samples say v1)
        weights = {n: p.detach() * 1.5 for n, p in engine.model.named_parameters()}
        engine.load_weights(weights, 1)
        groups = ask_all()
        assert {s.policy_version for g in groups for s in g} == {1}
        check(groups)
    finally:
        engine.close()


def test_static_batching_takes_the_highest_priority_requests_first_under_max_running(tiny_model, monkeypatch):
    batches = []  # the prompts of each decoded batch, in order
    real, go = static.decode_batch, threading.Event()

    def recorded(model, prompts, *a, **k):
        batches.append(prompts)
        go.wait(30)  # the first batch waits until the others are queued behind it
        return real(model, prompts, *a, **k)

    monkeypatch.setattr(static, "decode_batch", recorded)
    engine = HFEngine(HFEngineConfig(max_new_tokens=3, batching="static", max_running=2, profile=False))
    engine.load(str(tiny_model))
    texts = {"first": "0+0=", "low": "1+1=", "high": "2+2=", "mid": "3+3=", "top": "4+4="}

    def ask(uid, priority):
        engine.generate(Prompt(uid=uid, text=texts[uid], answer=""), 1, priority=priority)

    threads = [threading.Thread(target=ask, args=a) for a in
               [("first", 0.0), ("low", 1.0), ("high", 9.0), ("mid", 5.0), ("top", 10.0)]]
    try:
        threads[0].start()  # the loop takes "first" alone and holds it in its decode
        until(lambda: engine.requests_in_flight() == (1, 0))
        for t in threads[1:]:
            t.start()
        until(lambda: engine.requests_in_flight() == (1, 4))
        go.set()
        for t in threads:
            t.join(timeout=30)
        by_text = {engine.encode(t)[1:][0]: uid for uid, t in texts.items()}  # first digit names the request
        assert [sorted(by_text[p[1]] for p in b) for b in batches] == [["first"], ["high", "top"], ["low", "mid"]]
    finally:
        engine.close()


def test_static_decode_prefills_each_distinct_prompt_once_and_every_row_continues_its_own_prompt(tiny_model):
    import torch
    from transformers import AutoModelForCausalLM

    from streamrl.engines.static import decode_batch
    from streamrl.training.trainer import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model)).eval()
    batches = []
    model.register_forward_pre_hook(lambda mod, args, kw: batches.append(tuple(kw["input_ids"].shape)),
                                    with_kwargs=True)
    a, b = [1, 5, 6, 7], [1, 8, 9]  # two prompts of different lengths, interleaved, 3 samples each
    prompts = [a, b, a, b, a, b]
    out = decode_batch(model, prompts, 6, 1.0, stop_ids=[2], generator=torch.Generator().manual_seed(0))
    assert batches[0] == (2, 4)  # the prefill: one row per distinct prompt
    assert all(shape == (6, 1) for shape in batches[1:])  # decode steps: one row per sample
    for prompt, (tokens, logprobs) in zip(prompts, out):  # each row continued its own prompt's cache
        ids = torch.tensor([prompt + tokens])
        want = token_logprobs(model, ids, torch.ones_like(ids), 1.0)[0, len(prompt) - 1:]
        assert torch.allclose(want, torch.tensor(logprobs), atol=1e-5), (prompt, tokens)


@pytest.mark.parametrize("config", [{}, {"batching": "static"}, {"reproducible": True}, {"batching": "slots"}])
def test_greedy_decoding_is_the_models_argmax_in_every_variant_and_token_ids_are_fed_as_they_are(tiny_model, config):
    import torch
    from transformers import AutoModelForCausalLM

    from streamrl.sample import Prompt

    engine = HFEngine(HFEngineConfig(max_new_tokens=5, profile=False, **config))
    engine.load(str(tiny_model))
    try:
        prompts = [Prompt(uid="a", text="12+7="), Prompt(uid="b", text="3+45=")]
        groups = engine.generate_greedy(prompts)
        model = AutoModelForCausalLM.from_pretrained(str(tiny_model)).eval()
        for p, (s,) in zip(prompts, groups):
            ids = torch.tensor([engine.encode(p.text)])
            want = model.generate(ids, do_sample=False, max_new_tokens=5, eos_token_id=engine.tokenizer.eos_token_id,
                                  pad_token_id=engine.tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
            assert s.response_ids == want[:len(s.response_ids)] and s.uid == f"{p.uid}-0"
        # a prompt the task tokenized itself is fed exactly as given: no BOS added
        ids = engine.encode("12+7=")[1:]
        ((s,),) = engine.generate_greedy([Prompt(uid="c", text="ignored", token_ids=ids)])
        assert s.prompt_ids == ids
        (sampled,) = engine.generate_groups([Prompt(uid="d", text="ignored", token_ids=ids)], 2, [0.0])
        assert all(x.prompt_ids == ids for x in sampled)
    finally:
        engine.close()


def test_a_request_id_asked_again_while_waiting_fails_the_old_ask_instead_of_leaving_it_to_hang():
    from streamrl.engines.request_queue import RequestQueue

    queue = RequestQueue()
    old = queue.put([("a-0", [1, 2], 0.0)])["a-0"]
    new = queue.put([("b-0", [1], 0.0), ("a-0", [3], 0.0)])["a-0"]  # e.g. Dask retrying a timed-out task
    with pytest.raises(RuntimeError, match="request a-0 was asked again while waiting"):
        old.result(timeout=1)
    assert not new.done()
    with pytest.raises(ValueError, match="request c-0 asked twice at once"):
        queue.put([("c-0", [1], 0.0), ("c-0", [1], 0.0)])
    # b-0 and the newest ask of a-0: the old copy left the queue, so a loop that keeps settings per
    # id (the slot engine's greedy, streamed or movable requests) never runs it with the new one's
    assert queue.counts() == (0, 2)
    taken = []
    queue.admit(lambda rid, ids: taken.append((rid, ids)) or True, 0)
    assert sorted(taken) == [("a-0", [3]), ("b-0", [1])]


def test_requests_put_after_the_loop_died_fail_at_once_instead_of_waiting_for_ever():
    from streamrl.engines.request_queue import RequestQueue

    queue = RequestQueue()
    waiting = queue.put([("a-0", [1], 0.0)])["a-0"]
    queue.fail_all("its generation loop died: IndexError: boom")
    with pytest.raises(RuntimeError, match="request a-0 did not finish: its generation loop died"):
        waiting.result(timeout=1)
    late = queue.put([("b-0", [1], 0.0)])["b-0"]
    with pytest.raises(RuntimeError, match="request b-0 cannot run: its generation loop died: IndexError: boom"):
        late.result(timeout=1)
    assert queue.counts() == (0, 0)


def test_greedy_evaluation_while_continuous_batching_generates_gives_the_idle_answers(tiny_model):
    import threading

    from streamrl.sample import Prompt

    engine = HFEngine(HFEngineConfig(max_new_tokens=5, profile=False))
    engine.load(str(tiny_model))
    try:
        prompts = [Prompt(uid=f"e{i}", text=f"{i}+{i}=") for i in range(4)]
        idle = [g[0].response_ids for g in engine.generate_greedy(prompts)]
        stop = threading.Event()

        def busy(t):
            k = 0
            while not stop.is_set():
                engine.generate_groups([Prompt(uid=f"b{t}-{k}-{j}", text="12+34=") for j in range(4)], 4, [0.0] * 4)
                k += 1

        threads = [threading.Thread(target=busy, args=(t,)) for t in range(3)]
        for t in threads:
            t.start()
        try:
            busy_answers = [[g[0].response_ids for g in engine.generate_greedy(prompts)] for _ in range(4)]
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        assert all(answers == idle for answers in busy_answers)
        assert [g[0].response_ids for g in engine.generate_greedy(prompts)] == idle  # the model is unharmed
    finally:
        engine.close()


def test_a_responses_text_is_the_tokenizers_decode_special_tokens_left_out(tiny_model):
    from transformers import AutoTokenizer

    engine = HFEngine(HFEngineConfig(profile=False))
    engine.tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    ids = engine.tokenizer("12 + 34 = 46 .", add_special_tokens=False).input_ids + [engine.tokenizer.eos_token_id]
    for clean in (False, True):  # (the fast path without the clean-up of spaces, transformers' with it)
        engine.tokenizer.clean_up_tokenization_spaces = clean
        text = engine.response_text(ids)
        assert text == engine.tokenizer.decode(ids, skip_special_tokens=True)
        assert engine.tokenizer.eos_token not in text and "46" in text


def without_bos(model, folder):
    """A copy of ``model`` in ``folder`` whose tokenizer has no BOS token (as Qwen2.5's); its tokenizer."""
    import shutil

    from transformers import AutoTokenizer

    shutil.copytree(model, folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.bos_token = None
    tok.save_pretrained(folder)
    assert AutoTokenizer.from_pretrained(folder).bos_token_id is None
    return tok


@pytest.mark.parametrize("batching", ["slots", "continuous"])
def test_a_tokenizer_without_a_bos_token_generates_from_plain_text(tiny_model, tmp_path, batching):
    # Qwen2.5's tokenizer has no BOS token (bos_token_id None): a plain-string prompt is then its
    # text alone, where [None] + ids failed every request
    folder = tmp_path / "no-bos"
    tok = without_bos(tiny_model, folder)
    engine = HFEngine(HFEngineConfig(max_new_tokens=4, batching=batching))
    engine.load(str(folder))
    try:
        assert engine.encode("1+2=") == tok("1+2=", add_special_tokens=False).input_ids
        group = engine.generate(Prompt(uid="p0", text="1+2=", answer="3"), 2)
        assert [len(s.response_ids) == len(s.logprobs) > 0 for s in group] == [True, True]
    finally:
        engine.close()


def test_an_empty_prompt_without_a_bos_token_is_refused_and_the_slot_loop_goes_on(tiny_model, tmp_path):
    # no BOS: "" is no tokens at all, and a prefill of nothing killed the decode loop, after which
    # every request (the endpoint's, the run's) waited for ever
    import httpx

    from streamrl.recipe.serve import ServeConfig
    from streamrl.serve.openai_api import Endpoint
    from streamrl.serve.traffic import Traffic
    from tests.helpers import endpoint_in_process

    without_bos(tiny_model, tmp_path / "no-bos")
    engine = SlotEngine(HFEngineConfig(batching="slots", slots=4, max_prompt_tokens=32, max_new_tokens=4,
                                       profile=False))
    engine.load(str(tmp_path / "no-bos"))
    try:
        with pytest.raises(ValueError, match="prompt e0 has no tokens; a prompt needs at least one"):
            engine.generate(Prompt(uid="e0", text=""), 2)
        with endpoint_in_process(Endpoint(engine, ServeConfig(port=0), Traffic(60.0), "policy")) as url:
            r = httpx.post(f"{url}/completions", json={"model": "policy", "prompt": "", "max_tokens": 2}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
            r = httpx.post(f"{url}/completions", json={"model": "policy", "prompt": "1+2=", "max_tokens": 2}, timeout=30)
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"], r.text
        assert engine.loop_error is None and len(engine.generate(Prompt(uid="p1", text="1+2="), 2)) == 2
    finally:
        engine.close()


@pytest.mark.parametrize("batching, reproducible", [("static", False), ("continuous", False), ("slots", True)])
def test_an_empty_prompt_without_a_bos_token_is_refused_by_every_engine(tiny_model, tmp_path, batching, reproducible):
    # the static batch of it had width 0, the continuous one was handed [], and mixed with other
    # prompts it decoded from nothing into a sample the trainer's batch could not hold
    from streamrl.engines.hf import HFEngine

    without_bos(tiny_model, tmp_path / "no-bos")
    engine = HFEngine(HFEngineConfig(batching=batching, reproducible=reproducible, max_new_tokens=4, profile=False))
    engine.load(str(tmp_path / "no-bos"))
    try:
        with pytest.raises(ValueError, match="prompt e0 has no tokens; a prompt needs at least one"):
            engine.generate(Prompt(uid="e0", text=""), 2)
        assert len(engine.generate(Prompt(uid="p1", text="1+2="), 2)) == 2  # (and the engine goes on)
    finally:
        engine.close()


@pytest.mark.parametrize("batching", ["static", "slots"])
def test_the_latency_profile_runs_on_a_model_whose_eos_is_its_last_token(tiny_model, batching):
    # (GPT-2's EOS is its last id: the profile's filler token, EOS + 1, was past the embedding)
    from streamrl.engines.hf import HFEngine

    engine = HFEngine(HFEngineConfig(batching=batching, max_new_tokens=4, profile=False))
    engine.load(str(tiny_model))
    try:
        engine.tokenizer.eos_token_id = engine.model.get_input_embeddings().num_embeddings - 1
        points = engine._profile(batches=(1, 2), steps=2)
        assert len(points) == 1 and points[0][1] > 0
    finally:
        engine.close()


def test_an_engine_that_returns_the_wrong_groups_stops_the_step_in_one_line_naming_it():
    from streamrl.errors import RunStopped
    from streamrl.on_worker.engine_output import checked_groups
    from streamrl.sample import Sample

    class Plugin:
        pass

    prompts = [Prompt(uid="0-0", text="a"), Prompt(uid="0-1", text="b")]

    def sample(uid, prompt, logprobs=(-0.5,)):
        return Sample(uid=uid, prompt=prompt, prompt_ids=[1], response_ids=[2], logprobs=list(logprobs))

    good = [[sample(f"{p.uid}-{k}", p) for k in range(2)] for p in prompts]
    assert checked_groups(Plugin(), prompts, 2, good) == good
    for wrong, said in [(good[:1], "returned 1 groups for 2 prompts"),
                        (None, "returned NoneType for 2 prompts"),
                        ([good[0], good[1][:1]], "returned 1 samples for prompt '0-1'; expected 2"),
                        ([good[1], good[0]], "returned sample '0-1-0' in the group of prompt '0-0'"),
                        ([good[0], [good[1][0], "x"]], "returned a str in the group of prompt '0-1'"),
                        ([good[0], [good[1][0], sample("0-1-1", prompts[1], (-0.1, -0.2))]],
                         "returned sample '0-1-1' with 1 response tokens and 2 log-probs"),
                        # a behaviour log-prob that is not a finite number: every ratio of the batch NaN
                        ([good[0], [good[1][0], sample("0-1-1", prompts[1], (float("nan"),))]],
                         "returned sample '0-1-1' with a log-prob of 'nan'; expected finite"),
                        ([good[0], [good[1][0], sample("0-1-1", prompts[1], (float("-inf"),))]],
                         "returned sample '0-1-1' with a log-prob of '-inf'"),
                        ([good[0], [good[1][0], sample("0-1-1", prompts[1], (None,))]],
                         "returned sample '0-1-1' with a log-prob of 'None'"),
                        # no prompt token to predict the first response token from; a mask of another length
                        ([good[0], [good[1][0], Sample(uid="0-1-1", prompt=prompts[1], prompt_ids=[], response_ids=[2],
                                                       logprobs=[-0.5])]],
                         "returned sample '0-1-1' with no prompt tokens"),
                        ([good[0], [good[1][0], Sample(uid="0-1-1", prompt=prompts[1], prompt_ids=[1], response_ids=[2],
                                                       logprobs=[-0.5], loss_mask=[1, 1])]],
                         "returned sample '0-1-1' with 1 response tokens and a loss_mask of 2")]:
        with pytest.raises(RunStopped, match=re.escape(f"engine Plugin: generate_groups() {said}")):
            checked_groups(Plugin(), prompts, 2, wrong)


def test_an_export_beside_an_optimizer_step_sends_one_version_not_a_mix(monkeypatch):
    # (the worker's residents stood in for; real threads) with two task threads on a train
    # worker, an export that read the weights while a step changed them sent half of each
    from streamrl.on_worker import task_functions, weight_tasks

    changing, weights = threading.Event(), {"w": torch.zeros(8)}

    class Trainer:
        version = 0

        def step(self):
            weights["w"][:4] = 1.0
            changing.set()
            time.sleep(0.3)  # (an optimizer step over a large model takes its time)
            weights["w"][4:] = 1.0
            self.version += 1
            return {"grad_norm": 1.0, "seconds": 0.3, "version": self.version}

        def named_weights(self):
            return weights  # (live tensors, as a trainer's own parameters are)

    class Transfer:
        receivers = 1

        def send(self, named, version):
            return {k: v.clone() for k, v in named.items()}

    residents = {task_functions.TRAINER: Trainer(), weight_tasks.TRANSFER: Transfer()}
    for module in (task_functions, weight_tasks):
        monkeypatch.setattr(module, "resident", residents.__getitem__)
        monkeypatch.setattr(module, "expect", lambda *args: None)
    stepping = threading.Thread(target=task_functions.optimizer_step)
    stepping.start()
    assert changing.wait(10)
    sent = weight_tasks.export_weights(1)["w"]
    stepping.join(10)
    assert sent.tolist() == [1.0] * 8  # the whole step's weights (waited for it), never half of them
