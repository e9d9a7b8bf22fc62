"""What the OpenAI-compatible API takes, and how it refuses: the request bodies (strict
pydantic models: a field takes its own JSON type, as OpenAI's API does), read within their
bounds of size, time and depth (:func:`read_body`), and the errors in OpenAI's shape
(``{"error": {"message", "type", "param", "code"}}``), with the log of refusals that counts a
flood instead of printing it."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from starlette.requests import ClientDisconnect

from streamrl.chat.messages import MAX_NESTING, nested_deeper
from streamrl.recipe.serve import ServeConfig
from streamrl.telemetry.text import printable

log = logging.getLogger("streamrl.serve")

#: The most characters an ``answer`` may have, written as JSON: a reference answer is short, and
#: a served completion keeps it until its feedback comes (``serve.feedback_timeout_s``).
MAX_ANSWER_CHARS = 65_536

#: The most messages a chat request may have: an agent's long conversation of tool calls is
#: hundreds; many thousands, however short, only cost the template and the tokenizer.
MAX_MESSAGES = 4096

#: Most characters of one stop sequence: a streamed reply holds back as many as its longest
#: stop's, less one (a stop of a megabyte held every character back until the reply's end).
MAX_STOP_CHARS = 512

#: A body larger than this is parsed and checked in a thread, off the event loop that streams
#: every other client's tokens; a small one is quicker to parse than to hand over.
PARSE_OFF_LOOP_BYTES = 64 * 1024

class APIError(Exception):
    """A request the API refuses: an OpenAI-shaped error with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        """The error as OpenAI's JSON body."""
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def busy(traffic, why: str) -> APIError:
    """The 429 for a request the endpoint has no room for now (``why``: what is full, and the
    setting that bounds it), counted as refused in ``traffic``; the client retries after a second."""
    traffic.count("refused")
    return APIError(429, f"The endpoint is busy: {why}; retry shortly.", kind="rate_limit_error",
                    code="rate_limit_exceeded", headers={"Retry-After": "1"})


class RefusalLog:
    """Refused requests in the worker's log: one line, then at most one every ``every_s``
    seconds, which counts those refused in between (a flood of bad requests is a few lines, not
    one per request among the run's steps)."""

    def __init__(self, every_s: float = 10.0):
        self.every_s, self.last, self.quiet = every_s, -float("inf"), 0

    def say(self, line: str) -> None:
        """Log ``line`` unless a line went out less than ``every_s`` ago (then count it)."""
        now = time.monotonic()
        if now - self.last < self.every_s:
            self.quiet += 1
            return
        if self.quiet:
            line += f" (and {self.quiet} more refused since the last line)"
        log.warning(printable(line))
        self.last, self.quiet = now, 0


#: Fields with a default other than null that take null as that default (``"n": null``).
NULL_IS_DEFAULT = ("n", "stream", "logprobs", "echo")


class StreamOptions(BaseModel):
    """``stream_options``: whether a stream ends with the usage chunk."""

    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class Sampling(BaseModel):
    """The fields both completion endpoints share. Others are accepted and dropped as the body
    is read (OpenAI's clients send some this endpoint has no use for; kept, a body of a few MB of
    unknown keys held tens of MB for as long as its request ran); those that would change what
    the policy samples are refused unless at their defaults (:meth:`_not_served`).

    Strict, as OpenAI's API is: a field takes its own JSON type, not one that could be read as
    it (``"max_tokens": "3"``, ``"stream": "yes"``, ``"n": true`` are 400s naming the field);
    a float field still takes a JSON integer (``"temperature": 1``)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str = Field(max_length=256)
    """The served model's name (256 characters at most: an error that names it stays short)."""
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=64)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    # (a list of the body stops at its first bad item, ``fail_fast``: a list of a million bad items
    # otherwise made a million errors, seconds of the event loop's time to build and sort)
    stop: (Annotated[str, Field(max_length=MAX_STOP_CHARS)]
           | Annotated[list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]], Field(max_length=4, fail_fast=True)]
           | None) = None
    """Up to 4 sequences, as OpenAI's API takes: the reply ends where one appears. Each at most
    ``MAX_STOP_CHARS`` characters: a streamed reply holds back as many characters as its longest
    stop, less one, in case one is coming."""
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    """Options that change what is sampled (OpenAI's, and the last three vLLM's): refused unless
    at their defaults (0, 0, empty, ``{"type": "text"}``, -1 or 0, 0, 1), since the learners
    train on the policy's own distribution and the endpoint serves nothing else -- a client
    asking for JSON output or a penalty hears so rather than getting a reply that ignores it."""
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    answer: Any = None
    """streamrl's own: the reference answer the recipe's reward checks (``serve.reward = "recipe"``);
    at most ``MAX_ANSWER_CHARS`` characters as JSON."""
    session: str | None = Field(None, min_length=1, max_length=256)
    """streamrl's own: a conversation or user session this request belongs to; one ``POST
    /v1/feedback`` with ``session`` rewards all of the session's completions still waiting."""

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        # OpenAI's API takes null for its optional fields ("or null"), and some clients send it:
        # the field's default, as left out (those whose default is null take it as it is)
        if isinstance(data, dict) and any(data.get(k, 0) is None for k in NULL_IS_DEFAULT):
            data = {k: v for k, v in data.items() if not (k in NULL_IS_DEFAULT and v is None)}
        return data

    @field_validator("frequency_penalty", "presence_penalty", "logit_bias", "response_format", "top_k", "min_p",
                     "repetition_penalty")
    @classmethod
    def _not_served(cls, value, info):
        defaults = {"frequency_penalty": (0,), "presence_penalty": (0,), "logit_bias": ({},),
                    "response_format": ({"type": "text"},), "top_k": (-1, 0), "min_p": (0,), "repetition_penalty": (1,)}
        if value is not None and value not in defaults[info.field_name]:
            raise ValueError(f"{info.field_name} is not served: replies are sampled from the policy as it is (the "
                             "learners train on its own distribution); leave it out")
        return value

    @field_validator("stream_options")
    @classmethod
    def _only_streamed(cls, value: StreamOptions | None, info) -> StreamOptions | None:
        # as OpenAI's API: options of a stream on a request that does not stream are a mistake
        # the client should hear of, not a setting silently dropped
        if value is not None and not info.data.get("stream", False):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @field_validator("answer")
    @classmethod
    def _short_answer(cls, value: Any) -> Any:
        if value is not None and len(json.dumps(value)) > MAX_ANSWER_CHARS:
            raise ValueError(f"an answer is at most {MAX_ANSWER_CHARS} characters as JSON")
        return value


