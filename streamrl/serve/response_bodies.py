"""The bodies of the OpenAI-compatible API's answers: a whole response, the chunks of a stream
and its server-sent events, in OpenAI's shapes, with the ``streamrl`` object beside them (token
ids, log-probs, policy versions); and a reply's tool calls, parsed off the event loop."""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
from typing import Any

from streamrl.chat.content_as_text import added_pattern
from streamrl.chat.decoding import token_bytes
from streamrl.chat.messages import reply_message
from streamrl.serve.completion import Completion
from streamrl.serve.request_bodies import APIError, Sampling

#: Seconds ``serve.tool_parser`` may take on one reply. It runs off the server's event loop, so a
#: parser that hangs (a regular expression gone quadratic on a long reply) costs its own request a
#: 500 after this long, while every other client is answered meanwhile.
TOOL_PARSER_TIMEOUT_S = 10.0


def sse(obj: dict) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def call_markers(tokenizer, tool_parser) -> dict[str, int]:
    """The tool parser's call markers (its ``call_start``, else its ``start``) that are one added
    token of ``tokenizer`` (Qwen's ``<tool_call>``, Mistral's ``[TOOL_CALLS]``), with their ids:
    a reply whose calls the parser found calls a tool only if it generated one of them."""
    start = getattr(tool_parser, "call_start", None) or getattr(tool_parser, "start", ())
    starts = start if isinstance(start, (tuple, list)) else (start,)
    try:
        added = tokenizer.get_added_vocab()
    except Exception:  # noqa: BLE001 -- a tokenizer without added tokens to say: no marker to hold to
        return {}
    return {s: added[s] for s in starts if isinstance(s, str) and s in added}


#: Stands in for call marker ``k`` spelled out in characters while such a reply is parsed again.
_SPELLED = "\ue000streamrl-spelled-marker-{}\ue001"


