"""The endpoint against hostile clients, over raw HTTP on loopback: bodies past the size limit,
JSON nested without end, content parts that are not text, strings that are not Unicode,
megabytes of prompt, and a failure nobody foresaw -- each one request's 4xx (or 500) in OpenAI's
shape, while other clients are answered."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import httpx
import pytest

from streamrl.chat.messages import MAX_CHARS_PER_TOKEN
from streamrl.serve.request_bodies import MAX_MESSAGES
from streamrl.engines.hf_config import HFEngineConfig
from streamrl.engines.slots import SlotEngine
from streamrl.recipe.serve import ServeConfig
from streamrl.serve.openai_api import Endpoint
from streamrl.serve.traffic import Traffic
from tests.helpers import endpoint_in_process, slot_endpoint, until

LIMIT = 64 * 1024  # serve.max_body_bytes here: small, so the test sends little
BODY_TIMEOUT_S = 3.0  # serve.body_timeout_s here


@pytest.fixture(scope="module")
def long_model(tiny_model, tmp_path_factory):
    """The tiny model with room for replies of thousands of tokens (its positions are rotary: 8192
    of them compute as 64 do), for replies that only a cancel ends."""
    import shutil

    folder = tmp_path_factory.mktemp("long") / "tiny-long"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8192}))
    return folder


@pytest.fixture(scope="module")
def served(tiny_model):
    with slot_endpoint(tiny_model, serve=ServeConfig(port=0, max_body_bytes=LIMIT, body_timeout_s=BODY_TIMEOUT_S)) as served:
        yield served


def chat(url: str, content, **more) -> httpx.Response:
    body = {"model": "policy", "messages": [{"role": "user", "content": content}], "max_tokens": 2, **more}
    return httpx.post(f"{url}/chat/completions", json=body, timeout=30)


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_a_body_past_the_limit_is_413_before_it_is_read_and_others_are_answered_meanwhile(served):
    _, url = served
    host, port = url.split("//")[1].split("/")[0].split(":")
    # 50 MB declared, 1 KB sent: a server that read the body before answering would wait for the
    # rest; this one must answer from the declared length alone, with the connection still open
    with socket.create_connection((host, int(port)), timeout=20) as big:
        big.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
                    f"content-length: {50 * 2**20}\r\n\r\n".encode() + b'{"prompt": "' + b"1" * 1024)
        answer = b""
        while b"\r\n\r\n" not in answer:
            got = big.recv(65536)  # (a timeout here: the server waited for the body)
            assert got, answer
            answer += got
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        r = chat(url, "1+2=")  # another client, while the big one's connection is open
        assert r.status_code == 200, r.text[:300]
    r = httpx.post(f"{url}/completions", content=b'{"prompt": "' + b"1" * (2 * LIMIT) + b'"}', timeout=30,
                   headers={"content-type": "application/json"})
    assert error_of(r, 413)["code"] == "request_too_large" and "serve.max_body_bytes" in r.text

    def chunks():  # no length declared: it is counted as it comes, and cut at the limit
        for _ in range(64):
            yield b" " * 4096
    r = httpx.post(f"{url}/completions", content=chunks(), timeout=30)
    assert error_of(r, 413)["code"] == "request_too_large"


def test_a_body_that_does_not_come_is_408_after_the_bound_and_others_are_answered_meanwhile(served):
    _, url = served
    host, port = url.split("//")[1].split("/")[0].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as slow:  # (a hang guard only)
        slow.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
                     "content-length: 1000\r\n\r\n".encode() + b'{"model": ')  # ... and nothing more
        assert chat(url, "1+2=").status_code == 200  # another client meanwhile
        answer = b""
        while b"\r\n\r\n" not in answer:
            got = slow.recv(65536)
            assert got, answer
            answer += got
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        while not answer.endswith(b"}"):
            answer += slow.recv(65536)
    err = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert err["code"] == "request_timeout" and "serve.body_timeout_s" in err["message"], err


def test_json_nested_without_end_and_non_unicode_strings_are_400(served):
    _, url = served
    deep = '{"model": "policy", "prompt": ' + "[" * 20000 + "]" * 20000 + "}"
    r = httpx.post(f"{url}/completions", content=deep, headers={"content-type": "application/json"}, timeout=30)
    assert "nested too deeply" in error_of(r, 400)["message"]
    lone = '{"model": "policy", "messages": [{"role": "user", "content": "hi \\ud800"}]}'
    r = httpx.post(f"{url}/chat/completions", content=lone, headers={"content-type": "application/json"}, timeout=30)
    assert "lone surrogate" in error_of(r, 400)["message"]


def test_json_that_parses_but_nests_past_the_bound_is_400_in_any_field(served):
    # 500 levels parse, but a chat template's tojson and pickle (which takes a served sample to
    # the trainer) recurse per level: an ``answer`` that deep once stalled a run's step for ever
    _, url = served
    for levels, status in ((63, 200), (64, 400), (600, 400)):  # (inside the body's own object: one level more)
        nested = "[" * levels + "1" + "]" * levels
        r = httpx.post(f"{url}/completions", headers={"content-type": "application/json"}, timeout=30,
                       content='{"model": "policy", "prompt": "1+2=", "max_tokens": 2, "answer": ' + nested + "}")
        if status == 200:
            assert r.status_code == 200, r.text[:300]
        else:
            assert "more than 64 levels" in error_of(r, 400)["message"]
    deep_tool = {"type": "function", "function": {"name": "f", "parameters": {"a": [[[[[[[[[[[[[[{}]]]]]]]]]]]]]]}}}
    for _ in range(5):
        deep_tool = {"type": "function", "function": {"name": "f", "parameters": {"p": [[[[[[[[[[deep_tool]]]]]]]]]]}}}
    assert "nested too deeply" in error_of(chat(url, "1+2=", tools=[deep_tool]), 400)["message"]


def test_an_integer_of_more_digits_than_python_reads_is_400_not_a_server_error(served):
    _, url = served
    for field in ("max_tokens", "seed"):
        body = '{"model": "policy", "prompt": "1+2=", "' + field + '": ' + "1" * 5000 + "}"
        r = httpx.post(f"{url}/completions", content=body, headers={"content-type": "application/json"}, timeout=30)
        assert error_of(r, 400)["message"] == "The request body is not valid JSON."


@pytest.mark.parametrize("tool, param", [({"type": "function"}, "tools.0.function"),
                                         ({"type": "function", "function": {"name": 5}}, "tools.0.function.name"),
                                         ({"type": "code", "function": {"name": "f"}}, "tools.0.type"),
                                         ("calc", "tools.0")])
def test_a_tool_not_in_openais_shape_is_400_naming_it(served, tool, param):
    _, url = served
    assert error_of(chat(url, "1+2=", tools=[tool]), 400)["param"] == param


@pytest.mark.parametrize("text", [None, 5, {"a": 1}])
def test_a_content_part_whose_text_is_not_a_string_is_400_naming_it(served, text):
    _, url = served
    err = error_of(chat(url, [{"type": "text", "text": "1+"}, {"type": "text", "text": text}]), 400)
    assert err["param"] == "messages.0.content.1.text" and "must be a string" in err["message"]


@pytest.mark.parametrize("part, said", [("hello", "got a str"),
                                        ({"type": "image_url", "image_url": {"url": "data:,"}}, "got a 'image_url' part"),
                                        ({"type": "input_text", "text": "1+"}, "got a 'input_text' part")])
def test_a_content_part_that_is_not_text_is_400_naming_it_not_dropped(served, part, said):
    # (dropped, the turn was answered and trained on as if it said nothing)
    _, url = served
    err = error_of(chat(url, [{"type": "text", "text": "1+"}, part]), 400)
    assert err["param"] == "messages.0.content.1" and said in err["message"] and "text only" in err["message"], err
    r = chat(url, [{"type": "text", "text": "1+"}, {"text": "1="}])  # (a part without a type: text)
    assert r.status_code == 200, r.text[:300]


def test_megabytes_of_prompt_are_refused_by_their_characters_without_tokenizing(served, monkeypatch):
    api, url = served
    calls = []
    monkeypatch.setattr(api, "chat_prompt", lambda *a: calls.append(a) or [1])
    too_many = 32 * MAX_CHARS_PER_TOKEN + 1  # engine.max_prompt_tokens = 32
    err = error_of(chat(url, "7" * too_many), 400)
    assert err["code"] == "context_length_exceeded" and f"{too_many} characters in 1 message (" in err["message"]
    assert calls == []  # never tokenized
    r = httpx.post(f"{url}/completions", json={"model": "policy", "prompt": "7" * too_many}, timeout=30)
    assert error_of(r, 400)["param"] == "prompt"


def test_a_request_refused_for_its_settings_or_a_full_endpoint_is_refused_before_tokenizing(served, monkeypatch):
    # the template and the tokenizer run one request at a time: a flood of requests refused
    # anyway (an unknown model, a setting not served, a full endpoint) held up everyone's first token
    api, url = served
    calls = []
    monkeypatch.setattr(api, "chat_prompt", lambda *a: calls.append(a) or [1])
    monkeypatch.setattr(api, "completion_prompt", lambda *a: calls.append(a) or [1])
    for more, status, param in [({"model": "nope"}, 404, "model"), ({"top_p": 0.5}, 400, "top_p"),
                                ({"max_tokens": 10**9}, 400, "max_tokens"), ({"temperature": 0.3}, 400, "temperature"),
                                ({"stop": ["a"] * 5}, 400, "stop")]:
        assert error_of(chat(url, "1+1=", **more), status)["param"] == param
        r = httpx.post(f"{url}/completions", json={"model": "policy", "prompt": "1+1=", "max_tokens": 2, **more},
                       timeout=30)
        assert error_of(r, status)["param"] == param
    monkeypatch.setattr(api, "pending", api.config.max_pending)  # (full)
    full = chat(url, "1+1=")
    assert error_of(full, 429)["code"] == "rate_limit_exceeded" and full.headers["retry-after"] == "1"
    assert calls == []  # never tokenized


def test_thousands_of_messages_are_refused_by_their_count_without_rendering_or_tokenizing(served, monkeypatch):
    # each message is a few characters of the template's and none of content: each counts as a token
    from streamrl.chat import content_as_text

    _, url = served
    encoded = []
    encode = content_as_text.encode
    monkeypatch.setattr(content_as_text, "encode", lambda *a: encoded.append(a) or encode(*a))
    assert chat(url, "1+1=").status_code == 200 and len(encoded) == 1  # (the spy sees a prompt tokenized)
    body = {"model": "policy", "messages": [{"role": "user", "content": ""}] * 2000, "max_tokens": 2}
    err = error_of(httpx.post(f"{url}/chat/completions", json=body, timeout=30), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert "without tokenizing them" in err["message"] and "in 2000 messages" in err["message"] and len(encoded) == 1
    # past MAX_MESSAGES, refused as the body is read (here as parsed: that many pass this test's body limit)
    from streamrl.serve.request_bodies import APIError, ChatRequest, parse_body

    body["messages"] = [{"role": "user", "content": ""}] * (MAX_MESSAGES + 1)
    with pytest.raises(APIError) as e:
        parse_body(json.dumps(body).encode(), ChatRequest)
    assert e.value.param == "messages" and f"at most {MAX_MESSAGES} items" in e.value.message, e.value.message


def test_a_list_of_a_million_bad_items_is_one_error_not_a_million():
    # pydantic stops at the first bad item of such a list (a million errors took seconds of the
    # event loop to build); the error still names the item
    from pydantic import ValidationError

    from streamrl.serve.request_bodies import ChatRequest, CompletionRequest, parse_body

    for model, body in [(CompletionRequest, {"model": "m", "prompt": "x", "stop": [1] * 1_000_000}),
                        (CompletionRequest, {"model": "m", "prompt": [1.5] * 1_000_000}),
                        (ChatRequest, {"model": "m", "messages": [1] * 1_000_000})]:
        with pytest.raises(ValidationError) as e:
            model.model_validate(body)
        assert e.value.error_count() <= 2, model
    with pytest.raises(Exception) as e:
        parse_body(json.dumps({"model": "m", "prompt": [1, "a", 2, 3, 4, 5, 6, 7, 8, 9, 10, "bb"]}).encode(),
                   CompletionRequest)
    assert e.value.param == "prompt.1"  # the first bad item, not the longest name


def test_an_answer_of_megabytes_is_refused_naming_it(served):
    # (a completion keeps its answer until its feedback comes: 4 MB of answer was ~47 MB kept)
    from streamrl.serve.request_bodies import MAX_ANSWER_CHARS, APIError, ChatRequest, parse_body

    body = {"model": "m", "messages": [{"role": "user", "content": "1+1="}], "answer": ["ab"] * MAX_ANSWER_CHARS}
    with pytest.raises(APIError) as e:
        parse_body(json.dumps(body).encode(), ChatRequest)
    assert e.value.param == "answer" and f"at most {MAX_ANSWER_CHARS} characters" in e.value.message
    _, url = served
    assert chat(url, "1+1=", answer={"value": 2, "alternatives": ["2", "two"]}).status_code == 200


def test_a_template_that_fails_on_what_it_was_sent_is_that_requests_400(served, monkeypatch):
    # (a template filter reading a mapping it was given as a string raises TypeError inside jinja)
    api, url = served

    def template(*_, **__):
        raise TypeError("dictsort requires a mapping")

    monkeypatch.setattr(api.tokenizer, "apply_chat_template", template)
    err = error_of(chat(url, "1+1="), 400)
    assert err["param"] == "messages" and "TypeError: dictsort requires a mapping" in err["message"]


def test_a_failure_nobody_foresaw_is_that_requests_500_in_openais_shape(served, monkeypatch, caplog):
    api, url = served

    def broken(*_):
        raise KeyError("something internal")

    monkeypatch.setattr(api, "chat_prompt", broken)
    errors = api.traffic.counts["server_errors"]
    with caplog.at_level("ERROR", logger="streamrl.serve"):
        err = error_of(chat(url, "1+1="), 500)
    assert err["type"] == "server_error" and "KeyError" in err["message"]
    assert any("-> 500 KeyError" in rec.getMessage() for rec in caplog.records)
    assert api.traffic.counts["server_errors"] == errors + 1  # (serve/server_errors in the record)
    monkeypatch.undo()
    assert chat(url, "1+1=").status_code == 200  # and the next request is served
    assert json.loads(httpx.get(f"{url}/models", timeout=30).text)["data"][0]["id"] == "policy"


def test_an_engine_that_gives_a_log_prob_not_finite_fails_that_request_and_trains_nothing_of_it(served, monkeypatch):
    # a broken model or replica: a NaN log-prob went out as invalid JSON (and into a trajectory,
    # where its finish was a 500 after the rollout was gone); now that one request fails, cleanly
    api, url = served
    stream = api.engine.stream

    def nan_stream(rid, ids, max_new_tokens, on_tokens=None, **more):
        def poisoned(tokens, logprobs, version):
            on_tokens(tokens, [float("nan")] * len(logprobs), version)
        poisoned.flush = getattr(on_tokens, "flush", None)
        return stream(rid, ids, max_new_tokens, on_tokens=poisoned, **more)

    monkeypatch.setattr(api.engine, "stream", nan_stream)
    completions = api.traffic.counts["completions"]
    err = error_of(chat(url, "1+1=", logprobs=True), 500)
    assert err["type"] == "server_error" and "not a finite number" in err["message"]
    body = {"model": "policy", "messages": [{"role": "user", "content": "1+1="}], "max_tokens": 2, "stream": True}
    text = httpx.post(f"{url}/chat/completions", json=body, timeout=30).text
    assert "NaN" not in text and "not a finite number" in text and text.rstrip().endswith("}")
    assert api.traffic.counts["completions"] == completions  # (nothing of them handed to the learners)
    monkeypatch.undo()
    assert chat(url, "1+1=").status_code == 200  # and the next request is served


def test_refused_requests_are_a_few_lines_that_count_the_rest(served, caplog):
    from streamrl.serve.request_bodies import RefusalLog

    refusals = RefusalLog(every_s=5.0)
    with caplog.at_level("WARNING", logger="streamrl.serve"):
        for i in range(50):
            refusals.say(f"POST /v1/feedback -> 400 bad {i}")
        refusals.last -= 5.0  # (as if 5 s went by: no race with a loaded machine's clock)
        refusals.say("POST /v1/feedback -> 400 last")
    lines = [r.getMessage() for r in caplog.records if r.name == "streamrl.serve"]
    assert lines == ["POST /v1/feedback -> 400 bad 0",
                     "POST /v1/feedback -> 400 last (and 49 more refused since the last line)"]
    caplog.clear()
    # a path or a model name with a newline or an escape sequence cannot forge a line of the log
    with caplog.at_level("WARNING", logger="streamrl.serve"):
        RefusalLog().say("POST /v1/x\nstreamrl: run completed\x1b[2J -> 404")
    assert [r.getMessage() for r in caplog.records] == ["POST /v1/x\\nstreamrl: run completed\\x1b[2J -> 404"]
    caplog.clear()
    api, url = served
    before = dict(api.traffic.counts)
    with caplog.at_level("WARNING", logger="streamrl.serve"):
        for _ in range(40):  # a flood of bad feedback through the endpoint: each refused, few lines
            r = httpx.post(f"{url}/feedback", json={"id": "nope", "reward": "NaN"}, timeout=30)
            assert r.status_code == 400
    assert len([r for r in caplog.records if r.name == "streamrl.serve"]) <= 2  # (one window may close mid-flood)
    # but every one is counted (serve/invalid in the step's record), apart from the server's own errors
    assert api.traffic.counts["invalid"] - before["invalid"] == 40
    assert api.traffic.counts["server_errors"] == before["server_errors"]


class RaisingParser:
    """A tool parser with a bug."""

    start = "<tool_call>"
    keep_tokens = ()

    def parse(self, text):
        raise KeyError("oops")


class ShapelessParser:
    """A tool parser that returns its calls' arguments as a mapping (the contract says JSON text);
    the test then makes it give content, or arguments, of other types."""

    start = "<tool_call>"
    keep_tokens = ()

    def parse(self, text):
        return None, [{"name": "calc", "arguments": {"x": 1}}]


def test_a_tool_parser_that_raises_is_that_requests_openai_error_counted_and_the_endpoint_goes_on(tiny_model):
    import openai

    engine = SlotEngine(HFEngineConfig(batching="slots", slots=4, max_prompt_tokens=48, max_new_tokens=4,
                                       temperature=1.0, profile=False))
    engine.load(str(tiny_model))
    api = Endpoint(engine, ServeConfig(port=0), Traffic(60.0), "policy", RaisingParser())
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    ask = dict(model="policy", messages=[{"role": "user", "content": "1+2="}], max_tokens=4, tools=tools)
    try:
        with endpoint_in_process(api) as url:
            client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
            with pytest.raises(openai.InternalServerError) as err:
                client.chat.completions.create(**ask)
            assert err.value.status_code == 500 and err.value.code == "tool_parser_failed"
            assert "RaisingParser failed on this reply (KeyError" in err.value.message
            with pytest.raises(openai.APIError) as streamed:  # mid-stream: an error event, in OpenAI's shape
                list(client.chat.completions.create(**ask, stream=True))
            assert "RaisingParser failed" in str(streamed.value)
            counts = api.traffic.snapshot()
            assert counts["tool_parser_errors"] == 2
            # the client got an error and no reply: neither request's choices wait for a reward
            assert counts["waiting_for_reward"] == 0 and counts["ready"] == 0
            plain = client.chat.completions.create(**{**ask, "tools": None})  # no tools: no parser, answered
            assert plain.choices[0].message.content is not None
        # a call's arguments given as a mapping reach the client as OpenAI's JSON text
        shapeless = Endpoint(engine, ServeConfig(port=0), Traffic(60.0), "policy", ShapelessParser())
        with endpoint_in_process(shapeless) as url:
            client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
            (call,) = client.chat.completions.create(**ask).choices[0].message.tool_calls
            assert call.function.name == "calc" and call.function.arguments == '{"x": 1}'
            ShapelessParser.parse = lambda self, text: ({"not": "text"}, [])  # content that is not text: a 500
            with pytest.raises(openai.InternalServerError) as err:
                client.chat.completions.create(**ask)
            assert err.value.code == "tool_parser_failed" and "gave dict content" in err.value.message
            ShapelessParser.parse = lambda self, text: (None, [{"name": "calc", "arguments": 7}])
            with pytest.raises(openai.InternalServerError) as err:
                client.chat.completions.create(**ask)
            assert "has arguments of type int; expected JSON text" in err.value.message
    finally:
        engine.close()


class HangingParser:
    """A tool parser that never returns (until the test lets it go): a regular expression gone
    quadratic on a long reply, say."""

    start = "<tool_call>"
    keep_tokens = ()
    entered = threading.Event()
    release = threading.Event()

    def parse(self, text):
        HangingParser.entered.set()
        HangingParser.release.wait(60)
        return text, []


def test_a_tool_parser_that_hangs_is_that_requests_500_after_its_bound_and_others_are_answered_meanwhile(
        tiny_model, monkeypatch):
    import openai

    from streamrl.serve import response_bodies

    monkeypatch.setattr(response_bodies, "TOOL_PARSER_TIMEOUT_S", 5.0)  # (room for the other client on a loaded machine)
    engine = SlotEngine(HFEngineConfig(batching="slots", slots=4, max_prompt_tokens=48, max_new_tokens=4,
                                       temperature=1.0, profile=False))
    engine.load(str(tiny_model))
    api = Endpoint(engine, ServeConfig(port=0), Traffic(60.0), "policy", HangingParser())
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    ask = dict(model="policy", messages=[{"role": "user", "content": "1+2="}], max_tokens=4, tools=tools)
    try:
        with endpoint_in_process(api) as url, ThreadPoolExecutor(1) as pool:
            client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=20)
            hung = pool.submit(client.chat.completions.create, **ask)
            assert HangingParser.entered.wait(20)
            # the parser holds its thread, not the server's loop: another client is answered now
            plain = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=5).chat.completions.create(
                **{**ask, "tools": None})
            assert plain.choices[0].message.content is not None and not hung.done()
            with pytest.raises(openai.InternalServerError) as err:
                hung.result(timeout=20)
            assert err.value.code == "tool_parser_failed"
            assert err.value.message.endswith(" - serve.tool_parser HangingParser did not finish parsing this reply within 5 s.")
            with pytest.raises(openai.APIError) as streamed:  # streamed, with the parser still stuck: an error event
                list(client.chat.completions.create(**ask, stream=True))
            assert "did not finish parsing" in str(streamed.value)
            assert api.traffic.snapshot()["tool_parser_errors"] == 2
    finally:
        HangingParser.release.set()
        engine.close()


def test_an_endpoint_that_serves_for_months_remembers_a_bounded_number_of_ended_completions_and_sessions(monkeypatch):
    from streamrl.sample import Prompt, Sample
    from streamrl.serve import traffic as traffic_module

    monkeypatch.setattr(traffic_module, "REMEMBERED", 100)
    monkeypatch.setattr(traffic_module, "REMEMBERED_SESSIONS", 10)
    traffic = Traffic(60.0)

    def serve(cid: str, session: str, ready: bool) -> None:
        traffic.started(cid, session=session, model="policy", n=1)
        prompt = Prompt(uid=cid, text="1+2=")
        traffic.finished(cid, [Sample(uid=f"{cid}-0", prompt=prompt, prompt_ids=[1], response_ids=[2], logprobs=[0.0],
                                      reward=1.0 if ready else None)], ready=ready)

    for i in range(1000):  # one client's session, on and on, and a new session every 10th request
        serve(f"c{i}", "one" if i % 10 else f"s{i}", ready=i % 2 == 0)
        if i % 2:
            assert traffic.feedback(f"c{i}", None, 0.5) is None
        traffic.take(i, 1, 0, 0.0)
    assert len(traffic._state) <= 101 and len(traffic._model) <= 101 and len(traffic._sessions) <= 10
    assert all(len(ids) <= 2 for ids in traffic._sessions.values())
    assert traffic.feedback("c999", None, 1.0) == "completion 'c999' is already rewarded"  # the latest: remembered
    assert traffic.feedback("c3", None, 1.0) == "no completion with id 'c3'"  # long ago: forgotten
    serve("c1000", "one", ready=False)  # the session goes on: feedback for it still reaches its open completion
    assert traffic.session_feedback("one", 1.0) == (1, None)
    assert traffic.snapshot()["rewarded"] == 1001


def test_a_session_whose_first_completion_stays_open_holds_a_bounded_list_of_ids(monkeypatch):
    # its head open (a stream read slowly, or no feedback yet), the ended ids behind it were kept,
    # one a request, for as long as it was: millions, then popped one by one from a list's front
    from streamrl.sample import Prompt, Sample
    from streamrl.serve import traffic as traffic_module

    monkeypatch.setattr(traffic_module, "SESSION_COMPLETIONS", 50)
    traffic = Traffic(3600.0)
    traffic.started("head", session="s", model="policy", n=1)  # running, and stays so
    for i in range(2000):
        traffic.started(f"c{i}", session="s", model="policy", n=1)
        traffic.dropped(f"c{i}")  # (cancelled: ended)
    assert len(traffic._sessions["s"]) <= 51
    for i in range(60):  # open ones past the bound: the oldest are let go, the newest kept
        traffic.started(f"o{i}", session="s", model="policy", n=1)
    ids = list(traffic._sessions["s"])
    assert len(ids) == 50 and ids[-1] == "o59" and "head" not in ids
    prompt = Prompt(uid="o59", text="1+2=")
    traffic.finished("o59", [Sample(uid="o59-0", prompt=prompt, prompt_ids=[1], response_ids=[2], logprobs=[0.0])])
    assert traffic.session_feedback("s", 1.0) == (50, None)
    assert traffic.feedback("head", None, 1.0) is None  # (by its id, it is reached still)


@pytest.mark.parametrize("path, field", [("/chat/completions", "model"), ("/feedback", "id"), ("/feedback", "session")])
def test_a_name_or_id_of_tens_of_kb_is_refused_without_being_said_back(served, path, field):
    _, url = served
    huge = "m" * (50_000 if field == "model" else 3_000)  # (under the route's body limit here)
    body = {"model": "policy", "messages": [{"role": "user", "content": "1+2="}]} if field == "model" else \
        {field: huge, "reward": 1.0}
    if field == "model":
        body["model"] = huge
    r = httpx.post(f"{url}{path}", json=body, timeout=30)
    err = error_of(r, 400)
    assert err["param"] == field and len(r.text) < 1000, r.text[:300]
    if path == "/feedback":  # and a feedback body of tens of KB is not one: refused before it is read
        r = httpx.post(f"{url}{path}", json={field: "m" * 50_000, "reward": 1.0}, timeout=30)
        assert error_of(r, 413)["code"] == "request_too_large" and "4096 bytes" in r.text


def test_a_client_that_goes_away_before_a_whole_reply_cancels_it(long_model):
    # a request without stream: the route looks for the client between decode steps; under
    # Starlette's BaseHTTPMiddleware it never saw it leave, and the reply decoded to its end
    engine = SlotEngine(HFEngineConfig(batching="slots", slots=4, max_prompt_tokens=32, max_new_tokens=4000,
                                       temperature=1.0, profile=False))
    engine.load(str(long_model))
    engine.decoder.stop_ids.fill_(-1)  # (no early end: only the cancel ends it before 4,000 tokens)
    api = Endpoint(engine, ServeConfig(port=0), Traffic(60.0), "policy")
    try:
        with endpoint_in_process(api) as url:
            host, port = url.split("//")[1].split("/")[0].split(":")
            body = json.dumps({"model": "policy", "prompt": "1+1=", "max_tokens": 4000}).encode()
            with socket.create_connection((host, int(port)), timeout=20) as gone:
                gone.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
                             f"content-length: {len(body)}\r\n\r\n".encode() + body)
                assert until(lambda: api.pending == 1, 30)
            assert until(lambda: api.traffic.counts.get("cancelled", 0) == 1, 60)
            assert api.pending == 0 and engine.loop_counts["steps"] < 4000
    finally:
        engine.close()


def test_a_client_that_goes_away_while_its_request_waits_for_a_slot_cancels_it_at_once(long_model):
    # its route looked for the client only when tokens came: one queued behind long replies (or
    # sent to a replica gone silent) kept its place in serve.max_pending until then
    engine = SlotEngine(HFEngineConfig(batching="slots", slots=1, max_prompt_tokens=32, max_new_tokens=4000,
                                       temperature=1.0, profile=False))
    engine.load(str(long_model))
    engine.decoder.stop_ids.fill_(-1)  # (the first reply holds the one slot for 4,000 tokens)
    api = Endpoint(engine, ServeConfig(port=0), Traffic(60.0), "policy")
    try:
        with endpoint_in_process(api) as url:
            host, port = url.split("//")[1].split("/")[0].split(":")
            body = json.dumps({"model": "policy", "prompt": "1+1=", "max_tokens": 4000}).encode()
            head = (f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\n\r\n").encode()
            with socket.create_connection((host, int(port)), timeout=20) as stays:
                stays.sendall(head + body)
                assert until(lambda: engine.loop_counts["steps"] > 0, 30)  # (decoding: the slot is taken)
                with socket.create_connection((host, int(port)), timeout=20) as gone:
                    gone.sendall(head + body)
                    assert until(lambda: api.pending == 2, 30)
                left = time.time()
                assert until(lambda: api.traffic.counts.get("cancelled", 0) == 1, 30)
                assert time.time() - left < 10 and api.pending == 1  # (the one whose client stays goes on)
                assert engine.loop_counts["steps"] < 4000
            assert until(lambda: api.pending == 0, 60)
    finally:
        engine.close()


def test_feedback_on_a_greedy_completion_is_refused_while_it_runs_and_after(served):
    # (a greedy reply is not a sample of the policy: feedback it "accepted" was then dropped)
    api, url = served
    traffic = Traffic(60.0)
    traffic.started("cmpl-g", session="s", n=1, trained=False)
    refused = traffic.feedback("cmpl-g", None, 1.0)
    assert refused and "greedy (temperature 0)" in refused
    assert traffic.session_feedback("s", 1.0)[0] == 0  # (not among its session's waiting completions)
    traffic.dropped("cmpl-g")
    assert "greedy (temperature 0)" in traffic.feedback("cmpl-g", None, 1.0)
    done = httpx.post(f"{url}/completions", json={"model": "policy", "prompt": "1+1=", "temperature": 0,
                                                  "max_tokens": 2}, timeout=30).json()
    err = error_of(httpx.post(f"{url}/feedback", json={"id": done["id"], "reward": 1.0}, timeout=30), 400)
    assert "greedy (temperature 0)" in err["message"] and err["param"] == "id"


def test_refused_feedback_names_the_field_the_refusal_is_about_whatever_the_id_says(served):
    # (the field once came from the refusal's words: an unknown id holding "choice" named index)
    _, url = served
    err = error_of(httpx.post(f"{url}/feedback", json={"id": "choice-index-7", "index": 0, "reward": 1.0},
                              timeout=30), 404)
    assert err["param"] == "id" and "choice-index-7" in err["message"]
    done = httpx.post(f"{url}/completions", json={"model": "policy", "prompt": "1+1=", "n": 2, "max_tokens": 2},
                      timeout=30).json()
    err = error_of(httpx.post(f"{url}/feedback", json={"id": done["id"], "index": 5, "reward": 1.0}, timeout=30), 400)
    assert err["param"] == "index" and "out of range" in err["message"]
    assert httpx.post(f"{url}/feedback", json={"id": done["id"], "index": 1, "reward": 1.0}, timeout=30).status_code == 200
    err = error_of(httpx.post(f"{url}/feedback", json={"id": done["id"], "index": 1, "reward": 0.0}, timeout=30), 400)
    assert err["param"] == "index" and "already rewarded" in err["message"]
    err = error_of(httpx.post(f"{url}/feedback", json={"id": done["id"], "reward": 0.0}, timeout=30), 400)
    assert err["param"] == "id" and "rewarded already" in err["message"]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_token_limit_past_the_engines_is_400_naming_the_field_sent(served, field):
    _, url = served
    body = {"model": "policy", "messages": [{"role": "user", "content": "1+1="}], field: 10_000}
    err = error_of(httpx.post(f"{url}/chat/completions", json=body, timeout=30), 400)
    assert err["param"] == field and err["message"].startswith(f"{field} 10000 is more than")


# -- before the app: the server's own bounds on a request's head and on connections ------------


ENDLESS_CLOSED = threading.Event()


async def endless():
    """An answer without end, as a long stream of tokens (each chunk waits on the loop, as a
    token waits on the engine); says when it was closed."""
    import asyncio

    try:
        while True:
            await asyncio.sleep(0.001)
            yield b"x" * 65536
    finally:
        ENDLESS_CLOSED.set()


async def echo_length(scope, receive, send):
    """An ASGI app that answers 200 with the length of the body it read (``/endless``: an
    answer streamed for ever, as the endpoint streams, through Starlette's response)."""
    if scope["path"] == "/endless":
        from starlette.responses import StreamingResponse

        return await StreamingResponse(endless())(scope, receive, send)
    size, more = 0, True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": str(size).encode()})


@pytest.fixture(scope="module")
def bounded():
    from streamrl.serve.http_server import bounded_protocol, start_in_thread

    server, thread, port = start_in_thread(echo_length, "127.0.0.1", 0, "test-bounded", protocol=bounded_protocol(
        head_limit=16 * 1024, head_timeout_s=1.0, connections=4, write_timeout_s=1.0))
    yield port
    server.should_exit = True
    thread.join(5)


def answer_of(sock: socket.socket) -> bytes:
    """All the server sends until it closes the connection (a timeout here: it never did)."""
    out = b""
    while got := sock.recv(65536):
        out += got
    return out


def test_a_request_line_or_header_sent_without_end_is_431_and_a_large_body_is_not(bounded):
    for head in (b"GET /" + b"a" * 40_000, b"GET / HTTP/1.1\r\nhost: x\r\nx-a: " + b"b" * 40_000):
        with socket.create_connection(("127.0.0.1", bounded), timeout=10) as s:
            try:
                for k in range(0, len(head), 4096):  # in pieces, as a client streams it
                    s.sendall(head[k:k + 4096])
            except (BrokenPipeError, ConnectionResetError):
                pass  # (the server closed the connection partway: what it answered comes next)
            try:
                answer = answer_of(s)
            except ConnectionResetError:  # closed with the client's bytes unread: the kernel's reset
                answer = None             # may overtake the answer; the connection ended, as it must
        if answer is not None:
            assert answer.startswith(b"HTTP/1.1 431"), answer[:100]
    # past the limit in one send, then nothing more: every byte read, so the answer arrives whole
    with socket.create_connection(("127.0.0.1", bounded), timeout=10) as s:
        s.sendall(b"GET /" + b"a" * 20_000)
        answer = answer_of(s)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:100]
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == "request_header_fields_too_large" and "16384 bytes" in error["message"]
    # a small head with a body four times the head limit, in one send: the body is the app's
    body = b"x" * 65_536
    r = httpx.post(f"http://127.0.0.1:{bounded}/", content=body, timeout=10)
    assert r.status_code == 200 and r.text == str(len(body))


