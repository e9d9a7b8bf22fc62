"""The ``slots`` engine (streamrl's own decode loop over request slots) in-process, on CPU: the
same decode step a GPU captures in a graph, run eagerly."""

from __future__ import annotations

import threading

import pytest
import torch

from streamrl.engines.decode import decode_batch
from streamrl.engines.hf import HFEngine, HFEngineConfig
from streamrl.engines.slot_decoder import SlotDecoder, check_supported
from streamrl.engines.slots import SlotEngine
from streamrl.sample import Prompt
from streamrl.training.trainer import pad_batch, token_logprobs
from tests.helpers import ROOT, finish_order, until


@pytest.fixture(params=["llama", "qwen2"])
def model_path(request, tiny_model, qwen_model):
    """Each architecture the slot decoder supports."""
    return tiny_model if request.param == "llama" else qwen_model


def slot_engine(path, **config) -> SlotEngine:
    engine = HFEngine(HFEngineConfig(batching="slots", **{"profile": False, **config}))
    assert type(engine) is SlotEngine
    engine.load(str(path))
    return engine


def ask_all(engine, prompts, n):
    """Each prompt's group, asked from a thread of its own (as generate tasks do)."""
    out = [None] * len(prompts)

    def ask(i):
        out[i] = engine.generate(prompts[i], n)
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out


def test_logprobs_match_the_trainer_with_more_requests_than_slots(model_path):
    engine = slot_engine(model_path, max_new_tokens=6, slots=4, temperature=0.7)
    prompts = [Prompt(uid=f"p{i}", text=t, answer="") for i, t in enumerate(["1+2=", "12+3=", "12+34=", "5+5="])]
    seen = []
    real_step = engine.decoder.step

    def step(b):
        seen.append(int(engine.decoder.active.sum()))
        real_step(b)
    engine.decoder.step = step
    try:
        groups = ask_all(engine, prompts, 3)  # 12 requests through 4 slots
        samples = [s for g in groups for s in g]
        assert len(samples) == 12 and max(seen) == 4 and engine.requests_in_flight() == (0, 0)
        assert len({len(s.prompt_ids) for s in samples}) == 3
        ids, attn, resp, old = pad_batch(samples, engine.tokenizer.pad_token_id)
        new = token_logprobs(engine.model, ids, attn, 0.7)
        assert resp.sum() > 12 and torch.allclose(new[resp.bool()], old[resp.bool()], atol=1e-4)
    finally:
        engine.close()


@pytest.mark.parametrize("prefill", ["eager", "buckets"])
def test_a_request_joins_a_freed_slot_while_others_decode_and_each_decodes_as_it_would_alone(qwen_model, prefill):
    # "buckets": the prefill a GPU replays from its graphs (prompts padded to a bucket, keys and
    # values through the staging buffer), run eagerly here
    from transformers import AutoModelForCausalLM

    from streamrl.engines.slot_prefill import PromptForward

    model = AutoModelForCausalLM.from_pretrained(str(qwen_model)).eval()
    dec = SlotDecoder(model, slots=4, context=32, max_new_tokens=12, temperature=1.0, stop_ids=(), graphs=False)
    if prefill == "buckets":
        dec.prompts = PromptForward(dec, static=True, graphs=False)
        assert dec.prompts.buckets == [(1, 16), (2, 16), (1, 32), (4, 16), (2, 32), (4, 32)]
        assert dec.prompts.bucket(3, 17) == (4, 32) and dec.prompts.bucket(5, 16) is None  # (past them: eager)
        bodies = []
        real = dec.prompts._body
        dec.prompts._body = lambda p, w: bodies.append((p, w)) or real(p, w)
    a, b, c = [1, 5, 9, 13, 2], [1, 7, 3], [1, 200, 100, 50, 25, 12, 6]
    dec.prefill([(0, a, 12, True), (1, b, 3, True)])
    ended = {}
    while 1 not in ended:  # b ends first; a goes on
        dec.step(2)
        for s, out in zip(done := [int(x) for x in dec.finished_slots(2)], dec.release(done)):
            ended[s] = out
    assert 0 not in ended and len(ended[1][0]) == 3
    dec.prefill([(1, c, 7, True)])  # c takes the freed slot while a is mid-way
    while len(ended) < 2 or 0 not in ended:
        dec.step(2)
        for s, out in zip(done := [int(x) for x in dec.finished_slots(2)], dec.release(done)):
            ended[s if s != 1 else "c"] = out
    for prompt, key, n in [(a, 0, 12), (c, "c", 7)]:
        tokens, logprobs = ended[key]
        ((want, want_lp),) = decode_batch(model, [prompt], n, 1.0, stop_ids=(), greedy=True)
        assert tokens == want and torch.allclose(torch.tensor(logprobs), torch.tensor(want_lp), atol=1e-4)
    ((want, _),) = decode_batch(model, [b], 3, 1.0, stop_ids=(), greedy=True)
    assert ended[1][0] == want
    if prefill == "buckets":
        assert bodies == [(2, 16), (1, 16)]  # both prefills padded to a bucket


