"""The slot engine when one request's work fails or comes at the wrong moment, in-process on CPU:
a failed prefill fails its requests alone, a burst of long prompts is prefilled in parts, a
stream's callback that exits cancels its request alone, greedy evaluation carries the version
that decoded it."""

from __future__ import annotations

import threading

import pytest
import torch

from streamrl.engines import slot_prefill
from streamrl.engines.decode import decode_batch
from streamrl.engines.hf import HFEngine, HFEngineConfig
from streamrl.engines.slot_decoder import SlotDecoder
from streamrl.sample import Prompt


def slot_engine(path, **config):
    engine = HFEngine(HFEngineConfig(batching="slots", **{"profile": False, **config}))
    engine.load(str(path))
    return engine


def test_a_prefill_that_fails_fails_its_requests_alone_and_the_loop_goes_on(tiny_model):
    # (the failure is simulated: an out-of-memory raised by the decoder's prefill on its first call,
    # as a GPU's would be on a burst of long prompts; it ended the loop and every request after)
    engine = slot_engine(tiny_model, max_new_tokens=4, slots=4)
    try:
        real = engine.decoder.prefill
        calls = []

        def failing_once(starts):
            calls.append(len(starts))
            if len(calls) == 1:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return real(starts)
        engine.decoder.prefill = failing_once
        with pytest.raises(RuntimeError, match="prefill failed: OutOfMemoryError: CUDA out of memory"):
            engine.generate(Prompt(uid="first", text="1+1="), 2)
        group = engine.generate(Prompt(uid="second", text="2+2="), 3)
        assert len(group) == 3 and all(s.response_ids for s in group)
        assert engine.loop_error is None and engine.loop_counts["prefill_failed"] == 2
        assert engine.table.has_room() and len(engine.table.running) == 0  # (the failed ones' slots came back)
    finally:
        engine.close()


def test_a_burst_of_long_prompts_is_prefilled_in_parts_and_decodes_as_the_reference(qwen_model, monkeypatch):
    # past EAGER_TOKENS positions the eager prefill runs in parts, each its prompts' own width; a
    # prompt shared by two slots and prompts of several lengths land in different parts
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(qwen_model)).eval()
    dec = SlotDecoder(model, slots=5, context=80, max_new_tokens=5, temperature=1.0, stop_ids=(), graphs=False)
    monkeypatch.setattr(slot_prefill, "EAGER_TOKENS", 64)
    widths = []
    real = dec.prompts._eager
    dec.prompts._eager = lambda p, a, s, r, w: widths.append((len(p), w)) or real(p, a, s, r, w)
    a, b, c, d = [1, 5, 9], [1] + list(range(10, 49)), [1, 7, 3, 2], list(range(60, 80))
    prompts = (a, b, c, d, a)
    dec.prefill([(k, p, 5, True) for k, p in enumerate(prompts)])
    assert widths == [(1, 16), (1, 48), (2, 32)]  # (a; b alone is 48 wide; c and d together)
    for _ in range(4):
        dec.step(5)
    done = [int(x) for x in dec.finished_slots(5)]
    assert done == [0, 1, 2, 3, 4]
    for (tokens, logprobs), prompt in zip(dec.release(done), prompts):
        ((want, want_lp),) = decode_batch(model, [prompt], 5, 1.0, stop_ids=(), greedy=True)
        assert tokens == want and torch.allclose(torch.tensor(logprobs), torch.tensor(want_lp), atol=1e-4)


def test_a_stream_callback_that_exits_cancels_its_request_alone(tiny_model):
    engine = slot_engine(tiny_model, max_new_tokens=6, slots=4)
    try:
        ids = engine.encode("1+1=")

        def exits(tokens, logprobs, version):
            raise SystemExit(3)
        ended = engine.stream("exits", ids, 6, on_tokens=exits).result(timeout=60)
        assert len(ended.tokens) < 6  # (cancelled at its first tokens)
        got = []
        kept = engine.stream("kept", ids, 6, on_tokens=lambda t, lp, v: got.extend(t)).result(timeout=60)
        assert engine.loop_error is None and kept.tokens and got == kept.tokens
    finally:
        engine.close()


def test_greedy_evaluation_carries_the_version_loaded_before_its_requests_started(tiny_model):
    # a weight load between the call and its requests' admission: the samples are the new
    # version's, as the loop stamped them (the call's version before)
    engine = slot_engine(tiny_model, max_new_tokens=4, slots=4)
    try:
        out = {}
        with engine._turn:  # (the loop waits here: nothing is admitted)
            thread = threading.Thread(target=lambda: out.setdefault("groups", engine.generate_greedy(
                [Prompt(uid="g", text="1+1=")])))
            thread.start()
            while not engine._queue.counts()[1]:
                threading.Event().wait(0.01)
            engine.version = 7  # (what a weight load sets, the loop paused as here)
        thread.join(60)
        ((sample,),) = out["groups"]
        assert sample.policy_version == 7 and set(sample.token_versions or [7]) == {7}
    finally:
        engine.close()


def test_requests_refused_at_queueing_leave_no_settings_for_a_later_request_of_their_id(tiny_model):
    # two requests under one id in one call are refused, none queued; their entries stayed, and a
    # later plain request of that id took the refused one's settings (its callback, its limit)
    from streamrl.engines.slot_requests import Request

    engine = slot_engine(tiny_model, max_new_tokens=4, slots=4)
    try:
        ids = engine.encode("1+1=")
        with pytest.raises(ValueError, match="asked twice at once"):
            engine.queued([Request("d-0", 1, streamed=True), Request("d-0", 1, streamed=True)], [ids, ids], 0.0)
        assert "d-0" not in engine._requests
    finally:
        engine.close()