def test_bytes_that_are_not_http_are_400_in_the_apis_error_shape(bounded):
    for garbage in (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,  # (a TLS hello)
                    b"GET / HTTP/1.1\r\nhost x\r\n\r\n",  # (a header without its colon)
                    b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: nine\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", bounded), timeout=10) as s:
            s.sendall(garbage)
            answer = answer_of(s)
        assert answer.startswith(b"HTTP/1.1 400"), answer[:100]
        head, body = answer.split(b"\r\n\r\n", 1)
        assert b"content-type: application/json" in head.lower()
        error = json.loads(body)["error"]
        assert error["code"] == "invalid_http_request" and error["type"] == "invalid_request_error"


def test_a_head_that_stalls_is_408_after_the_timeout_and_a_silent_connection_is_closed(bounded):
    for sent in (b"POST / HTTP/1.1\r\nhost: x\r\n", b""):
        start = time.time()  # (before connecting: the server's timer starts at its accept)
        with socket.create_connection(("127.0.0.1", bounded), timeout=10) as s:
            s.sendall(sent)
            answer = answer_of(s)
        assert 0.8 < time.time() - start < 5, time.time() - start
        assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
    # a keep-alive connection's second request has the same time for its head, from its first byte
    with socket.create_connection(("127.0.0.1", bounded), timeout=10) as s:
        s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        s.sendall(b"GET / HTTP/1.1\r\n")
        assert answer_of(s).startswith(b"HTTP/1.1 408")


def test_connections_past_the_limit_are_answered_503_at_once_and_one_freed_lets_the_next_in(bounded):
    held = [socket.create_connection(("127.0.0.1", bounded), timeout=10) for _ in range(4)]
    try:
        with socket.create_connection(("127.0.0.1", bounded), timeout=10) as extra:
            start = time.time()
            answer = answer_of(extra)  # closed well before the head timeout: no descriptor held for it
            # (well under the head timeout of 1 s: a loaded machine may take a tenth of it)
            assert time.time() - start < 0.9 and answer.startswith(b"HTTP/1.1 503"), answer[:100]
            assert b"retry-after: 1" in answer and b"too_many_connections" in answer
        held.pop().close()

        def answered() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{bounded}/", timeout=5).status_code == 200
            except httpx.TransportError:  # (the server has not seen the close yet)
                return False
        until(answered, 5)
    finally:
        for s in held:
            s.close()


def test_a_client_that_stops_reading_a_stream_is_cut_after_the_write_timeout_and_the_answer_closed(bounded):
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (before connecting: the window it offers)
        s.settimeout(10)
        s.connect(("127.0.0.1", bounded))
        s.sendall(b"GET /endless HTTP/1.1\r\nhost: x\r\n\r\n")
        # reads nothing: the server's buffers fill, its writer waits, and after the write timeout
        # the connection is cut and the answer's generator closed, as for a client that went away
        assert ENDLESS_CLOSED.wait(15)
        got = 0
        with pytest.raises((ConnectionResetError, AssertionError)):
            while chunk := s.recv(1 << 20):
                got += len(chunk)
            raise AssertionError(f"the connection ended without a reset after {got} bytes")
        assert got < 64 * 2**20  # (what the buffers held, not an answer without end)


def test_a_number_that_is_not_finite_anywhere_in_the_body_is_a_400_naming_where(served):
    _, url = served
    for field, where in ((b'"answer": NaN', "answer"), (b'"answer": {"x": [1, -Infinity]}', "answer.x.1"),
                         (b'"temperature": 1e999', "temperature")):
        body = b'{"model": "policy", "prompt": "1+1=", "max_tokens": 2, ' + field + b"}"
        r = httpx.post(f"{url}/completions", content=body, headers={"content-type": "application/json"}, timeout=30)
        assert error_of(r, 400)["param"] == where
    r = httpx.post(f"{url}/completions", json={"model": "policy", "prompt": "1+1=", "stop": list("abcde")}, timeout=30)
    assert error_of(r, 400)["param"] == "stop"


def test_bodies_being_read_past_the_admission_budget_are_429_until_room_is_made(served, monkeypatch):
    api, url = served
    monkeypatch.setattr(api, "admission_budget", 150)
    # (the held body must not reach its 408 while the others are asked: a loaded machine is slow)
    monkeypatch.setattr(api.config, "body_timeout_s", 30.0)
    host, port = url.split("//")[1].split("/")[0].split(":")
    body = json.dumps({"model": "policy", "prompt": "1+1=", "max_tokens": 2}).encode()
    post = partial(httpx.post, f"{url}/completions", headers={"content-type": "application/json"}, timeout=30)
    with socket.create_connection((host, int(port)), timeout=20) as slow:
        # 60 KB declared and 10 sent: only what came is held, so another request is answered ...
        slow.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
                     "content-length: 60000\r\n\r\n".encode() + body[:10])
        until(lambda: api.admitted_bytes == 10, 10)
        assert post(content=body).status_code == 200
        # ... until 100 bytes of it are held: then another is one too many
        slow.sendall(b" " * 90)
        until(lambda: api.admitted_bytes == 100, 10)
        r = post(content=body)
        assert error_of(r, 429)["code"] == "rate_limit_exceeded" and r.headers["retry-after"] == "1"
        # feedback is not held up by slow completion bodies (it has a bound of its own, 4 KB)
        fb = httpx.post(f"{url}/feedback", json={"id": "x" * 100, "reward": 1.0}, timeout=30)  # (past the 50 bytes left)
        assert error_of(fb, 404)["param"] == "id"  # (read and answered: an unknown id)
        slow.shutdown(socket.SHUT_WR)  # (the client gives up: its request ends, its room given back)
        until(lambda: api.admitted_bytes == 0, 10)
    assert post(content=body).status_code == 200