def test_a_prefill_padded_to_a_bigger_bucket_decodes_each_slot_as_the_reference(qwen_model):
    # three distinct prompts (one 40 tokens long) into four slots, one prompt shared by two: the
    # bucket (4 prompts, 64 positions) is wider and has more rows than the prompts need
    from transformers import AutoModelForCausalLM

    from streamrl.engines.slot_prefill import PromptForward

    model = AutoModelForCausalLM.from_pretrained(str(qwen_model)).eval()
    dec = SlotDecoder(model, slots=4, context=80, max_new_tokens=6, temperature=1.0, stop_ids=(), graphs=False)
    dec.prompts = PromptForward(dec, static=True, graphs=False)
    bodies = []
    real = dec.prompts._body
    dec.prompts._body = lambda p, w: bodies.append((p, w)) or real(p, w)
    a, b, c = [1, 5, 9], [1] + list(range(10, 49)), [1, 7, 3, 2]
    dec.prefill([(0, a, 6, True), (1, b, 6, True), (2, c, 6, True), (3, a, 6, True)])
    assert bodies == [(4, 64)]
    for _ in range(5):
        dec.step(4)
    done = [int(x) for x in dec.finished_slots(4)]
    assert done == [0, 1, 2, 3]
    for (tokens, logprobs), prompt in zip(dec.release(done), (a, b, c, a)):
        ((want, want_lp),) = decode_batch(model, [prompt], 6, 1.0, stop_ids=(), greedy=True)
        assert tokens == want and torch.allclose(torch.tensor(logprobs), torch.tensor(want_lp), atol=1e-4)


