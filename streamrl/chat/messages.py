"""Chat messages as the endpoint takes them: checked, put into the shape chat templates read,
and rendered with the model's template (tools included).

OpenAI's clients send ``content`` as a string, a list of parts or null (an assistant turn that
only calls tools), and an assistant's ``tool_calls`` with ``arguments`` as JSON text; Hugging
Face chat templates read ``arguments`` as a mapping. :func:`template_messages` turns the one into
the other, so a conversation an agent wrote for OpenAI's API renders as the model was trained on.
"""

from __future__ import annotations

import json
from typing import Any

#: The roles a message may have.
ROLES = ("system", "developer", "user", "assistant", "tool")

#: A prompt of more characters than a token limit times this cannot fit that limit and is refused
#: (the endpoint) or left out (a dataset's rows) before it is rendered or tokenized: no
#: tokenizer's tokens are that long on average, and tokenizing megabytes only to count them
#: would cost seconds of CPU.
MAX_CHARS_PER_TOKEN = 32


class MessageError(ValueError):
    """A message the endpoint cannot take; ``param`` names it (``messages.3.content``)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def text_of(content: Any, where: str) -> str:
    """A message's ``content`` as text: a string, the text of a list of text parts (an
    assistant's refusal part is its text), or "" for null. Any other part (an image, audio, a
    bare string) is refused: dropped, the turn was answered and trained on as if it said nothing."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            kind = part.get("type", "text") if isinstance(part, dict) else None
            if kind not in ("text", "refusal"):
                said = f"a {kind!r} part" if isinstance(kind, str) else f"a {type(part).__name__}"
                raise MessageError(f"{where}.content.{k} must be a text part ({{'type': 'text', 'text': ...}}); "
                                   f"got {said[:80]}, and this model reads text only.", f"{where}.content.{k}")
            text = part.get(kind, "")
            if not isinstance(text, str):
                raise MessageError(f"{where}.content.{k}.{kind} must be a string.", f"{where}.content.{k}.{kind}")
            texts.append(text)
        return "".join(texts)
    raise MessageError(f"{where}.content must be a string, a list of content parts or null.", f"{where}.content")


def normalize(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's messages, checked, in one canonical shape: ``role``, ``content`` (text),
    and where present ``tool_calls`` (``[{"id", "type", "function": {"name", "arguments"}}]``,
    arguments as JSON text), ``tool_call_id`` and ``name``. Two conversations that mean the same
    compare equal in this shape (how an agent's next call is matched to its last)."""
    out = []
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise MessageError(f"{where}.role must be one of {', '.join(ROLES)}.", f"{where}.role")
        if "content" not in m and not m.get("tool_calls"):
            raise MessageError(f"{where} needs a 'content'.", f"{where}.content")
        msg: dict[str, Any] = {"role": m["role"], "content": text_of(m.get("content"), where)}
        if m.get("tool_calls"):
            if m["role"] != "assistant" or not isinstance(m["tool_calls"], list):
                raise MessageError(f"{where}.tool_calls must be a list, on an assistant message.", f"{where}.tool_calls")
            msg["tool_calls"] = [_tool_call(c, f"{where}.tool_calls.{k}") for k, c in enumerate(m["tool_calls"])]
        for key in ("tool_call_id", "name"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        out.append(msg)
    return out


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise MessageError(f"{where} needs a 'function' with a 'name'.", where)
    args = fn.get("arguments", "{}")
    return {"id": str(call.get("id", "")), "type": "function",
            "function": {"name": fn["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


#: Most levels of arrays and objects a value from a client may nest. Deeper JSON is valid, but a
#: chat template's ``tojson`` and pickle (which carries a sample to the trainer) recurse once per
#: level and fail a few hundred levels down; no request to a model needs more than a few.
MAX_NESTING = 64


def nested_deeper(value: Any, limit: int = MAX_NESTING) -> bool:
    """Whether JSON ``value`` nests arrays and objects more than ``limit`` levels deep (walked
    without recursion, so any depth is measured)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict | list):
            if depth > limit:
                return True
            stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return False


def _json_or_text(text: str) -> Any:
    # a tool call's arguments as a JSON value, or as the text they are where that is not JSON a
    # template can show (not JSON; an integer past Python's 4,300 digits; nested too deeply)
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return text if nested_deeper(value) else value


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Canonical messages (:func:`normalize`) as chat templates read them: tool calls'
    ``arguments`` parsed into mappings (left as text where they are not JSON)."""
    out = []
    for m in messages:
        if "tool_calls" in m:
            calls = []
            for c in m["tool_calls"]:
                args = _json_or_text(c["function"]["arguments"])
                calls.append({**c, "function": {"name": c["function"]["name"], "arguments": args}})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def render(tokenizer, messages: list[dict[str, Any]], tools: list[dict] | None, generation_prompt: bool) -> str:
    """The conversation as the model's chat template writes it (``tools`` passed to the
    template, which shows them as the model was trained to see them), ending with the
    assistant's header when ``generation_prompt``. A tokenizer without a template gets a plain
    ``role: content`` layout (and no tools)."""
    if getattr(tokenizer, "chat_template", None):
        from jinja2 import TemplateError

        try:
            return tokenizer.apply_chat_template(template_messages(messages), tools=tools or None,
                                                 add_generation_prompt=generation_prompt, tokenize=False)
        except TemplateError as e:  # (a template's own refusal: roles out of order, a tool it cannot show)
            raise MessageError(f"The model's chat template cannot write these messages: {str(e)[:300]}",
                               "messages") from None
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as e:
            # (a template that reads what it was sent as another type: a filter over a mapping
            # given a string) -- the messages' doing, said as such, not the server's failure
            raise MessageError(f"The model's chat template cannot write these messages ({type(e).__name__}: "
                               f"{str(e)[:300]})", "messages") from None
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text + ("assistant:" if generation_prompt else "")


def reply_message(content: str | None, calls: list[dict[str, str]], call_ids: list[str]) -> dict[str, Any]:
    """The assistant message a reply is, in the canonical shape (what the agent sends back in its
    next call's history)."""
    msg: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if calls:
        msg["tool_calls"] = [{"id": cid, "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                             for cid, c in zip(call_ids, calls)]
    return msg


def message_key(m: dict[str, Any]) -> tuple:
    """What a canonical message means, for comparing an agent's history with what the endpoint
    saw and said: role, text (whitespace around it aside), tool calls (name and arguments as
    JSON values) and a tool result's ``name``. Call ids are left out (an agent may keep its
    own)."""
    calls = tuple((c["function"]["name"], _canonical_json(c["function"]["arguments"])) for c in m.get("tool_calls", []))
    return m["role"], (m.get("content") or "").strip(), calls, m.get("name", "")


def _canonical_json(text: str) -> str:
    value = _json_or_text(text)
    return text if value is text else json.dumps(value, sort_keys=True)