def test_a_chunked_body_whose_trailer_never_ends_is_refused_like_a_header(bounded):
    with socket.create_connection(("127.0.0.1", bounded), timeout=10) as s:
        s.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n")
        trailer = b"x-t: " + b"b" * 40_000
        try:
            for k in range(0, len(trailer), 4096):
                s.sendall(trailer[k:k + 4096])
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            answer = answer_of(s)
        except ConnectionResetError:
            answer = None  # (closed with the client's bytes unread: the kernel's reset may overtake the answer)
    assert answer is None or answer.startswith(b"HTTP/1.1 431"), answer[:100]
    # a chunked body of ordinary chunks is the app's, however long
    r = httpx.post(f"http://127.0.0.1:{bounded}/", content=iter([b"x" * 4096] * 32), timeout=10)
    assert r.status_code == 200 and r.text == str(4096 * 32)


def test_a_client_that_reads_slowly_is_not_cut(bounded):
    ENDLESS_CLOSED.clear()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(10)
        s.connect(("127.0.0.1", bounded))
        s.sendall(b"GET /endless HTTP/1.1\r\nhost: x\r\n\r\n")
        got, end = 0, time.time() + 3  # three times the write timeout, reading a little at a time
        while time.time() < end:
            got += len(s.recv(8192))
            time.sleep(0.05)
        assert got > 0 and not ENDLESS_CLOSED.is_set()
    assert ENDLESS_CLOSED.wait(10)  # (and once it goes, the answer is closed)


