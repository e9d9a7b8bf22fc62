"""The slot engine's served requests, in this process on CPU: each decode step's tokens handed
over as they are decoded, a weight load in the middle of a response, cancellation; and the
traffic store: one reward per choice, what a checkpoint keeps of it, feedback once the run stops."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from streamrl.engines.base import HFEngineConfig
from streamrl.engines.slots import SlotEngine
from streamrl.training.logprobs import naive_token_logprobs


@pytest.fixture
def engine(tiny_model):
    e = SlotEngine(HFEngineConfig(batching="slots", slots=4, max_prompt_tokens=16, max_new_tokens=6,
                                  temperature=1.0, profile=False))
    e.load(str(tiny_model))
    e.decoder.stop_ids.fill_(-1)  # every request runs to its token limit: the test needs its length
    try:
        yield e
    finally:
        e.close()


def logprobs_under(model, prompt_ids, tokens) -> list[float]:
    """The log-probs ``model`` gives ``tokens`` after ``prompt_ids`` (the trainer's computation)."""
    ids = torch.tensor([prompt_ids + tokens])
    lp = naive_token_logprobs(model, ids, torch.ones_like(ids), 1.0)[0, len(prompt_ids) - 1:]
    return lp.tolist()


def test_tokens_stream_per_step_and_a_weight_load_mid_response_marks_their_versions(engine):
    ids = engine.encode("12+34=")
    calls, first, proceed = [], threading.Event(), threading.Event()

    def on_tokens(tokens, logprobs, version):
        calls.append((list(tokens), version))
        if len(calls) == 1:  # hold the loop after the first token until the load waits for the turn
            first.set()
            proceed.wait(10)

    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    future = engine.stream("r-0", ids, 6, on_tokens=on_tokens)
    assert first.wait(10)
    new = {n: p + 0.05 * torch.randn_like(p) for n, p in before.items()}
    loader = threading.Thread(target=engine.load_weights, args=(new, 1))
    loader.start()
    deadline = time.time() + 10
    while not engine._pause.is_set() and time.time() < deadline:  # the load asked for the next turn
        time.sleep(0.001)
    proceed.set()
    loader.join(10)
    response = future.result(timeout=10)
    assert len(response.tokens) == 6
    assert [t for toks, _ in calls for t in toks] == response.tokens  # every token handed over, in order
    assert len(calls) >= 5  # one call per decode step, not one at the end
    versions = response.token_versions
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
    switch = versions.index(1)
    # before the load, each log-prob is the old policy's; after it, the new weights decode (over
    # the cache the old ones wrote: the behaviour log-prob the loss uses, neither policy's recompute)
    engine.model.load_state_dict(before, strict=False)
    old = logprobs_under(engine.model, ids, response.tokens)
    for k in range(switch):
        assert abs(response.logprobs[k] - old[k]) < 1e-4, k
    # any, not all: a token both policies are all but sure of has a log-prob near 0 under each
    assert any(abs(response.logprobs[k] - old[k]) > 1e-3 for k in range(switch, 6))


def test_a_cancelled_request_frees_its_slot_with_the_tokens_so_far(engine):
    ids = engine.encode("1+2=")
    rid_seen = []

    def on_tokens(tokens, logprobs, version):
        rid_seen.append(len(tokens))
        engine.cancel("r-1")  # (from the loop's own thread: taken at its next turn)

    response = engine.stream("r-1", ids, 6, on_tokens=on_tokens).result(timeout=10)
    assert 1 <= len(response.tokens) < 6
    assert engine.requests_in_flight() == (0, 0)
    assert not engine.table.running  # the slot is free again
    # a waiting request cancelled before it starts is answered empty
    engine.cancel("never-started")
    again = engine.stream("r-2", ids, 6).result(timeout=10)
    assert len(again.tokens) == 6 and again.token_versions == [0] * 6


def test_a_prompt_past_the_slots_is_refused_naming_the_field(engine):
    with pytest.raises(ValueError, match="engine.max_prompt_tokens = 16"):
        engine.stream("long", list(range(3, 20)) * 2, 6)


def test_a_client_that_goes_away_mid_stream_cancels_its_choices(engine):
    # the endpoint's event stream as Starlette drives it: the first event sent, then the client
    # is gone and the generator is closed
    import asyncio

    from streamrl.recipe.serve import ServeConfig
    from streamrl.serve.openai_api import Endpoint
    from streamrl.serve.request_bodies import CompletionRequest
    from streamrl.serve.response_bodies import Format
    from streamrl.serve.responses import stream
    from streamrl.serve.completion import Completion
    from streamrl.serve.traffic import Traffic

    traffic = Traffic(60)
    endpoint = Endpoint(engine, ServeConfig(), traffic, "tiny")
    req = CompletionRequest(model="tiny", prompt="1+2=", n=2, stream=True)

    futures = []
    asked = engine.stream
    engine.stream = lambda *a, **k: futures.append(asked(*a, **k)) or futures[-1]  # (keeps what the engine answers)

    async def go():
        ids = endpoint.completion_prompt(req)
        completion = Completion(engine, engine.tokenizer, "cmpl-x", ids, endpoint.params(req, ids))
        endpoint.pending += 2
        traffic.started("cmpl-x")
        with engine._turn:  # the loop waits: no token is decoded before the client goes away
            completion.start()
            events = stream(endpoint, completion, Format(endpoint, req, "cmpl-x", False, ids), req)
            first = await events.__anext__()
            await events.aclose()
        return first

    first = asyncio.run(go())
    assert first.startswith("data: ") and "prompt_token_ids" in first
    deadline = time.time() + 10
    while engine.requests_in_flight() != (0, 0) and time.time() < deadline:
        time.sleep(0.01)
    assert engine.requests_in_flight() == (0, 0) and not engine.table.running
    assert [len(f.result(timeout=10).tokens) for f in futures] == [0, 0]  # cancelled before a token (else 6 each)
    assert traffic.counts["cancelled"] == 1 and endpoint.pending == 0
    assert traffic.feedback("cmpl-x", None, 1.0) is not None  # nothing of it to reward or train


def test_a_stream_writes_what_each_decode_step_brought_its_choices_at_once(engine):
    # n choices decode in the same steps: their chunks of a step are one write, not n, and every
    # token still reaches its choice in order
    import asyncio
    import json as json_

    from streamrl.recipe.serve import ServeConfig
    from streamrl.serve.openai_api import Endpoint
    from streamrl.serve.request_bodies import CompletionRequest
    from streamrl.serve.response_bodies import Format
    from streamrl.serve.responses import stream
    from streamrl.serve.completion import Completion
    from streamrl.serve.traffic import Traffic

    endpoint = Endpoint(engine, ServeConfig(), Traffic(60), "tiny")
    req = CompletionRequest(model="tiny", prompt="1+2=", n=3, max_tokens=6, stream=True)

    async def go():
        ids = endpoint.completion_prompt(req)
        completion = Completion(engine, engine.tokenizer, "cmpl-w", ids, endpoint.params(req, ids))
        endpoint.pending += 3
        endpoint.traffic.started("cmpl-w")
        completion.start()
        return [w async for w in stream(endpoint, completion, Format(endpoint, req, "cmpl-w", False, ids), req)]

    writes = asyncio.run(go())
    chunks = [json_.loads(e[len("data: "):]) for w in writes for e in w.split("\n\n") if e.startswith("data: {")]
    tokens = {k: [t for c in chunks[1:] if c["streamrl"]["index"] == k for t in c["streamrl"]["token_ids"]]
              for k in range(3)}
    assert all(len(t) == 6 for t in tokens.values())  # every token of every choice came
    token_chunks = [c for c in chunks[1:] if c["streamrl"]["token_ids"]]
    assert len(token_chunks) >= 18
    # each step's three chunks share a write (the first write is the opening chunk alone)
    assert len(writes) <= 1 + 6 + 3 + 1 < len(chunks)
    assert writes[-1].endswith("data: [DONE]\n\n")


def test_an_inbox_wakes_its_event_loop_once_for_what_a_thread_posts_together():
    import asyncio

    from streamrl.serve.completion import Inbox

    async def go():
        loop = asyncio.get_running_loop()
        wakes = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: wakes.append(a) or real(*a)
        box, queues = Inbox(loop), [asyncio.Queue() for _ in range(4)]
        poster = threading.Thread(target=lambda: [box.post(queues[i % 4], i) for i in range(100)])
        poster.start()
        poster.join()
        await asyncio.sleep(0.05)
        got = [[q.get_nowait() for _ in range(q.qsize())] for q in queues]
        box.post(queues[0], "later")  # a post after the delivery wakes the loop again
        await asyncio.sleep(0.05)
        return wakes, got, queues[0].get_nowait()

    wakes, got, later = asyncio.run(go())
    assert got == [list(range(k, 100, 4)) for k in range(4)]  # each queue's items, in order
    assert len(wakes) == 2 and later == "later"


def test_each_choice_takes_one_reward_and_early_feedback_names_a_choice_it_has():
    from streamrl.sample import Prompt, Sample
    from streamrl.serve.traffic import Traffic

    traffic = Traffic(60)
    traffic.started("c", n=2)
    # feedback before the end: an index past the request's n is refused at once, not dropped later
    assert "index 2 is out of range" in traffic.feedback("c", 2, 1.0)
    assert traffic.feedback("c", 0, 1.0) is None
    assert "choice 0 of completion 'c' is already rewarded" in traffic.feedback("c", 0, 0.0)
    assert "reward the others by index" in traffic.feedback("c", None, 0.0)
    group = [Sample(uid=f"c-{k}", prompt=Prompt(uid="c", text="1+1="), prompt_ids=[1], response_ids=[2], logprobs=[-1.0])
             for k in range(2)]
    traffic.finished("c", group)
    assert group[0].reward == 1.0 and group[1].reward is None  # the first reward stands
    assert "choice 0 of completion 'c' is already rewarded" in traffic.feedback("c", 0, 0.0)
    assert traffic.feedback("c", 1, 0.5) is None
    assert [s.reward for s in group] == [1.0, 0.5] and traffic.counts["rewarded"] == 2


def _rewarded(traffic, cid: str, n: int = 2, rewards: dict | None = None):
    """A finished request ``cid`` of ``n`` choices in ``traffic``, rewarded as ``rewards`` says
    (index: reward; None: every choice 1.0); returns its group."""
    from streamrl.sample import Prompt, Sample

    traffic.started(cid, n=n)
    prompt = Prompt(uid=cid, text="1+1=", answer="2")
    group = [Sample(uid=f"{cid}-{k}", prompt=prompt, prompt_ids=[1, 5], response_ids=[2, 3], logprobs=[-0.5, -1.5],
                    policy_version=3, token_versions=[3, 4], times={"gen_start": 1.0, "gen_end": 2.0})
             for k in range(n)]
    traffic.finished(cid, group)
    for index, reward in (rewards or {None: 1.0}).items():
        assert traffic.feedback(cid, index, reward) is None
    return group


def test_a_checkpoint_keeps_the_rewarded_groups_no_step_trained_and_a_resume_takes_them_first():
    from streamrl.serve.feedback_refusals import STOPPING
    from streamrl.serve.kept_groups import as_json, from_json
    from streamrl.serve.traffic import Traffic

    traffic = Traffic(60)
    a, b, c, d = (_rewarded(traffic, cid) for cid in "abcd")
    assert [traffic.take(s, 2, 0, 0.0) for s in range(3)] == [[a], [b], [c]]  # steps 1 and 2 taken ahead
    traffic.settled(0)  # step 0 trained: its group need not be kept
    _rewarded(traffic, "e", rewards={0: 1.0})  # one choice of two rewarded: not a whole group
    traffic.started("f", n=3)  # still generating, with its reward already accepted
    assert traffic.feedback("f", None, 0.5) is None
    kept, lost = traffic.untrained(1)
    # the groups handed to steps the run did not train, then the ready one, oldest first
    assert kept == [b, c, d] and lost == {"waiting": 2, "accepted": 1 + 3}
    assert traffic.feedback("e", 1, 0.0) is None  # (not the last checkpoint: feedback goes on)
    kept, lost = traffic.untrained(1, final=True)
    assert [g[0].prompt.uid for g in kept] == ["b", "c", "d", "e"] and lost == {"waiting": 0, "accepted": 3}
    assert traffic.feedback("f", 0, 1.0) == STOPPING  # the run's last checkpoint is written
    assert traffic.session_feedback("s", 1.0) == (0, STOPPING)

    saved = from_json(as_json(kept[:3]))  # what a checkpoint holds, and a resumed endpoint takes back
    assert saved == [b, c, d] and all(s.prompt is g[0].prompt for g in saved for s in g)
    resumed = Traffic(60)
    new = _rewarded(resumed, "g")  # traffic of the resumed run, newer than the kept groups
    resumed.restore(saved)
    assert resumed.counts["restored"] == 6
    assert resumed.take(1, 6, 0, 0.0) == saved and resumed.take(2, 2, 0, 0.0) == [new]
    assert "already rewarded" in resumed.feedback("b", None, 1.0)


def test_feedback_after_the_runs_last_checkpoint_is_a_503_not_accepted(engine):
    import httpx

    from streamrl.recipe.serve import ServeConfig
    from streamrl.serve.openai_api import Endpoint
    from streamrl.serve.traffic import Traffic
    from tests.helpers import endpoint_in_process

    traffic = Traffic(60)
    _rewarded(traffic, "a", rewards={0: 1.0})
    api = Endpoint(engine, ServeConfig(port=0), traffic, "tiny")
    with endpoint_in_process(api) as url:
        assert httpx.post(f"{url}/feedback", json={"id": "a", "index": 1, "reward": 0}, timeout=30).status_code == 200
        traffic.untrained(0, final=True)
        for body in ({"id": "a", "index": 1, "reward": 1}, {"session": "s", "reward": 1}):
            r = httpx.post(f"{url}/feedback", json=body, timeout=30)
            assert r.status_code == 503 and r.json()["error"]["code"] == "stopping", r.text
            assert "never be trained" in r.json()["error"]["message"]
