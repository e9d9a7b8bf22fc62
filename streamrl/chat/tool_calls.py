"""Built-in tool-call parsers (``[serve] tool_parser``): a model's reply text to OpenAI's
``tool_calls``. Each family of models writes its calls the way its chat template renders them
in a conversation's history; the parser reads that back.

* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen2.5,
  Hermes and the shipped tiny calculator model; vLLM calls this format ``hermes`` too).
* ``qwen3``: Qwen3's replies, ``hermes`` blocks after an optional ``<think>...</think>``
  reasoning block. The reasoning is left out of ``message.content``, as Qwen3's template drops
  it from earlier assistant turns; the trajectory keeps its tokens, as they were generated.
* ``llama3_json``: Llama 3.1/3.2/3.3's JSON calls, a reply that is ``{"name": ...,
  "parameters": {...}}`` (after an optional ``<|python_tag|>``), several separated by ``;``.
* ``mistral``: Mistral's ``[TOOL_CALLS]`` followed by a JSON list of ``{"name", "arguments"}``
  (v3 tokenizers) or by ``name[ARGS]{...}`` (v11 and later). Mistral's template wants call ids
  of nine letters and digits, so the parser gives each call one.

Text that looks like a call but does not parse stays in the content: the agent sees what the
model wrote.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from typing import Any

from pydantic import BaseModel, ConfigDict

from streamrl.contracts.agents import ToolParser

# a block ends at its closing tag, or at the end of the reply (a model that stopped right after
# the JSON, its end of turn doubling as the closing tag). No ``\s*`` around the body: JSON takes
# the blanks, and a lazy body between two blank-eating runs tried every split of a long run of
# blanks -- quadratic in a reply's length, in a regex that holds the GIL (a reply of 64 K blanks
# took the whole worker for about a minute)
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


class HermesConfig(BaseModel):
    """A built-in ``tool_parser`` takes no options."""

    model_config = ConfigDict(extra="forbid")


class _BuiltIn(ToolParser):
    """A built-in parser: built from its (empty) config."""

    def __init__(self, config: HermesConfig | None = None):
        self.config = config


class HermesToolParser(_BuiltIn):
    """``<tool_call>{json}</tool_call>`` blocks (see the module's docstring)."""

    start = "<tool_call>"

    def parse(self, text: str) -> tuple[str | None, list[dict[str, str]]]:
        """The reply's content outside its parsed blocks, and the calls in order."""
        calls, kept, at = [], [], 0
        for m in _BLOCK.finditer(text):
            call = _call(m.group(1))
            if call is None:
                continue
            kept.append(text[at:m.start()])
            at = m.end()
            calls.append(call)
        kept.append(text[at:])
        content = "".join(kept).strip()
        return (content or None) if calls else text, calls


class Qwen3ToolParser(HermesToolParser):
    """Qwen3: ``hermes`` blocks, the ``<think>`` block left out of the content."""

    # the reasoning is held back from a streamed reply as call markup is
    start = ("<think>", "<tool_call>")
    call_start = "<tool_call>"

    def parse(self, text: str) -> tuple[str | None, list[dict[str, str]]]:
        """The reply after its reasoning (as Qwen3's template splits it: what follows the last
        ``</think>``), parsed as ``hermes``; an unclosed ``<think>`` is all reasoning."""
        if "</think>" in text:
            text = text.split("</think>")[-1].lstrip("\n")
        elif text.lstrip().startswith("<think>"):
            return None, []  # (cut off while reasoning: nothing was said yet)
        content, calls = super().parse(text)
        return content if calls else (text.strip() or None), calls


class Llama3JsonToolParser(_BuiltIn):
    """Llama 3's JSON calls (see the module's docstring)."""

    start = "{"
    keep_tokens = ("<|python_tag|>",)

    def parse(self, text: str) -> tuple[str | None, list[dict[str, str]]]:
        """The calls when the reply opens with one (else the reply is content), and any text
        after the last call as content."""
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):].lstrip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body) and body[at] == "{":
            try:
                obj, at = decoder.raw_decode(body, at)
            except (ValueError, RecursionError):  # (bad JSON, a 5,000-digit int, nesting past the stack)
                return text, []
            call = _named(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            rest = body[at:].lstrip()
            at = len(body) - len(rest)
            if rest.startswith(";"):
                at += 1 + len(rest[1:]) - len(rest[1:].lstrip())
        return body[at:].strip() or None, calls


class MistralToolParser(_BuiltIn):
    """Mistral's ``[TOOL_CALLS]`` (see the module's docstring)."""

    start = "[TOOL_CALLS]"
    keep_tokens = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")

    def parse(self, text: str) -> tuple[str | None, list[dict[str, str]]]:
        """The text before ``[TOOL_CALLS]`` as content, and the calls after it."""
        at = text.find("[TOOL_CALLS]")
        if at < 0:
            return text, []
        content, rest = text[:at].strip(), text[at + len("[TOOL_CALLS]"):].strip()
        calls = self._json_list(rest) if rest.startswith("[") else self._named_args(rest)
        if not calls:
            return text, []
        return content or None, calls

    def _json_list(self, rest: str) -> list[dict[str, str]] | None:
        try:
            items, _ = json.JSONDecoder().raw_decode(rest)
        except (ValueError, RecursionError):  # (bad JSON, a 5,000-digit int, nesting past the stack)
            return None
        if not isinstance(items, list):
            return None
        calls = []
        for item in items:
            call = _named(item, "arguments")
            if call is None:
                return None
            calls.append({**call, "id": _mistral_id(item.get("id"))})
        return calls

    def _named_args(self, rest: str) -> list[dict[str, str]] | None:
        calls = []
        for piece in rest.split("[TOOL_CALLS]"):
            head, sep, args = piece.partition("[ARGS]")
            name, _, call_id = head.partition("[CALL_ID]")
            if not sep or not name.strip():
                return None
            try:
                value = json.loads(args)
            except (ValueError, RecursionError):  # (bad JSON, a 5,000-digit int, nesting past the stack)
                return None
            calls.append({"name": name.strip(), "arguments": json.dumps(value), "id": _mistral_id(call_id.strip())})
        return calls


def _mistral_id(given: Any) -> str:
    """The model's call id when it is Mistral's nine letters and digits, else a fresh one."""
    if isinstance(given, str) and len(given) == 9 and given.isalnum() and given.isascii():
        return given
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def _call(body: str) -> dict[str, str] | None:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # (bad JSON, a 5,000-digit int, nesting past the stack)
        return None
    return _named(obj, "arguments")


def _named(obj: Any, key: str) -> dict[str, str] | None:
    """``{"name", "arguments"}`` of a decoded call, its arguments under ``key`` (or the other
    usual one); None when it is not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    other = "parameters" if key == "arguments" else "arguments"
    args = obj.get(key, obj.get(other, {}))
    try:
        return {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}
    except (ValueError, RecursionError):  # (arguments too deep to write back: not a call the endpoint can carry)
        return None