def test_a_weight_load_mid_generation_drops_nothing_and_the_next_steps_use_the_new_weights(tiny_model):
    engine = slot_engine(tiny_model, max_new_tokens=50, slots=2)
    engine.decoder.stop_ids.fill_(-1)  # every response runs to 50 tokens: the load lands mid-way
    at_load = []
    paused = engine._weights_paused

    def recording():
        ctx = paused()

        class Ctx:
            def __enter__(self):
                ctx.__enter__()
                at_load.append(int(engine.decoder.generated[0]))

            def __exit__(self, *exc):
                return ctx.__exit__(*exc)
        return Ctx()
    engine._weights_paused = recording
    out = []
    prompt = Prompt(uid="w", text="12+34=", answer="")
    try:
        asker = threading.Thread(target=lambda: out.append(engine.generate(prompt, 1)))
        asker.start()
        until(lambda: int(engine.decoder.generated[0]) >= 5, every=0.002)
        old_model = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
        engine.load_weights({n: p * 1.5 for n, p in old_model.items()}, 1)
        asker.join(60)
        ((sample,),) = out
        k = at_load[0]
        assert 5 <= k < 50 and len(sample.response_ids) == 50 and engine.version == 1
        # the tokens before the load are the old policy's: the trainer's log-probs under the old weights
        new_weights = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
        with torch.no_grad():
            for n, p in engine.model.named_parameters():
                p.copy_(old_model[n])
        ids, attn, resp, old = pad_batch([sample], engine.tokenizer.pad_token_id)
        before = token_logprobs(engine.model, ids, attn, 1.0)[resp.bool()]
        assert torch.allclose(before[:k], old[resp.bool()][:k], atol=1e-4)
        assert not torch.allclose(before[k:], old[resp.bool()][k:], atol=1e-3)
        with torch.no_grad():
            for n, p in engine.model.named_parameters():
                p.copy_(new_weights[n])
        # a request after the load: every token the new policy's
        (fresh,) = engine.generate(Prompt(uid="x", text="1+2=", answer=""), 1)
        ids, attn, resp, old = pad_batch([fresh], engine.tokenizer.pad_token_id)
        assert fresh.policy_version == 1
        assert torch.allclose(token_logprobs(engine.model, ids, attn, 1.0)[resp.bool()], old[resp.bool()], atol=1e-4)
    finally:
        engine.close()


def test_an_ended_request_stops_decoding_and_stays_finished_until_it_is_released(qwen_model):
    # the loop may look for ended requests only every few steps (engine.finished_every): a request
    # that ended keeps its tokens, its log-probs and its flag through the steps before the look
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(qwen_model)).eval()
    dec = SlotDecoder(model, slots=2, context=32, max_new_tokens=6, temperature=1.0, stop_ids=(), graphs=False)
    a, b = [1, 5, 9, 13, 2], [1, 7, 3]
    dec.prefill([(0, a, 6, True), (1, b, 3, True)])
    for _ in range(3):  # b ends at its third token, two steps in; a step goes by unread
        dec.step(2)
    assert [int(s) for s in dec.finished_slots(2)] == [1] and not bool(dec.active[1])
    for _ in range(5):  # a ends at max_new_tokens, three steps on; two more go by unread
        dec.step(2)
    assert [int(s) for s in dec.finished_slots(2)] == [0, 1] and not dec.active[:2].any()
    for (tokens, logprobs), prompt, n in zip(dec.release([0, 1]), [a, b], [6, 3]):
        ((want, want_lp),) = decode_batch(model, [prompt], n, 1.0, stop_ids=(), greedy=True)
        assert tokens == want and torch.allclose(torch.tensor(logprobs), torch.tensor(want_lp), atol=1e-4)


def test_looking_for_ended_requests_every_few_steps_keeps_every_token_and_log_prob(tiny_model):
    engine = slot_engine(tiny_model, max_new_tokens=6, slots=4, temperature=0.7, finished_every=4)
    steps, looks = [], []
    real_step, real_look = engine.decoder.step, engine.decoder.finished_slots
    engine.decoder.step = lambda b: (steps.append(b), real_step(b))[1]
    engine.decoder.finished_slots = lambda b: (looks.append(b), real_look(b))[1]
    prompts = [Prompt(uid=f"p{i}", text=t, answer="") for i, t in enumerate(["1+2=", "12+3=", "12+34=", "5+5="])]
    try:
        samples = [s for g in ask_all(engine, prompts, 3) for s in g]  # 12 requests through 4 slots
        assert len(samples) == 12 and engine.requests_in_flight() == (0, 0)
        assert all(1 <= len(s.response_ids) <= 6 and engine.tokenizer.eos_token_id not in s.response_ids[:-1]
                   for s in samples)
        ids, attn, resp, old = pad_batch(samples, engine.tokenizer.pad_token_id)
        new = token_logprobs(engine.model, ids, attn, 0.7)
        assert resp.sum() > 12 and torch.allclose(new[resp.bool()], old[resp.bool()], atol=1e-4)
        # a look after every 4th step (and after each admission), not after every step
        assert 0 < len(looks) < len(steps)
    finally:
        engine.close()
    with pytest.raises(ValueError, match="finished_every needs batching"):
        HFEngineConfig(batching="static", finished_every=4)


