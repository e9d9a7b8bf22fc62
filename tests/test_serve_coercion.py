"""The endpoint's request fields take their own JSON types, as OpenAI's API does: a string for a
number (``"max_tokens": "3"``), anything but a boolean for one (``"stream": "yes"``), a boolean
for a number (``"reward": true``) is a 400 in OpenAI's shape naming the field -- never read as
what it might mean. The forms JSON clients legitimately send still work (``"temperature": 1``
for 1.0). Over raw HTTP and the real ``openai`` client, on loopback."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.helpers import slot_endpoint

CHAT = {"model": "policy", "messages": [{"role": "user", "content": "1+2="}], "max_tokens": 2}
COMPLETION = {"model": "policy", "prompt": "1+2=", "max_tokens": 2}


@pytest.fixture(scope="module")
def served(tiny_model):
    """An endpoint of the tiny model (engine.temperature 1.0) on a free loopback port."""
    with slot_endpoint(tiny_model) as served:
        yield served


def refused(r: httpx.Response) -> dict:
    """The body of a 400 in OpenAI's shape."""
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    return err


@pytest.mark.parametrize("path, body, param", [
    ("/completions", {**COMPLETION, "max_tokens": "3"}, "max_tokens"),
    ("/completions", {**COMPLETION, "max_tokens": 3.5}, "max_tokens"),
    ("/completions", {**COMPLETION, "max_tokens": True}, "max_tokens"),
    ("/completions", {**COMPLETION, "stream": "yes"}, "stream"),
    ("/completions", {**COMPLETION, "stream": 1}, "stream"),
    ("/completions", {**COMPLETION, "n": "2"}, "n"),
    ("/completions", {**COMPLETION, "temperature": "1"}, "temperature"),
    ("/completions", {**COMPLETION, "temperature": True}, "temperature"),
    ("/completions", {**COMPLETION, "seed": "7"}, "seed"),
    ("/completions", {**COMPLETION, "echo": "false"}, "echo"),
    ("/completions", {**COMPLETION, "prompt": 5}, "prompt"),  # (a union's member type is no field)
    ("/completions", {**COMPLETION, "prompt": [1, "2"]}, "prompt.1"),
    ("/completions", {**COMPLETION, "stop": 5}, "stop"),
    ("/completions", {**COMPLETION, "stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
    # options of a stream on a request that does not stream (OpenAI's API refuses them too)
    ("/completions", {**COMPLETION, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/chat/completions", {**CHAT, "stream": False, "stream_options": {}}, "stream_options"),
    ("/chat/completions", {**CHAT, "max_completion_tokens": "2"}, "max_completion_tokens"),
    ("/chat/completions", {**CHAT, "logprobs": "true"}, "logprobs"),
    ("/chat/completions", {**CHAT, "stream": "yes"}, "stream"),
    ("/feedback", {"id": "cmpl-x", "reward": True}, "reward"),
    ("/feedback", {"id": "cmpl-x", "reward": "1"}, "reward"),
    ("/feedback", {"id": "cmpl-x", "index": "0", "reward": 1}, "index"),
    ("/feedback", {"id": 7, "reward": 1}, "id"),
])
def test_a_field_sent_as_another_json_type_is_a_400_naming_it(served, path, body, param):
    api, url = served
    before = api.traffic.snapshot()
    err = refused(httpx.post(url + path, json=body, timeout=30))
    assert err["param"] == param and f"'{param}'" in err["message"]
    after = api.traffic.snapshot()  # nothing of it started or rewarded
    assert (after["requests"], after["feedback"]) == (before["requests"], before["feedback"])


@pytest.mark.parametrize("path, more, param", [
    ("/completions", {"frequency_penalty": 0.5}, "frequency_penalty"),
    ("/chat/completions", {"presence_penalty": -1.0}, "presence_penalty"),
    ("/chat/completions", {"logit_bias": {"17": 100}}, "logit_bias"),
    ("/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/completions", {"best_of": 3}, "best_of"),
    ("/completions", {"suffix": " and then"}, "suffix"),
    ("/completions", {"stop": "x" * 513}, "stop"),
    ("/completions", {"top_k": 20}, "top_k"),
    ("/chat/completions", {"min_p": 0.05}, "min_p"),
    ("/chat/completions", {"repetition_penalty": 1.05}, "repetition_penalty"),
    ("/chat/completions", {"stop": ["ok", "y" * 513]}, "stop.1"),
])
def test_an_option_that_would_change_what_is_sampled_is_refused_not_ignored(served, path, more, param):
    # (accepted and silently ignored before: a client asking for JSON output or a penalty got a
    # reply that had none of it, as if it had)
    _, url = served
    body = {**(COMPLETION if path == "/completions" else CHAT), **more}
    err = refused(httpx.post(url + path, json=body, timeout=30))
    assert err["param"] == param, err
    # at their defaults, as clients send them, they are taken
    defaults = {"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "response_format": {"type": "text"},
                "best_of": 1, "suffix": "", "stop": "x" * 512, "top_k": -1, "min_p": 0, "repetition_penalty": 1}
    base = COMPLETION if path == "/completions" else CHAT
    r = httpx.post(url + path, json={**base, param.split(".")[0]: defaults[param.split(".")[0]]}, timeout=30)
    assert r.status_code == 200, r.text[:300]


def test_unknown_fields_are_dropped_as_the_body_is_read(served):
    from streamrl.serve.request_bodies import ChatRequest

    req = ChatRequest.model_validate({**CHAT, "x_unknown": [{}] * 1000, "user": "u1",
                                      "messages": [{"role": "user", "content": "1+2=", "x": [{}] * 1000}]})
    assert not req.model_extra
    # a message's own unknown keys go once the messages are read into their canonical shape
    canonical = served[0].messages(req)
    assert req.messages is canonical and "x" not in canonical[0]
    r = httpx.post(f"{served[1]}/chat/completions", json={**CHAT, "x_unknown": [{}] * 1000}, timeout=30)
    assert r.status_code == 200, r.text[:300]


def test_the_json_forms_clients_send_are_still_taken(served):
    _, url = served
    # an integer for a float (JSON clients send 1 for 1.0), the policy's own temperature
    r = httpx.post(f"{url}/completions", json={**COMPLETION, "temperature": 1, "top_p": 1}, timeout=30)
    assert r.status_code == 200, r.text[:300]
    cid = r.json()["id"]
    assert httpx.post(f"{url}/feedback", json={"id": cid, "reward": 1}, timeout=30).json()["accepted"] is True
    # a true boolean, with include_usage a boolean: the stream ends with the usage chunk
    with httpx.stream("POST", f"{url}/chat/completions", timeout=30,
                      json={**CHAT, "stream": True, "stream_options": {"include_usage": True}, "logprobs": True}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "data: [DONE]" and '"usage"' in events[-2]
    # null for an optional field, as OpenAI's API takes it: its default
    r = httpx.post(f"{url}/chat/completions", json={**CHAT, "n": None, "stream": None, "logprobs": None}, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text[:300]
    r = httpx.post(f"{url}/completions", json={**COMPLETION, "echo": None, "logprobs": None}, timeout=30)
    assert r.status_code == 200, r.text[:300]


def test_the_openai_client_gets_a_bad_request_error_naming_the_field(served):
    _, url = served
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:  # (the client sends what it is given)
        client.completions.create(model="policy", prompt="1+2=", max_tokens="3")
    assert err.value.status_code == 400 and err.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="policy", messages=CHAT["messages"], max_tokens=2, extra_body={"n": True})
    assert err.value.param == "n"
    out = client.chat.completions.create(model="policy", messages=CHAT["messages"], max_tokens=2, temperature=1)
    assert out.choices[0].message.role == "assistant"
