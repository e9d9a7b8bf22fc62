"""Answering a request of the OpenAI-compatible API: run it in the engine, then the whole
response or its server-sent events (one per decode step's tokens) in OpenAI's shapes, with the
``streamrl`` object beside them (token ids, log-probs, policy versions); and when it ends, its
choices to the learners or its reply to an agent's trajectory."""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import threading
import time
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from streamrl.chat.content_as_text import added_pattern
from streamrl.chat.messages import reply_message
from streamrl.serve.completion import Completion
from streamrl.serve.remote_engines import RemoteEngine
from streamrl.serve.request_bodies import APIError, Sampling
from streamrl.telemetry import bubbles

# ``endpoint`` below is the ``openai_api.Endpoint`` the request came to (not imported here: that
# module imports this one)

#: Seconds ``serve.tool_parser`` may take on one reply. It runs off the server's event loop, so a
#: parser that hangs (a regular expression gone quadratic on a long reply) costs its own request a
#: 500 after this long, while every other client is answered meanwhile.
TOOL_PARSER_TIMEOUT_S = 10.0


class Turn:
    """A call of an agent's rollout: where its reply goes when it ends (the rollout's
    trajectory, not the traffic the learners take one request at a time)."""

    def __init__(self, rollout: str, segment, messages: list[dict[str, Any]], prompt_ids: list[int]):
        self.rollout, self.segment, self.messages, self.prompt_ids = rollout, segment, messages, prompt_ids
        self.done = False