def test_requests_that_arrive_while_others_decode_are_admitted_at_the_next_look(tiny_model):
    # with engine.finished_every = 4, waiting requests join at the turns that look for ended ones
    # (or at once when nothing runs): groups that trickle in share a prefill between two steps
    engine = slot_engine(tiny_model, max_new_tokens=12, slots=8, finished_every=4)
    engine.decoder.stop_ids.fill_(-1)  # every response decodes its 12 tokens
    admits, held, go, out = [], threading.Event(), threading.Event(), {}
    real_prefill, real_step = engine.decoder.prefill, engine.decoder.step

    def prefill(starts):
        admits.append((engine._steps, len(starts)))
        return real_prefill(starts)

    def step(b):
        real_step(b)
        if engine._steps == 0:  # (the loop counts a step after it): hold the loop in its first
            held.set()
            go.wait(30)
    engine.decoder.prefill, engine.decoder.step = prefill, step

    def ask(uid):
        out[uid] = engine.generate(Prompt(uid=uid, text="1+2="), 2)
    threads = [threading.Thread(target=ask, args=(uid,)) for uid in ("a", "b")]
    try:
        threads[0].start()
        assert held.wait(30)
        threads[1].start()  # b arrives while a decodes, one step in
        until(lambda: engine.requests_in_flight() == (2, 2))
        go.set()
        for t in threads:
            t.join(timeout=60)
        assert admits == [(0, 2), (4, 2)]  # b waited for the look after step 4, not the next turn
        assert [len(s.response_ids) for uid in "ab" for s in out[uid]] == [12] * 4
        assert engine.loop_counts["admissions"] == 2 and engine.loop_counts["admitted"] == 4
        assert engine.loop_counts["prefill_s"] > 0 and engine.loop_counts["steps"] >= 12
    finally:
        go.set()
        engine.close()