def test_a_sessions_reward_fills_only_the_choices_without_one_and_recipe_mode_keeps_no_feedback():
    from streamrl.sample import Prompt, Sample

    traffic = Traffic(60.0)

    def group(cid: str, n: int) -> list[Sample]:
        prompt = Prompt(uid=cid, text="1+2=")
        return [Sample(uid=f"{cid}-{k}", prompt=prompt, prompt_ids=[1], response_ids=[2], logprobs=[0.0])
                for k in range(n)]

    for cid in ("a", "b", "c"):
        traffic.started(cid, session="s", model="policy", n=2)
    assert traffic.feedback("a", None, 1.0) is None       # a: both choices by its own feedback (still running)
    assert traffic.feedback("b", 0, 1.0) is None          # b: choice 0 by its own feedback (still running)
    traffic.finished("c", group("c", 2))                  # c: ended, waiting
    assert traffic.feedback("c", 1, 1.0) is None          # c: choice 1 by its own feedback
    assert traffic.session_feedback("s", -1.0) == (2, None)  # reaches b and c, not a: their own rewards stand
    traffic.finished("a", group("a", 2))
    traffic.finished("b", group("b", 2))
    rewards = {g[0].uid[0]: [s.reward for s in g] for g in traffic.take(0, 6, 0, 0.0)}
    assert rewards == {"a": [1.0, 1.0], "b": [1.0, -1.0], "c": [-1.0, 1.0]}
    # with the recipe's reward, feedback that came while a request ran is not kept once it ends
    traffic.started("d", session=None, model="policy", n=1)
    traffic.feedback("d", None, 1.0)
    traffic.finished("d", group("d", 1), ready=True)
    assert "d" not in traffic._early


