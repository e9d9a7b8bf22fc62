"""Tool calls in the formats of three model families besides ``hermes``: ``llama3_json``,
``mistral`` and ``qwen3``. Each is checked against its family's chat-template format
(``tests/data/chat_templates``) and a tokenizer carrying the family's special tokens: the
tool-call turn the template writes parses back to the same calls, and an agent's two calls join
one trajectory that keeps the generated tokens as they were (Qwen3's ``<think>`` block among
them), with the template's own text for the tool result between them."""

from __future__ import annotations

import json
import string

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from streamrl.chat import content_as_text
from streamrl.chat.messages import reply_message
from streamrl.chat.tool_calls import HermesToolParser, Llama3JsonToolParser, MistralToolParser, Qwen3ToolParser
from streamrl.serve.completion import decode, token_ids
from streamrl.serve.trajectories import Trajectories
from tests.helpers import ROOT

TEMPLATES = ROOT / "tests" / "data" / "chat_templates"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}


def family_tokenizer(template: str, bos: str, eos: str, special: list[str], plain: list[str]) -> PreTrainedTokenizerFast:
    """One token per printable character, the family's special tokens (``special``: control
    tokens, dropped when a reply is decoded) and added plain ones (``plain``: Qwen's tags,
    decoded as text), and its chat template."""
    vocab = {"<pad>": 0}
    for ch in string.printable:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token=bos, eos_token=eos,
                                  additional_special_tokens=special)
    out.add_tokens(plain)
    out.chat_template = (TEMPLATES / template).read_text()
    return out


FAMILIES = {
    "llama3_json": dict(
        tokenizer=lambda: family_tokenizer("llama3_json.jinja", "<|begin_of_text|>", "<|eot_id|>",
                                           ["<|start_header_id|>", "<|end_header_id|>", "<|python_tag|>"], []),
        parser=Llama3JsonToolParser, reasoning="",
        tool_turn="<|start_header_id|>ipython<|end_header_id|>\n\n18 C<|eot_id|>"
                  "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "mistral": dict(
        tokenizer=lambda: family_tokenizer("mistral.jinja", "<s>", "</s>",
                                           ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                                            "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], []),
        parser=MistralToolParser, reasoning="",
        tool_turn='[TOOL_RESULTS] {"content": "18 C", "call_id": "@ID"}[/TOOL_RESULTS]'),
    "qwen3": dict(
        tokenizer=lambda: family_tokenizer("qwen3.jinja", "<|im_start|>", "<|im_end|>", [],
                                           ["<think>", "</think>", "<tool_call>", "</tool_call>",
                                            "<tool_response>", "</tool_response>"]),
        parser=Qwen3ToolParser, reasoning="The user wants the weather; I call the tool.",
        tool_turn="\n<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
}


def model_turn(tok, reasoning: str) -> str:
    """The assistant's tool-call turn as the family's template writes it: what a model of the
    family was trained to generate (up to its end of turn)."""
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "abcDEF123", "type": "function", "function": CALL}]}
    if reasoning:
        call["reasoning_content"] = reasoning
    prompt = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    whole = tok.apply_chat_template(messages + [call], tools=TOOLS, tokenize=False)
    assert whole.startswith(prompt)
    turn = whole[len(prompt):]
    return turn[:turn.index(tok.eos_token)]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_tool_call_turn_a_familys_template_writes_parses_back_to_the_same_call(family):
    f = FAMILIES[family]
    tok, parser = f["tokenizer"](), f["parser"]()
    generated = tok(model_turn(tok, f["reasoning"]), add_special_tokens=False).input_ids
    # the reply's text as the endpoint decodes it: special tokens dropped but the parser's markers
    text = decode(tok, generated, token_ids(tok, parser.keep_tokens))
    content, calls = parser.parse(text)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [(CALL["name"], CALL["arguments"])]
    assert content is None  # (Qwen3's reasoning is not content)
    if family == "mistral":
        assert calls[0]["id"] == "abcDEF123"  # the model's own id, nine letters and digits


@pytest.mark.parametrize("family", FAMILIES)
def test_an_agents_two_calls_keep_the_generated_tokens_and_the_templates_text_between_them(family):
    f = FAMILIES[family]
    tok, parser = f["tokenizer"](), f["parser"]()
    trajectories = Trajectories(tok, lambda text, contents: content_as_text.encode(tok, text, contents))
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    first, seg = trajectories.prompt("r", messages, TOOLS)
    generated = tok(model_turn(tok, f["reasoning"]), add_special_tokens=False).input_ids + [tok.eos_token_id]
    content, calls = parser.parse(decode(tok, generated, token_ids(tok, parser.keep_tokens)))
    ids = [c.get("id") or f"call_{k}" for k, c in enumerate(calls)]
    reply = reply_message(content, calls, ids)
    trajectories.add("r", seg, messages, first, generated, [-0.5] * len(generated), [3] * len(generated), reply)
    # the agent sends the reply back as it got it, with the tool's result
    then = messages + [reply, {"role": "tool", "tool_call_id": ids[0], "content": "18 C"}]
    second, same = trajectories.prompt("r", then, TOOLS)
    assert same is seg, "the second call continues the first (no split)"
    assert second[:len(first) + len(generated)] == first + generated  # the reply's own tokens, as generated
    gap = tok.decode(second[len(first) + len(generated):], skip_special_tokens=False)
    assert gap == f["tool_turn"].replace("@ID", ids[0])
    trajectories.add("r", seg, then, second, [5], [-0.1], [4], {"role": "assistant", "content": "18"})
    traj = trajectories.finish("r")
    assert traj["splits"] == 0 and len(traj["segments"]) == 1
    mask = traj["segments"][0]["loss_mask"]
    assert mask == [1] * len(generated) + [0] * (len(second) - len(first) - len(generated)) + [1]
    if f["reasoning"]:  # Qwen3's reasoning: out of the content, in the trained tokens
        assert f["reasoning"] not in (reply["content"] or "")
        assert f["reasoning"] in tok.decode(traj["segments"][0]["response_ids"])