class ToolFunction(BaseModel):
    """A tool's ``function``: what a chat template shows the model of it (its other fields --
    ``strict``, as OpenAI's Agents SDK sends -- kept for the template: they count in the
    request's size like the rest)."""

    model_config = ConfigDict(extra="allow", strict=True)
    name: str = Field(pattern=r"^[\w.:-]{1,64}$")
    """Letters, digits, ``_ . : -``, at most 64 (OpenAI's rule, with ``.`` and ``:`` as namespaced
    tools use): a chat template pastes the name into the prompt as it is."""
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """Its arguments as a JSON Schema."""


class Tool(BaseModel):
    """One of a chat request's ``tools``, in OpenAI's format: a function the model may call."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["function"]
    function: ToolFunction


class ChatRequest(Sampling):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_MESSAGES, fail_fast=True)]
    """The conversation, at most ``MAX_MESSAGES`` messages (each is at least a token of the prompt)."""
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=128)
    """Functions the model may call, in OpenAI's format; shown to the model by its chat template
    (checked here: a template reads ``tools[i].function.name`` and fails on a tool without it)."""
    tool_choice: str | dict[str, Any] | None = None
    """``"none"``: the reply is not parsed for tool calls; anything else parses it. ``"required"``
    and a named function are taken as ``"auto"``: the reply is parsed for the calls the model
    makes, never forced to make one (forcing would decode from another distribution than the
    policy's, the one the learners train on); agent frameworks send them by default."""


    def tool_choice_problem(self) -> str | None:
        """What is wrong with ``tool_choice`` as OpenAI's API takes it (one sentence), or None:
        ``"none"``, ``"auto"``, ``"required"`` or ``{"type": "function", "function": {"name": N}}``
        with ``N`` among the tools, and anything but ``"none"`` only with tools."""
        choice = self.tool_choice
        if choice is None:
            return None
        if isinstance(choice, str):
            if choice not in ("none", "auto", "required"):
                return f"Invalid value for 'tool_choice': {choice[:40]!r}; expected 'none', 'auto', 'required' or a function."
        else:
            function = choice.get("function")
            name = function.get("name") if isinstance(function, dict) else None
            if choice.get("type") != "function" or not isinstance(name, str):
                return "Invalid value for 'tool_choice': expected {'type': 'function', 'function': {'name': ...}}."
            if name not in {t.function.name for t in self.tools or ()}:
                return f"Invalid value for 'tool_choice': no function named {name[:64]!r} among the tools."
        if choice != "none" and not self.tools:
            return "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are specified."
        return None

    def tool_list(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template and the trajectories take them: plain JSON objects."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class CompletionRequest(Sampling):
    """``POST /v1/completions``."""

    prompt: str | Annotated[list[int], Field(fail_fast=True)]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=1)
    """1 or left out: the endpoint samples ``n`` choices and returns them all, it does not rank."""
    suffix: str | None = Field(None, max_length=0)
    """Left out (or empty): insertion after a suffix is not served."""


class Feedback(BaseModel):
    """``POST /v1/feedback``: a reward for one choice (``index``) or every choice of a completion
    (``id``), or for every waiting completion of a session (``session``). Strict, as the
    completion requests are (``"index": "1"`` is a 400)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str | None = Field(None, max_length=256)
    session: str | None = Field(None, min_length=1, max_length=256)
    index: int | None = Field(None, ge=0)
    reward: float = Field(strict=True, allow_inf_nan=False)
    """A JSON number (not a string or a boolean), finite, and within the run's ``reward.limit``
    either way (the route checks that): one value past it would overflow a training step's loss."""

    @model_validator(mode="after")
    def _one_target(self) -> "Feedback":
        if (self.id is None) == (self.session is None):
            raise ValueError("give exactly one of 'id' (a completion) and 'session'")
        if self.session is not None and self.index is not None:
            raise ValueError("'index' names a choice of a completion; a session's feedback rewards every choice")
        return self


def _param(body: dict, error: dict) -> str:
    """The field of ``body`` a validation ``error`` names, as ``a.0.b``. Pydantic puts a union's
    member type in the error's place (``("prompt", "str")``), which names nothing the client
    sent: only the steps that lead into the body are kept, and a missing field's own name."""
    parts, node = [], body
    for x in error["loc"]:
        if not ((isinstance(node, dict) and isinstance(x, str) and x in node)
                or (isinstance(node, list) and isinstance(x, int) and 0 <= x < len(node))):
            continue  # (a union member's type: nothing the client sent)
        node = node[x]
        parts.append(str(x))
    if error["type"] == "missing" and error["loc"]:
        parts.append(str(error["loc"][-1]))
    return ".".join(parts)


async def read_body(request: Request, model: type[BaseModel], config: ServeConfig, room=None, limit: int | None = None):
    """A request's JSON body as ``model``: a 413 past ``serve.max_body_bytes`` (before it is
    read to the end), a 408 when it does not come within ``serve.body_timeout_s``, a 400 naming
    the first bad field otherwise (or saying what else is wrong with it: not JSON, not Unicode,
    nested too deeply). ``room``: told of each piece's bytes as it comes (``room.take``, which
    may refuse it); ``limit``: a route's own bound, below ``serve.max_body_bytes``."""
    said = "" if limit is not None and limit < config.max_body_bytes else " (serve.max_body_bytes)"
    limit = min(limit or config.max_body_bytes, config.max_body_bytes)
    too_large = APIError(413, f"The request body is larger than this endpoint takes: at most {limit} bytes"
                              f"{said}.", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async with asyncio.timeout(config.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:  # (a body sent without its length, or longer than it said)
                    raise too_large
                if room is not None:
                    room.take(len(chunk))
                chunks.append(chunk)
    except ClientDisconnect:  # the client went away before its body came: nothing to answer
        raise APIError(400, "The client disconnected before sending its request.") from None
    except TimeoutError:
        raise APIError(408, f"The request body did not come within {config.body_timeout_s:g} s "
                            "(serve.body_timeout_s).", code="request_timeout") from None
    body = b"".join(chunks)
    if size > PARSE_OFF_LOOP_BYTES:
        return await asyncio.to_thread(parse_body, body, model)
    return parse_body(body, model)


def non_finite(value: Any, path: str = "") -> str | None:
    """Where in ``value`` (parsed JSON, nested at most ``MAX_NESTING`` levels) a number is not
    finite, as ``a.0.b``, or None: ``NaN`` and ``Infinity`` (which Python's JSON reads and JSON
    does not have) and numbers too large for a float (``1e999``). A number goes on to a reward,
    a sampling setting or a checkpoint; none of them takes one that is not finite."""
    if isinstance(value, float):
        return None if math.isfinite(value) else path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = non_finite(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def parse_body(body: bytes, model: type[BaseModel]):
    """``body`` (JSON) as ``model``, or the :class:`APIError` that says what is wrong with it."""
    deep = APIError(400, f"The request body is nested too deeply (more than {MAX_NESTING} levels of arrays "
                         "and objects).")
    try:
        raw = json.loads(body)
        # a lone surrogate ("\ud800") is valid JSON but no text a tokenizer can encode
        json.dumps(raw, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "The request body has a string that is not valid Unicode (a lone surrogate).") from None
    except RecursionError:
        raise deep from None
    except ValueError:  # (not JSON, not UTF-8, or an integer of more digits than Python reads: 4,300)
        raise APIError(400, "The request body is not valid JSON.") from None
    if not isinstance(raw, dict):
        raise APIError(400, "The request body must be a JSON object.")
    # Valid JSON, but what it holds goes on to a chat template and, pickled, to the trainer:
    # both recurse once per level (an ``answer`` 500 levels deep made a step wait for ever)
    if nested_deeper(raw):
        raise deep
    where = non_finite(raw)
    if where is not None:
        raise APIError(400, f"Invalid value for '{where}': a number that is not finite (NaN, Infinity or past a "
                            "float's range); JSON numbers are finite.", param=where)
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        errors = e.errors(include_url=False, include_input=False)
        # the first bad field; of a union's errors on it, the one that goes deepest into
        # what was sent ("prompt": [1, "2"] -> prompt.1, not "prompt is not a string")
        err = max((x for x in errors if x["loc"][:1] == errors[0]["loc"][:1]),
                  key=lambda x: len(_param(raw, x).split(".")))
        field = _param(raw, err)
        if not field:  # a rule over several fields (``model_validator``): its own words
            raise APIError(400, err["msg"].removeprefix("Value error, ") + ".") from None
        raise APIError(400, f"Invalid value for '{field}': {err['msg'].removeprefix('Value error, ')}.",
                       param=field) from None