def test_samples_waiting_for_feedback_past_max_waiting_are_answered_and_not_kept(served, monkeypatch):
    # a 429 there let one client that never sends feedback keep every other client out for the
    # feedback timeout; and the bound counted requests, each up to 64 samples
    api, url = served
    monkeypatch.setattr(api, "traffic", Traffic(3600.0))
    monkeypatch.setitem(api.config.__dict__, "max_waiting", 2)  # (past the recipe's check: samples_per_step + 64)
    ask = partial(httpx.post, f"{url}/completions", timeout=30)
    body = {"model": "policy", "prompt": "1+1=", "max_tokens": 2}
    before = api.traffic.snapshot()
    first = ask(json={**body, "n": 2})
    assert first.status_code == 200, first.text
    for more in (body, {**body, "n": 3}):  # the first's 2 samples wait for their feedback: no room for more
        r = ask(json=more)
        assert r.status_code == 200, r.text  # answered all the same
        refused = httpx.post(f"{url}/feedback", json={"id": r.json()["id"], "reward": 1.0}, timeout=30)
        assert "serve.max_waiting" in error_of(refused, 400)["message"]
    after = api.traffic.snapshot()
    assert after["unkept"] - before["unkept"] == 4
    assert after["waiting_for_reward"] - before["waiting_for_reward"] == 2  # (the unkept ones hold nothing)
    greedy = httpx.post(f"{url}/completions", json={**body, "temperature": 0}, timeout=30)
    assert greedy.status_code == 200
    assert httpx.post(f"{url}/feedback", json={"id": first.json()["id"], "reward": 1.0}, timeout=30).status_code == 200
    assert ask(json=body).status_code == 200 and api.traffic.snapshot()["unkept"] == 5  # (rewarded, held for a step)
    assert len(api.traffic.take(0, 2, 0, 0.0)) == 1
    kept = ask(json=body)  # the step that took it made room
    assert httpx.post(f"{url}/feedback", json={"id": kept.json()["id"], "reward": 1.0}, timeout=30).status_code == 200


