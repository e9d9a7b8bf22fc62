"""Answering a request of the OpenAI-compatible API: run it in the engine, then the whole
response or its server-sent events (one per decode step's tokens; their bodies are made in
``response_bodies.py``); and when it ends, its choices to the learners or its reply to an agent's
trajectory."""

from __future__ import annotations

import asyncio
import json
import re
import secrets
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from streamrl.serve.completion import Completion
from streamrl.serve.remote_engines import RemoteEngine
from streamrl.serve.request_bodies import APIError, Sampling
from streamrl.serve.response_bodies import Format, sse
from streamrl.telemetry import bubbles

# ``endpoint`` below is the ``openai_api.Endpoint`` the request came to (not imported here: the
# routes that call this import both)

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
    completion.on_decoded = lambda: release(endpoint, completion)
    model = endpoint.model_name if turn is not None else req.model
    endpoint.traffic.started(cid, getattr(req, "session", None), model, params.n, trained=not params.greedy,
                             learned=turn is not None or endpoint.learns_from_traffic, kept=params.kept)
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
            raise APIError(400, str(e), param="messages" if chat else "prompt") from None
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
        # built and encoded off the event loop (before finished: a parser's 500 is raised here):
        # 64 choices of thousands of tokens with their log-probs, each token decoded, held every
        # other client's stream for seconds. Not in the tokenizing thread either: it would hold
        # every new request's prompt meanwhile (the loop decoded beside that thread before too)
        return Response(await asyncio.to_thread(whole_body, fmt, completion), media_type="application/json")
    except APIError:  # the tool parser failed on a reply: the client gets no id to reward,
        completion.cancel()  # and the learners none of its choices
        raise
    except Exception as e:  # noqa: BLE001 -- the engine failed this request: a 500 in OpenAI's shape
        completion.cancel()  # (its other choices stop decoding too)
        raise APIError(500, failure(endpoint, e), kind="server_error") from None
    finally:
        watch.cancel()
        finished(endpoint, completion, fmt)


def whole_body(fmt: Format, completion: Completion) -> bytes:
    """The non-streamed response as the bytes sent (in a thread of its own)."""
    return json.dumps(fmt.whole(completion), ensure_ascii=False, separators=(",", ":")).encode()


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
        completion.cancel()  # (the client got an error, not a reply: none of it is trained on)
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


def release(endpoint, completion: Completion) -> None:
    """The engine is done with the request (or it never started): its places in
    ``serve.max_pending`` and its engine's count go back, and its work ends. Once per request;
    :func:`finished` calls it too, for a request the engine never had."""
    if completion.released:
        return
    completion.released = True
    if completion.working:
        bubbles.end_work(completion.working)
    endpoint.pending -= completion.params.n
    endpoint.running[id(completion.engine)] = endpoint.running.get(id(completion.engine), 0) - completion.params.n


def finished(endpoint, completion: Completion, fmt: "Format | None") -> None:
    """The request ended: free its place and hand its choices to the learners (not a cancelled
    one, nor a greedy one, which is not a sample of the policy); a rollout's call joins its
    trajectory instead. Once per request, however it ends."""
    if completion.ended:
        return
    completion.ended = True
    release(endpoint, completion)
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
    if not completion.params.kept and not completion.params.greedy and endpoint.learns_from_traffic:
        endpoint.traffic.count("unkept", len(completion.choices))  # (answered past serve.max_waiting)
    if completion.params.greedy or not endpoint.learns_from_traffic or not completion.params.kept:  # (not kept)
        endpoint.traffic.dropped(completion.cid)
        return
    early = sum(c.stopped_early for c in completion.choices)
    if early:
        endpoint.traffic.count("stopped_early", early)
    endpoint.traffic.finished(completion.cid, completion.samples(), ready=endpoint.config.reward == "recipe")