async def respond(endpoint, request: Request, req: Sampling, ids: list[int], chat: bool,
                  turn: Turn | None = None):
    """Run the request in the engine; the whole response, or its server-sent events."""
    engine = endpoint.engine_for(req.model, rollout=turn is not None)
    params = endpoint.params(req, ids, rollout=turn is not None)
    cid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
    tools = chat and bool(getattr(req, "tools", None)) and getattr(req, "tool_choice", None) != "none"
    completion = Completion(engine, endpoint.tokenizer, cid, ids, params, keep=endpoint.kept_tokens if tools else None)
    completion.turn = turn
    endpoint.pending += params.n
    endpoint.running[id(engine)] = endpoint.running.get(id(engine), 0) + params.n
    model = endpoint.model_name if turn is not None else req.model
    endpoint.traffic.started(cid, getattr(req, "session", None), model, params.n, trained=not params.greedy)
    try:
        completion.start()
    except BaseException as e:
        # every place it took given back, whatever the engine raised: counted in pending for
        # good, enough of them and the endpoint answered 429 to everyone
        try:
            completion.cancel()  # (the choices queued before the one that failed)
        finally:
            finished(endpoint, completion, None)
        if isinstance(e, ValueError):  # the engine's own check (a prompt past its slots)
            raise APIError(400, str(e), param="prompt") from None
        if isinstance(e, Exception):
            raise APIError(500, failure(endpoint, e), kind="server_error") from None
        raise
    if not isinstance(getattr(engine, "engine", engine), RemoteEngine):  # (decoded in this process)
        completion.working = bubbles.begin_work()
    fmt = Format(endpoint, req, cid, chat, ids, endpoint.tool_parser if tools else None, model)
    if req.stream:
        return EndingStream(endpoint, completion, fmt, stream(endpoint, completion, fmt, req),
                            media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    watch = asyncio.create_task(_cancel_when_gone(request, completion))
    try:
        async for _ in completion.events():
            pass
        for c in completion.choices:
            await fmt.parse(c)
    except Exception as e:  # noqa: BLE001 -- the engine failed this request: a 500 in OpenAI's shape
        completion.cancel()  # (its other choices stop decoding too)
        raise APIError(500, failure(endpoint, e), kind="server_error") from None
    finally:
        watch.cancel()
        finished(endpoint, completion, fmt)
    return fmt.whole(completion)


#: Seconds between two looks at whether the client of a whole (not streamed) reply went away.
DISCONNECT_CHECK_S = 1.0


async def _cancel_when_gone(request: Request, completion: Completion) -> None:
    """Cancel ``completion`` once its client has gone away, whether or not tokens come meanwhile
    (looked at between tokens only, a request queued behind others, or on a replica gone silent,
    kept its place in ``serve.max_pending`` long after its client left)."""
    while not completion.cancelled:
        if await request.is_disconnected():
            completion.cancel()
            return
        await asyncio.sleep(DISCONNECT_CHECK_S)


class EndingStream(StreamingResponse):
    """A stream whose request ends however the response does: a client gone before its first
    chunk has the response cancelled before the generator ever runs (Starlette listens for the
    disconnect first), and the generator's own ``finally`` with it -- its places in
    ``serve.max_pending`` were held for good, and its choices decoded to ``max_tokens``."""

    def __init__(self, endpoint, completion: Completion, fmt: "Format", content, **kwargs):
        super().__init__(content, **kwargs)
        self.endpoint, self.completion, self.fmt = endpoint, completion, fmt

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.completion.ended:
                try:
                    if not all(c.finish_reason for c in self.completion.choices):
                        self.completion.cancel()
                finally:
                    finished(self.endpoint, self.completion, self.fmt)


async def stream(endpoint, completion: Completion, fmt: "Format", req: Sampling):
    """Server-sent events: one chunk per decode step's new tokens of a choice, then each choice's
    end, the usage (``stream_options.include_usage``) and ``[DONE]``. The chunks a decode step
    brought the request's choices go out in one write (a write per chunk took most of the
    server's time per token). A client that goes away cancels the request (the generator is
    closed)."""
    out: list[str] = []  # chunks not written yet
    try:
        yield sse(fmt.chunk(None, first=True))
        async for ev in completion.events():
            if ev.finish_reason:  # (a reply that ended: its tool calls, parsed off the loop)
                await fmt.parse(completion.choices[ev.index])
            if completion.turn is not None and all(c.finish_reason for c in completion.choices):
                finished(endpoint, completion, fmt)  # the trajectory has the reply before the client sees its end
            out.append(sse(fmt.chunk(ev, choice=completion.choices[ev.index])))
            if not completion.waiting():
                yield "".join(out)
                out = []
        if out:
            yield "".join(out)
        if req.stream_options is not None and req.stream_options.include_usage:
            yield sse(fmt.usage_chunk(completion))
        yield "data: [DONE]\n\n"
    except APIError as e:  # (the tool parser failed on the finished reply)
        endpoint.refusals.say(f"POST (stream) -> {e.status} {e.message}")
        yield "".join(out) + sse({"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}})
    except Exception as e:  # noqa: BLE001 -- mid-stream there is no status to change: an error event
        yield "".join(out) + sse({"error": {"message": failure(endpoint, e), "type": "server_error",
                                            "param": None, "code": None}})
    finally:
        if not all(c.finish_reason for c in completion.choices):
            completion.cancel()
        finished(endpoint, completion, fmt)


def failure(endpoint, exc: BaseException) -> str:
    """What a client is told of an engine's failure: its kind and words, without the addresses
    inside the cluster a replica's HTTP error names (those go to the worker's log)."""
    endpoint.refusals.say(f"generation failed: {type(exc).__name__}: {str(exc)[:500]}")
    said = _ADDRESS.sub("<replica>", str(exc).strip().splitlines()[0] if str(exc).strip() else "")[:300]
    return f"Generation failed ({type(exc).__name__}){': ' + said if said else ''}"


_ADDRESS = re.compile(r"\b(?:https?|tcp|tls)://\S+|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b")


def finished(endpoint, completion: Completion, fmt: "Format | None") -> None:
    """The request ended: free its place and hand its choices to the learners (not a cancelled
    one, nor a greedy one, which is not a sample of the policy); a rollout's call joins its
    trajectory instead. Once per request, however it ends."""
    if completion.ended:
        return
    completion.ended = True
    if completion.working:
        bubbles.end_work(completion.working)
    endpoint.pending -= completion.params.n
    endpoint.running[id(completion.engine)] = endpoint.running.get(id(completion.engine), 0) - completion.params.n
    turn = completion.turn
    if turn is not None:
        c = completion.choices[0]
        reply = None
        if not completion.cancelled and c.finish_reason:
            try:
                reply = fmt.reply(c)
            except APIError:  # (the agent gets the error; the call is not part of the trajectory)
                pass
        if reply is None:
            endpoint.trajectories.abandon(turn.rollout, turn.segment)
        else:
            n = c.stopped_at if c.stopped_at is not None else len(c.tokens)
            endpoint.trajectories.add(turn.rollout, turn.segment, turn.messages, turn.prompt_ids, c.tokens[:n],
                                      c.logprobs[:n], c.versions[:n], reply)
        turn.done = True
        # (its samples go with the trajectory, not through feedback: ended here, or the traffic's
        # tables kept one entry per agent call for the whole run)
        endpoint.traffic.joined(completion.cid)
        return
    endpoint.traffic.timed(completion.cid, completion.first_token_s, completion.token_s)
    if completion.cancelled or not all(c.finish_reason for c in completion.choices):
        endpoint.traffic.count("cancelled")
        endpoint.traffic.dropped(completion.cid)
        return
    if completion.params.greedy:
        endpoint.traffic.dropped(completion.cid)
        return
    early = sum(c.stopped_early for c in completion.choices)
    if early:
        endpoint.traffic.count("stopped_early", early)
    endpoint.traffic.finished(completion.cid, completion.samples(), ready=endpoint.config.reward == "recipe")


def sse(obj: dict) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class Format:
    """OpenAI's response and chunk bodies for one request."""

    def __init__(self, endpoint, req: Sampling, cid: str, chat: bool, prompt_ids: list[int], tool_parser=None,
                 model: str = ""):
        self.endpoint, self.req, self.cid, self.chat, self.prompt_ids = endpoint, req, cid, chat, prompt_ids
        self.model = model or endpoint.model_name
        self.tool_parser = tool_parser
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
            return {"content": [{"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
                                for p, lp in zip(pieces, logprobs)]}
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
            control = added_pattern(self.endpoint.tokenizer) if calls and self.endpoint is not None else None
            if control is not None and any(control.search(call["name"]) or control.search(call["arguments"])
                                           for call in calls):
                # a control token's string in a call's name or arguments: echoed back in the next
                # turn, the endpoint refuses it there (the template would write it as that token);
                # the reply is its content without the calls (as the parser read it: a model's
                # reasoning stays out)
                calls = []
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
            # the reply's tool calls, parsed once it is whole, ride on its last chunk
            calls = self.reply(choice).get("tool_calls", [])
            if calls and choice.finish_reason == "stop":
                body["delta"]["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
                finish = "tool_calls"
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
            delta = content[len(sent):] if content.startswith(sent) else ""
        else:
            text, start = choice.text, getattr(self.tool_parser, "start", "")
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
