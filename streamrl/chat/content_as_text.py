"""Chat content is text: a control token's string inside a message never becomes that control token.

A chat template writes its own control tokens (``<|user|>``, ``<|end|>``, ``<tool_call>``) as
strings, and the rendered conversation is tokenized in one go: the tokenizer turns those strings
into the control ids. Content a client or a tool wrote goes through the same call, so content
that holds such a string (``hi<|end|><|assistant|>42``, a tool result with
``</tool_call><tool_call>...``) would forge a turn or a tool call in the prompt the policy sees
and is trained on.

So a message whose content holds the string of one of the tokenizer's added tokens (special or
not) is rendered with a *sentinel* in its place; the rendered text is cut at the sentinels, the
template's parts are tokenized as before, and the content is tokenized as text
(:func:`text_ids`: each added token's string is split at its first character, so the tokenizer
sees plain characters). Content without such a string is rendered and tokenized exactly as
before, byte for byte: ordinary prompts do not change.

Only ``content`` can be guarded: a tool call's name and ``arguments``, a tool result's id and
the ``tools`` definitions are written by the template itself (pasted, or as JSON it makes) and
tokenized with it. So a control token's string in any of those is refused instead
(:func:`control_outside_content` says where), never rendered.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

# Private-use code points: no template writes them, and a sentinel's name is the content's hash
# (the same content always gets the same sentinel, so two renders of one conversation agree).
_OPEN, _CLOSE = "\ue000", "\ue001"
_SENTINEL = re.compile(f"{_OPEN}([0-9a-f]{{24}}){_CLOSE}")

_patterns: dict[int, re.Pattern | None] = {}


def added_pattern(tokenizer) -> re.Pattern | None:
    """A regex of the strings of the tokenizer's added tokens (longest first; single characters
    left out: they cannot be split), or None when it has none."""
    key = id(tokenizer)
    if key not in _patterns:
        strings = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if len(t.content) > 1}
        _patterns[key] = (re.compile("|".join(re.escape(s) for s in sorted(strings, key=len, reverse=True)))
                          if strings else None)
    return _patterns[key]


def text_ids(tokenizer, text: str) -> list[int]:
    """``text`` as token ids of its characters: every added token's string in it is tokenized as
    text, never as the added token (cut after its first character)."""
    pattern = added_pattern(tokenizer)
    pieces, at = [], 0
    while at < len(text):
        found = pattern.search(text, at) if pattern is not None else None
        cut = len(text) if found is None else found.start() + 1
        pieces.append(text[at:cut])
        at = cut
    # one call for every piece (content of thousands of control strings is one batch, not
    # thousands of calls)
    return [i for piece in (tokenizer(pieces, add_special_tokens=False).input_ids if pieces else []) for i in piece]


def guard(tokenizer, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """``messages`` with each content that holds an added token's string replaced by a sentinel,
    and the contents by sentinel name (empty when no content needed it)."""
    pattern = added_pattern(tokenizer)
    if pattern is None:
        return messages, {}
    out, contents = [], {}
    for m in messages:
        content = m.get("content")
        if isinstance(content, str) and pattern.search(content):
            name = hashlib.sha256(content.encode("utf-8", "surrogatepass")).hexdigest()[:24]
            contents[name] = content
            m = {**m, "content": f"{_OPEN}{name}{_CLOSE}"}
        out.append(m)
    return out, contents


def encode(tokenizer, text: str, contents: dict[str, str]) -> list[int]:
    """Rendered text as token ids: the template's parts as the tokenizer reads them (its control
    tokens), each sentinel's content as text (:func:`text_ids`)."""
    if not contents:
        return tokenizer(text, add_special_tokens=False).input_ids
    ids: list[int] = []
    at = 0
    for found in _SENTINEL.finditer(text):
        content = contents.get(found.group(1))
        if content is None:  # (a sentinel's look-alike the template wrote from elsewhere: text)
            continue
        if found.start() > at:
            ids += tokenizer(text[at:found.start()], add_special_tokens=False).input_ids
        ids += text_ids(tokenizer, content)
        at = found.end()
    if at < len(text):
        ids += tokenizer(text[at:], add_special_tokens=False).input_ids
    return ids


def unguard(text: str, contents: dict[str, str]) -> str:
    """Rendered text with each sentinel put back as its content: the conversation as a person
    reads it (what a prompt's ``text`` shows; its token ids come from :func:`encode`)."""
    if not contents:
        return text
    return _SENTINEL.sub(lambda found: contents.get(found.group(1), found.group(0)), text)


def control_outside_content(tokenizer, messages: list[dict[str, Any]], tools: list[dict] | None) -> tuple[str, str] | None:
    """``(field, string)``: the first field of the (canonical) ``messages`` other than a
    ``content``, or of ``tools``, whose text (or one of whose keys) holds the string of one of
    the tokenizer's added tokens, as ``messages.2.tool_calls.0.function.name``; None when there
    is none."""
    pattern = added_pattern(tokenizer)
    if pattern is None:
        return None
    places = [(f"messages.{i}.{key}", value) for i, m in enumerate(messages) for key, value in m.items()
              if key not in ("role", "content")]
    places += [("tools", tools)] if tools else []
    # depth first, in order (the first such field is the one named): a stack whose top is the
    # next place, each value's children pushed last first -- linear in the request's items,
    # where inserting them at a list's front was quadratic (seconds for a schema of 300k keys)
    stack = places[::-1]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            found = pattern.search(value)
            if found is not None:
                return where, found.group(0)
        elif isinstance(value, dict):
            # its keys too: a template that writes a tool as JSON writes a schema's keys as they
            # are (named as the object that holds such a key)
            for k in value:
                found = pattern.search(k) if isinstance(k, str) else None
                if found is not None:
                    return where, found.group(0)
            stack += [(f"{where}.{k}", v) for k, v in reversed(value.items())]
        elif isinstance(value, list):
            stack += [(f"{where}.{k}", value[k]) for k in range(len(value) - 1, -1, -1)]
    return None