def test_traffic_rewarded_by_the_recipe_faster_than_the_steps_take_it_is_held_to_max_waiting(served, monkeypatch):
    # (ready at once, it grew without bound while the steps stalled, and every checkpoint held it)
    api, url = served
    monkeypatch.setattr(api, "traffic", Traffic(60.0))
    # (both in the config's own dict: past the recipe's check of max_waiting against samples_per_step + 64,
    # which a setattr of either would run, undone in any order)
    monkeypatch.setitem(api.config.__dict__, "reward", "recipe")
    monkeypatch.setitem(api.config.__dict__, "max_waiting", 3)
    body = {"model": "policy", "prompt": "1+1=", "max_tokens": 2}
    for n in (2, 1, 1, 2):
        assert httpx.post(f"{url}/completions", json={**body, "n": n}, timeout=30).status_code == 200
    stats = api.traffic.snapshot()
    assert stats["ready"] == 3 and stats["unkept"] == 3, stats
    assert len(api.traffic.take(0, 3, 0, 0.0)) == 2  # a step took them: room again
    assert httpx.post(f"{url}/completions", json=body, timeout=30).status_code == 200
    assert api.traffic.snapshot()["ready"] == 1


def test_an_engine_that_fails_to_start_a_request_gives_back_its_places_and_n_past_them_is_400(served, monkeypatch):
    # the places a request takes were counted before the engine took it, and only its own
    # ValueError gave them back: any other failure held them for good, and enough of them made
    # the endpoint answer 429 to everyone. Its words named the replica's internal address too.
    api, url = served
    engine = api.engine
    stream = engine.stream
    calls = []

    def fails_on_the_second_choice(rid, *args, **kwargs):
        calls.append(rid)
        if len(calls) % 2 == 0:
            raise RuntimeError("Server error '503' for url 'http://10.1.2.3:40000/generate'")
        return stream(rid, *args, **kwargs)

    monkeypatch.setattr(engine, "stream", fails_on_the_second_choice)
    monkeypatch.setattr(api.config, "max_pending", 4)
    places = lambda: (api.pending, api.running.get(id(engine), 0))  # noqa: E731
    before = places()
    for _ in range(3):  # (more than max_pending's worth of places, each given back)
        err = error_of(httpx.post(f"{url}/completions", json={"model": "policy", "prompt": "1+1=", "max_tokens": 2,
                                                                "n": 2}, timeout=30), 500)
        assert err["type"] == "server_error" and "RuntimeError" in err["message"], err
        assert "10.1.2.3" not in err["message"] and "40000" not in err["message"] and "<replica>" in err["message"]
    assert places() == before
    monkeypatch.setattr(engine, "stream", stream)
    # and n past what runs at once is that request's 400, not a 429 its client retries for ever
    err = error_of(httpx.post(f"{url}/completions", json={"model": "policy", "prompt": "1+1=", "max_tokens": 2,
                                                            "n": 5}, timeout=30), 400)
    assert err["param"] == "n" and "serve.max_pending" in err["message"], err
    ok = httpx.post(f"{url}/completions", json={"model": "policy", "prompt": "1+1=", "max_tokens": 2, "n": 2},
                    timeout=30)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2, ok.text