class Format:
    """OpenAI's response and chunk bodies for one request."""

    def __init__(self, endpoint, req: Sampling, cid: str, chat: bool, prompt_ids: list[int], tool_parser=None,
                 model: str = ""):
        self.endpoint, self.req, self.cid, self.chat, self.prompt_ids = endpoint, req, cid, chat, prompt_ids
        self.model = model or endpoint.model_name
        self.tool_parser = tool_parser
        self._markers = (call_markers(endpoint.tokenizer, tool_parser)
                         if tool_parser is not None and endpoint is not None else {})
        self._replies: dict[int, dict] = {}
        self._sent: dict[int, str] = {}  # per choice, the content streamed so far (tool parsing on)
        self.created = int(time.time())
        self.want_logprobs = bool(getattr(req, "logprobs", False))

    def _base(self, obj: str) -> dict:
        return {"id": self.cid, "object": obj, "created": self.created, "model": self.model}

    def _token_logprobs(self, tokens: list[int], logprobs: list[float]):
        tok = self.endpoint.tokenizer
        pieces = [tok.decode([t]) for t in tokens]
        if self.chat:
            return {"content": [{"token": p, "logprob": lp, "bytes": list(raw), "top_logprobs": []}
                                for p, raw, lp in zip(pieces, token_bytes(tok, tokens), logprobs)]}
        return {"tokens": pieces, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": None}

    def usage(self, completion: Completion) -> dict:
        """Token counts of the prompt and of every choice."""
        out = sum(len(c.tokens) for c in completion.choices)
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": out,
                "total_tokens": len(self.prompt_ids) + out}

    def reply(self, c) -> dict:
        """Choice ``c``'s assistant message, canonical (``chat/messages.py``): its text, parsed for
        tool calls when the request offered tools (:meth:`parse` does that off the event loop
        first). A parser that raises, hangs, or returns what is not ``(content, calls)`` in the
        contract's shape is this request's 500 (:class:`APIError`), counted as
        ``tool_parser_errors``."""
        if c.index not in self._replies:
            self._keep(c, self._parsed(c))
        reply = self._replies[c.index]
        if isinstance(reply, APIError):
            raise reply
        return reply

    async def parse(self, c) -> None:
        """Parse finished choice ``c``'s reply for tool calls, once, in a thread of its own: the
        event loop answers every other client meanwhile, and a parser that takes longer than
        :data:`TOOL_PARSER_TIMEOUT_S` is this request's 500. Replies are parsed one at a time (as
        they were on the loop: a parser need not be thread-safe); while a parser hangs, later
        replies with tools wait their bound for it and get the same 500. (A daemon thread: one
        that never returns does not hold the process at its exit.)"""
        if self.tool_parser is None or c.index in self._replies:
            return
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        late = APIError(500, f"serve.tool_parser {type(self.tool_parser).__name__} did not finish parsing this reply "
                             f"within {TOOL_PARSER_TIMEOUT_S:g} s.", kind="server_error", code="tool_parser_failed")

        def settle(got) -> None:
            if not done.done():  # (not after the wait gave up)
                done.set_result(got)

        def work() -> None:
            lock = self.endpoint.parse_lock
            if not lock.acquire(timeout=TOOL_PARSER_TIMEOUT_S):
                got = late  # (an earlier reply's parse still holds it)
            else:
                try:
                    got = self._parsed(c)
                finally:
                    lock.release()
            try:
                loop.call_soon_threadsafe(settle, got)
            except RuntimeError:  # (the server's loop closed meanwhile)
                pass

        threading.Thread(target=work, name="streamrl-tool-parser", daemon=True).start()
        try:
            got = await asyncio.wait_for(done, TOOL_PARSER_TIMEOUT_S)
        except asyncio.TimeoutError:
            got = late
        if c.index not in self._replies:
            self._keep(c, got)

    def _keep(self, c, reply: dict | APIError) -> None:
        if isinstance(reply, APIError):
            self.endpoint.traffic.count("tool_parser_errors")
        self._replies[c.index] = reply

    def _parsed(self, c) -> dict | APIError:
        # (in the parsing thread, or on the loop without a parser: touches nothing shared)
        try:
            content, calls = self.tool_parser.parse(c.text) if self.tool_parser is not None else (c.text, [])
            if not (content is None or isinstance(content, str)) or not isinstance(calls, list):
                raise TypeError(f"parse() gave {type(content).__name__} content and {type(calls).__name__} calls; "
                                "expected a string (or None) and a list")
            calls = [_as_call(call) for call in calls]
            if calls and self._markers and set(self._markers.values()).isdisjoint(c.tokens):
                # the parser's marker is one token of this model, and the reply never generated it:
                # it spelled the marker out in characters (as a user's text may have asked it to
                # copy a call it wrote) -- text, not a call. The reply is parsed again with the
                # spelled markers hidden, for the content the parser gives a reply without calls
                # (a reasoning model's reasoning left out as ever)
                hidden = c.text
                for k, marker in enumerate(self._markers):
                    hidden = hidden.replace(marker, _SPELLED.format(k))
                content, _ = self.tool_parser.parse(hidden)
                if isinstance(content, str):
                    for k, marker in enumerate(self._markers):
                        content = content.replace(_SPELLED.format(k), marker)
                else:
                    content = None
                calls = []
            control = added_pattern(self.endpoint.tokenizer) if calls and self.endpoint is not None else None
            if control is not None:
                # a control token's string in a call's name or arguments: echoed back in the next
                # turn, the endpoint refuses it there (the template would write it as that token).
                # That call is left out; when none is left the reply is its text as the model wrote
                # it, as for a block that does not parse (not an empty reply that says nothing)
                kept = [call for call in calls if not (control.search(call["name"]) or control.search(call["arguments"]))]
                if calls and not kept:
                    content = c.text
                calls = kept
            ids = [call["id"] if isinstance(call.get("id"), str) else f"call_{secrets.token_hex(8)}"
                   for call in calls]
            return reply_message(content, calls, ids)
        except Exception as e:  # noqa: BLE001 -- a plugin's bug: this request's error, not the server's end
            return APIError(500, f"serve.tool_parser {type(self.tool_parser).__name__} failed on this reply "
                                 f"({type(e).__name__}: {str(e)[:200]}).", kind="server_error",
                            code="tool_parser_failed")

    def finish_reason(self, c) -> str | None:
        """``tool_calls`` for a finished reply that calls tools, else the choice's own."""
        if c.finish_reason == "stop" and self.chat and self.reply(c).get("tool_calls"):
            return "tool_calls"
        return c.finish_reason

    def message(self, c) -> dict:
        """OpenAI's ``message`` of choice ``c`` (``content`` null when it only calls tools)."""
        reply = self.reply(c)
        msg = {"role": "assistant", "content": reply["content"] or (None if reply.get("tool_calls") else "")}
        if reply.get("tool_calls"):
            msg["tool_calls"] = reply["tool_calls"]
        return msg

    def whole(self, completion: Completion) -> dict:
        """The non-streamed response."""
        choices = []
        for c in completion.choices:
            body = {"message": self.message(c)} if self.chat else {"text": c.text}
            lp = self._token_logprobs(c.tokens, c.logprobs) if self.want_logprobs else None
            choices.append({"index": c.index, **body, "logprobs": lp, "finish_reason": self.finish_reason(c)})
        return {**self._base("chat.completion" if self.chat else "text_completion"), "choices": choices,
                "usage": self.usage(completion),
                "streamrl": {"prompt_token_ids": self.prompt_ids,
                             "choices": [{"index": c.index, "token_ids": c.tokens, "logprobs": c.logprobs,
                                          "policy_versions": c.versions,
                                          **({"stopped_early": True} if c.stopped_early else {})}
                                         for c in completion.choices]}}

    def chunk(self, ev, first: bool = False, choice=None) -> dict:
        """One streamed chunk: a choice's new text and tokens (``ev``; ``choice``: the choice it
        belongs to), or the opening one."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        if first:
            extra = {"streamrl": {"prompt_token_ids": self.prompt_ids}}
            if not self.chat:
                return {**self._base(obj), "choices": [], **extra}
            return {**self._base(obj), **extra, "choices": [
                {"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for k in range(self.req.n)]}
        lp = self._token_logprobs(ev.tokens, ev.logprobs) if self.want_logprobs and ev.tokens else None
        body = {"delta": {"content": ev.text}} if self.chat else {"text": ev.text}
        finish = ev.finish_reason
        if self.tool_parser is not None and choice is not None:
            body["delta"]["content"] = self._content_delta(choice, bool(finish))
        if finish and self.tool_parser is not None and choice is not None:
            # the reply's tool calls, parsed once it is whole, ride on its last chunk (one cut at
            # its length has them too, as its whole response does; its finish stays "length")
            calls = self.reply(choice).get("tool_calls", [])
            if calls:
                body["delta"]["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
            finish = self.finish_reason(choice)
        return {**self._base(obj), "choices": [{"index": ev.index, **body, "logprobs": lp,
                                                "finish_reason": finish}],
                "streamrl": {"index": ev.index, "token_ids": ev.tokens, "logprobs": ev.logprobs,
                             "policy_version": ev.version}}

    def _content_delta(self, choice, whole: bool) -> str:
        """What to stream of a choice's text as content now, tool parsing on: its text up to the
        first tool call's opening (less a tail that may be the opening's start), and once the
        reply is whole the rest of its parsed content."""
        sent = self._sent.get(choice.index, "")
        if whole:
            content = self.reply(choice)["content"] or ""
            # (a parser strips its content: what was sent may have had spaces the content lacks;
            # the rest after it still goes, not nothing)
            seen = next((s for s in (sent, sent.lstrip(), sent.strip()) if content.startswith(s)), None)
            delta = content[len(seen):] if seen is not None else ""
        else:
            # (not a tail the choice holds back while it may begin a stop sequence)
            text, start = choice.text[:choice.sent], getattr(self.tool_parser, "start", "")
            starts = [start] if isinstance(start, str) else list(start)
            found = [at for at in (text.find(s) for s in starts if s) if at >= 0]
            if found:
                text = text[:min(found)]
            else:  # hold back a tail that may be an opening's start
                hold = max((k for s in starts if s for k in range(min(len(s) - 1, len(text)), 0, -1)
                            if text.endswith(s[:k])), default=0)
                text = text[:len(text) - hold]
            delta = text[len(sent):] if text.startswith(sent) else ""
        self._sent[choice.index] = sent + delta
        return delta

    def usage_chunk(self, completion: Completion) -> dict:
        """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(obj), "choices": [], "usage": self.usage(completion)}


def _as_call(call: Any) -> dict[str, Any]:
    """A tool parser's call in the contract's shape: a ``name`` string and ``arguments`` as JSON
    text (a mapping or list a plugin gave is written as JSON; anything else is the parser's
    error). What an agent's client and its trajectory read: a call in another shape broke
    OpenAI's schema for the client and, kept in a trajectory, its next turn."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise TypeError(f"a call is {str(call)[:80]!r}; expected {{'name': str, 'arguments': JSON text}}")
    args = call.get("arguments", "{}")
    if isinstance(args, dict | list):
        args = json.dumps(args)
    if not isinstance(args, str):
        raise TypeError(f"call {call['name'][:40]!r} has arguments of type {type(args).__name__}; expected JSON text")
    return {**call, "arguments": args}