def test_greedy_evaluation_is_the_models_argmax_while_sampled_requests_run():
    from transformers import AutoModelForCausalLM

    trained = ROOT / "models" / "tiny-addition-1d"  # warm-started: its answers differ by prompt
    engine = slot_engine(trained, max_new_tokens=6, slots=3)
    model = AutoModelForCausalLM.from_pretrained(str(trained)).eval()
    prompts = [Prompt(uid="a", text="1+7="), Prompt(uid="b", text="3+4=")]
    stop = threading.Event()

    def busy():
        k = 0
        while not stop.is_set():
            engine.generate(Prompt(uid=f"busy{k}", text="1+1="), 2)
            k += 1
    thread = threading.Thread(target=busy)
    thread.start()
    try:
        groups = engine.generate_greedy(prompts)
    finally:
        stop.set()
        thread.join(60)
        engine.close()
    for p, (s,) in zip(prompts, groups):
        ids = torch.tensor([engine.encode(p.text)])
        want = model.generate(ids, do_sample=False, max_new_tokens=6, eos_token_id=engine.tokenizer.eos_token_id,
                              pad_token_id=engine.tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
        assert s.response_ids == want[:len(s.response_ids)] and s.uid == f"{p.uid}-0"
    assert len(set(tuple(g[0].response_ids) for g in groups)) == 2  # a model whose answers differ


def test_requests_start_by_priority_under_max_running_and_closing_fails_the_rest(tiny_model):
    engine = slot_engine(tiny_model, max_new_tokens=3, slots=4, max_running=1)
    errors = []
    order = finish_order(engine)

    def ask(uid, priority):
        try:
            engine.generate(Prompt(uid=uid, text="1+2=", answer="3"), 1, priority=priority)
        except RuntimeError as e:
            errors.append(str(e))

    threads = []
    try:
        with engine._weights_paused():  # the loop waits while the queue fills up
            for uid, priority in [("first", 0.0), ("low", 1.0), ("high", 9.0), ("mid", 5.0)]:
                threads.append(threading.Thread(target=ask, args=(uid, priority)))
                threads[-1].start()
                until(lambda: sum(engine.requests_in_flight()) == len(threads), every=0.002)
            assert engine.requests_in_flight() == (0, 4)
        for t in threads:
            t.join(timeout=30)
        assert order == ["high-0", "mid-0", "low-0", "first-0"]
        with engine._weights_paused():  # a request the loop will never start: closing fails it
            threads = [threading.Thread(target=ask, args=("late", 0.0))]
            threads[0].start()
            until(lambda: engine.requests_in_flight() == (0, 1), every=0.002)
            closer = threading.Thread(target=engine.close)
            closer.start()
            threads[0].join(30)
        closer.join(30)
        assert errors == ["hf engine: request late-0 did not finish: the engine closed"]
    finally:
        engine.close()


def test_a_prompt_longer_than_a_slot_fails_naming_the_field_and_other_architectures_are_refused(tiny_model):
    from transformers import GPT2Config, GPT2LMHeadModel

    engine = slot_engine(tiny_model, max_new_tokens=4, max_prompt_tokens=6)
    try:
        with pytest.raises(ValueError, match=r"prompt long has 14 tokens, more than engine.max_prompt_tokens = 6"):
            engine.generate(Prompt(uid="long", text="123456+789012"), 1)
        assert len(engine.generate(Prompt(uid="ok", text="1+2="), 1)[0].response_ids) >= 1
    finally:
        engine.close()
    # a slot longer than the model's 64 positions: a prompt past what they leave beside the
    # response is refused too (it would decode where the model never was)
    engine = slot_engine(tiny_model, max_new_tokens=54, max_prompt_tokens=512)
    try:
        with pytest.raises(ValueError, match=r"prompt long has 14 tokens, more than the 10 the model's 64 positions "
                                             r"leave beside engine.max_new_tokens = 54"):
            engine.generate(Prompt(uid="long", text="123456+789012"), 1)
        assert engine.generate(Prompt(uid="ok", text="1+2="), 1)[0].prompt_ids
    finally:
        engine.close()
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match=r"decodes Llama and Qwen2 models; this model is 'gpt2'"):
        check_supported(gpt2)


def test_a_weight_load_mid_response_gives_a_task_samples_tokens_their_versions(tiny_model):
    # a task's sample decoding across a weight load: its first tokens are the old policy's, the
    # rest the new one's (was: every token stamped with the version it was asked under, which the
    # trainer's token-staleness diagnostics then counted as older than they were)
    engine = slot_engine(tiny_model, max_new_tokens=40, slots=2, temperature=1.0)
    engine.decoder.stop_ids.fill_(-1)  # every response runs its 40 tokens: the load lands mid-way
    try:
        out = {}
        asker = threading.Thread(target=lambda: out.setdefault("group", engine.generate(Prompt(uid="p", text="1+2="), 2)))
        asker.start()
        assert until(lambda: int(engine.decoder.generated.max()) >= 3, 30, every=0.001)
        new = {n: p.detach() + 0.01 for n, p in engine.model.named_parameters()}
        engine.load_weights(new, 1)
        asker.join(60)
        for sample in out["group"]:
            versions = sample.token_versions
            assert len(versions) == len(sample.response_ids) == 40
            k = versions.index(1)
            assert 3 <= k < 40 and versions == [0] * k + [1] * (40 - k) and sample.policy_version == 0
        # a sample decoded under one version alone carries none: its policy_version says it
        (alone,) = engine.generate(Prompt(uid="q", text="1+2="), 1)
        assert alone.token_versions == [] and alone.policy_version == 1
    finally:
        engine.close()