def test_a_replica_gone_silent_fails_its_requests_after_a_few_heartbeats_and_is_passed_over(served, monkeypatch):
    # a token server that took the request and then said nothing (its host stopped, its process
    # frozen): the endpoint waited ten minutes for a line, and kept sending it new requests
    import asyncio
    from concurrent.futures import Future

    from streamrl.serve import remote_engines

    api, _ = served
    monkeypatch.setattr(remote_engines, "SILENT_S", 1.0)
    listener = socket.create_server(("127.0.0.1", 0))
    held = []

    def answer_then_nothing():
        conn, _ = listener.accept()
        held.append(conn)
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n")

    threading.Thread(target=answer_then_nothing, daemon=True).start()
    silent = remote_engines.RemoteEngine(api.engine, f"http://127.0.0.1:{listener.getsockname()[1]}", "key", "gen-1")

    async def ask() -> Future:
        future = silent.stream("r-1", [1, 2], 4)
        while not future.done():
            await asyncio.sleep(0.05)
        return future

    t0 = time.time()
    future = asyncio.run(ask())
    assert time.time() - t0 < 10
    with pytest.raises(RuntimeError, match="worker 'gen-1' could not be reached: ReadTimeout"):
        future.result()
    assert time.time() - silent.failed_at < 10  # (the endpoint passes it over for a while)
    for conn in held:
        conn.close()
    listener.close()


def test_a_token_server_sends_a_heartbeat_while_its_request_waits(monkeypatch):
    # what tells a waiting replica from a silent one: an empty line every HEARTBEAT_S
    import asyncio
    from concurrent.futures import Future

    from streamrl.serve import remote_engines

    monkeypatch.setattr(remote_engines, "HEARTBEAT_S", 0.1)

    three = threading.Event()  # (set once three heartbeats came: no race between timers on a loaded machine)

    class QueuedEngine:  # (stand-in for a slot engine whose slots are all taken: it answers after three heartbeats)
        def stream(self, rid, ids, max_new_tokens, on_tokens=None, greedy=False):
            future = Future()

            def answer():
                three.wait(10)  # (without heartbeats it answers after 10 s, and the count below fails)
                on_tokens([7], [-0.5], 3)
                future.set_result(type("R", (), {"tokens": [7]})())

            threading.Thread(target=answer, daemon=True).start()
            return future

        def cancel(self, rid):
            pass

    async def lines():
        got = []
        async for line in remote_engines._decode(QueuedEngine(), {"rid": "r", "ids": [1], "max_new_tokens": 1}):
            got.append(line)
            if got.count("\n") >= 3:
                three.set()
        return got

    got = asyncio.run(lines())
    assert got[0] == "\n" and got.count("\n") >= 3  # (waiting: heartbeats, each an empty line)
    assert [json.loads(line) for line in got if line.strip()] == [{"tokens": [7], "logprobs": [-0.5], "version": 3},
                                                                   {"done": [7]}]


def test_a_replica_leaving_the_pool_finishes_its_running_requests_and_takes_no_more(served):
    # an elastic pool retiring a generate worker: its requests in flight failed with it (500s,
    # or an error mid-stream) though they could have run to their end on a worker still up
    import asyncio
    from concurrent.futures import Future

    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from streamrl.serve import remote_engines
    from streamrl.serve.http_server import start_in_thread

    api, _ = served

    async def slow_tokens(request):
        async def lines():
            for k in range(5):
                await asyncio.sleep(0.2)
                yield json.dumps({"tokens": [k], "logprobs": [-0.5], "version": 0}) + "\n"
            yield json.dumps({"done": list(range(5))}) + "\n"
        return StreamingResponse(lines(), media_type="application/x-ndjson")

    server, thread, port = start_in_thread(Starlette(routes=[Route("/generate", slow_tokens, methods=["POST"])]),
                                           "127.0.0.1", 0, "test-replica")
    try:
        for how, finishes in (("retire", True), ("close", False)):
            replica = remote_engines.RemoteEngine(api.engine, f"http://127.0.0.1:{port}", "key", "generate-1")

            async def ask() -> Future:
                future = replica.stream("r-1", [1, 2], 5)
                await asyncio.sleep(0.3)  # (decoding there)
                getattr(replica, how)()
                while not future.done():
                    await asyncio.sleep(0.05)
                while not replica.closed:  # (retired: closed once its last request ended)
                    await asyncio.sleep(0.05)
                return future

            future = asyncio.run(ask())
            if finishes:
                assert future.result().tokens == [0, 1, 2, 3, 4]
            else:
                with pytest.raises(RuntimeError, match="no longer served"):
                    future.result()
    finally:
        server.should_exit = True
        thread.join(timeout=5)