def test_the_parsers_leave_what_does_not_parse_as_content():
    assert Llama3JsonToolParser().parse("The weather is fine.") == ("The weather is fine.", [])
    assert Llama3JsonToolParser().parse('{"name": "f", "parameters": {') == ('{"name": "f", "parameters": {', [])
    assert Llama3JsonToolParser().parse('{"city": "Paris"}') == ('{"city": "Paris"}', [])  # JSON, not a call
    two = Llama3JsonToolParser().parse('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}')
    assert two == (None, [{"name": "a", "arguments": "{}"}, {"name": "b", "arguments": '{"x": 1}'}])
    assert MistralToolParser().parse("[TOOL_CALLS] [{broken") == ("[TOOL_CALLS] [{broken", [])
    assert MistralToolParser().parse("no calls") == ("no calls", [])
    # the v11 layout, and an id that is not Mistral's gets one that is
    content, calls = MistralToolParser().parse('Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}')
    assert content == "Sure." and calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Oslo"}
    assert len(calls[0]["id"]) == 9 and calls[0]["id"].isalnum()
    assert Qwen3ToolParser().parse("<think>\nhm\n</think>\n\nIt is 18 C.") == ("It is 18 C.", [])
    assert Qwen3ToolParser().parse("<think>\nstill thinking when the tokens ran out") == (None, [])
    assert Qwen3ToolParser().parse("Plain answer") == ("Plain answer", [])
    call = '{"name": "f", "arguments": {"x": 1}}'
    assert HermesToolParser().parse(f"Sure.\n<tool_call>\n{call}\n</tool_call>\n") == (
        "Sure.", [{"name": "f", "arguments": '{"x": 1}'}])
    assert HermesToolParser().parse(f"<tool_call> {call} \n") == (None, [{"name": "f", "arguments": '{"x": 1}'}])


def test_a_call_whose_json_python_will_not_read_is_content_not_a_parsers_failure():
    # (a 5,000-digit number passes JSON's grammar and not Python's int limit; a thousand brackets
    # pass the grammar and not the stack: each was a 500 blamed on the parser, and a retry)
    huge = '{"name": "f", "arguments": {"x": ' + "1" * 5000 + "}}"
    deep = '{"name": "f", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}"
    for body in (huge, deep):
        assert Llama3JsonToolParser().parse(body) == (body, [])
        assert HermesToolParser().parse(f"<tool_call>{body}</tool_call>")[1] == []
        assert MistralToolParser().parse(f"[TOOL_CALLS] [{body}]")[1] == []
        assert MistralToolParser().parse(f"[TOOL_CALLS]f[ARGS]{body}")[1] == []


def test_a_reply_of_a_long_run_of_blanks_after_a_tool_call_tag_parses_in_one_pass():
    # the block's pattern once tried every split of such a run (quadratic, holding the GIL: a
    # reply of this size took hours); the test's timeout is what fails
    reply = "<tool_call>x" + " " * 2_000_000 + "y"
    assert HermesToolParser().parse(reply) == (reply, [])
    assert Qwen3ToolParser().parse(reply) == (reply, [])


@pytest.mark.parametrize("parser, pieces, content", [
    (Qwen3ToolParser(), ["<thi", "nk>\nthe user", " wants", "</think>\n\nIt is ", "warm. <tool", "_call>\n{\"name\": ",
                         "\"get_weather\", \"arguments\": {}}\n</tool_call>"], "It is warm."),
    (MistralToolParser(), ["Sure", ". [TOOL", "_CALLS] [{\"name\": \"f\", \"arguments\": {}}]"], "Sure."),
    (Llama3JsonToolParser(), ["{\"name\"", ": \"f\", \"parameters\": {}}"], ""),
])
def test_a_streamed_reply_sends_no_reasoning_or_call_markup_as_content(parser, pieces, content):
    from types import SimpleNamespace

    from streamrl.serve.response_bodies import Format

    fmt = Format(None, None, "c", True, [], parser, model="m")
    choice, streamed = SimpleNamespace(index=0, text="", sent=0), []
    for k, piece in enumerate(pieces):
        choice.text += piece
        choice.sent = len(choice.text)  # (no stop sequence: all of it let go)
        streamed.append(fmt._content_delta(choice, whole=k == len(pieces) - 1))
    assert "".join(streamed).strip() == content
    assert not any(marker in "".join(streamed) for marker in ("think", "TOOL", "tool_call", "{"))
    assert fmt.reply(choice)["tool_calls"][0]["function"]["name"] in ("f", "get_weather")