def test_served_requests_count_as_the_workers_work():
    # on a generate worker "busy" was a task executing: a replica decoding an endpoint's requests
    # ran none, so an elastic pool judged it idle and retired it under its requests
    from streamrl.telemetry import bubbles

    clock = bubbles.BusyClock()
    clock.setup(None)
    try:
        assert bubbles.served_in_flight() == 0 and clock.read() == 0.0
        first, second = bubbles.begin_work(), bubbles.begin_work()
        time.sleep(0.2)
        bubbles.end_work(first)
        bubbles.end_work(first)  # (said twice: ended once)
        assert bubbles.served_in_flight() == 1 and clock.read() >= 0.2  # (still at work: one runs)
        bubbles.end_work(second)
        done = clock.read()
        time.sleep(0.1)
        assert bubbles.served_in_flight() == 0 and clock.read() == done >= 0.2
    finally:
        bubbles._PROCESS_CLOCK[0] = None


TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("more, says", [
    ({"tool_choice": "auto"}, "'tool_choice' is only allowed when 'tools' are specified"),
    ({"tool_choice": "always", "tools": [TOOL]}, "'always'; expected 'none', 'auto', 'required' or a function"),
    ({"tool_choice": {"type": "function", "function": {"name": "mul"}}, "tools": [TOOL]},
     "no function named 'mul' among the tools"),
    ({"tool_choice": {"type": "function"}, "tools": [TOOL]}, "expected {'type': 'function', 'function': {'name'"),
])
def test_a_tool_choice_openai_refuses_is_400_naming_it(served, more, says):
    # (accepted before: a named function not among the tools, or a choice without tools, went on
    # as if no tool had been asked for)
    _, url = served
    err = error_of(chat(url, "1+1=", **more), 400)
    assert err["param"] == "tool_choice" and says in err["message"], err
    # (a forced choice, as agent frameworks send by default, is parsed as "auto": not refused)
    for choice in ("auto", "required", {"type": "function", "function": {"name": "add"}}):
        assert chat(url, "1+1=", tools=[TOOL], tool_choice=choice).status_code == 200, choice
    ok = chat(url, "1+1=", tools=[TOOL], tool_choice="auto")
    assert ok.status_code == 200 and chat(url, "1+1=", tool_choice="none").status_code == 200


def test_a_stream_read_slowly_gives_its_places_back_once_the_engine_is_done(served):
    # a client reading a trickle (a byte every few seconds) held its places in serve.max_pending
    # until it read the last one: four such streams of n = 64 held all 256 for hours. Driven at
    # the ASGI level with a client that is still there and has not taken the first chunk yet
    import asyncio

    from streamrl.serve.routes import make_app

    api, _ = served
    app = make_app(api)
    before = api.pending
    body = json.dumps({"model": "policy", "prompt": "1+1=", "max_tokens": 4, "n": 3, "stream": True}).encode()
    seen = []

    async def one_request():
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        connected = asyncio.Event()  # (never set: the client stays)

        async def receive():
            if messages:
                return messages.pop(0)
            await connected.wait()

        async def send(message):
            if message["type"] == "http.response.body":
                await asyncio.sleep(3600)  # (the client's window: full, the write waits)

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json"),
                                                                    (b"content-length", str(len(body)).encode())],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        task = asyncio.create_task(app(scope, receive, send))
        for _ in range(200):  # up to 10 s for the engine to decode 3 x 4 tokens
            await asyncio.sleep(0.05)
            seen.append(api.pending)
            if api.pending == before:
                break
        assert not task.done()  # (the response is still being written)
        task.cancel()

    asyncio.run(one_request())
    assert seen[-1] == before, seen


def test_a_stream_whose_client_left_before_its_first_chunk_gives_its_places_back(served):
    # Starlette listens for the disconnect beside the stream: a client gone before the response
    # began had the stream cancelled before its generator ever ran, and the generator's own
    # clean-up with it -- its places in serve.max_pending were held for good. Driven here at the
    # ASGI level, as uvicorn calls the app, with a send that has not sent the response's start yet
    import asyncio

    from streamrl.serve.routes import make_app

    api, _ = served
    app = make_app(api)
    before = api.pending
    body = json.dumps({"model": "policy", "prompt": "1+1=", "max_tokens": 4, "n": 3, "stream": True}).encode()

    async def one_request():
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.start":
                await asyncio.sleep(3600)  # (the client's socket: gone, the write never completes)

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json"),
                                                                    (b"content-length", str(len(body)).encode())],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        await asyncio.wait_for(app(scope, receive, send), 30)

    asyncio.run(one_request())
    assert until(lambda: api.pending == before, 10, every=0.05)


def test_a_whole_reply_is_built_and_encoded_off_the_event_loop(served, monkeypatch):
    # (with logprobs every token is decoded: 64 long choices held every other stream for seconds)
    import asyncio

    from streamrl.serve.response_bodies import Format

    api, url = served
    whole, on_loop = Format.whole, []

    def watched(self, completion):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:  # (no loop runs in this thread)
            on_loop.append(False)
        return whole(self, completion)

    monkeypatch.setattr(Format, "whole", watched)
    r = httpx.post(f"{url}/chat/completions", json={"model": "policy", "messages": [{"role": "user", "content": "1+1="}],
                                                    "max_tokens": 2, "n": 2, "logprobs": True}, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2 and r.json()["choices"][0]["logprobs"], r.text[:300]
    assert on_loop == [False]


def test_max_waiting_must_leave_room_for_a_step():
    # (samples_per_step at or past max_waiting: no step could fill, and training stopped, unsaid)
    from streamrl.recipe.serve import ServeConfig

    with pytest.raises(ValueError, match=r"serve.max_waiting \(100\) must be at least serve.samples_per_step \+ 64 \(164\)"):
        ServeConfig(samples_per_step=100, max_waiting=100)
    assert ServeConfig(samples_per_step=100, max_waiting=164).max_waiting == 164


def test_a_prompt_too_long_names_the_field_the_client_sent(served, monkeypatch):
    # the token count's 400 named "messages" on /completions, and the engine's own refusal
    # (a prompt past the model's positions) named "prompt" on /chat/completions
    api, url = served
    r = httpx.post(f"{url}/completions", json={"model": "policy", "prompt": [5] * 33, "max_tokens": 2}, timeout=30)
    err = error_of(r, 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt", err
    monkeypatch.setattr(api.engine, "_check_ids", lambda what, ids: (_ for _ in ()).throw(
        ValueError(f"hf engine: {what} has {len(ids)} tokens, more than the model's positions leave")))
    assert error_of(chat(url, "1+1="), 400)["param"] == "messages"
    r = httpx.post(f"{url}/completions", json={"model": "policy", "prompt": "1+1=", "max_tokens": 2}, timeout=30)
    assert error_of(r, 400)["param"] == "prompt"
    monkeypatch.undo()
    assert chat(url, "1+1=").status_code == 200
