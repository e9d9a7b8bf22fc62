"""The OpenAI-compatible HTTP API (FastAPI), served on a generate worker.

``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions`` (both streamed as
server-sent events with ``stream: true``, one event per decode step's tokens) and ``POST
/v1/feedback`` (a reward for a completion). Responses carry, beside OpenAI's fields, a
``streamrl`` object an OpenAI client ignores: the prompt's and each choice's token ids, their
log-probs and the policy version that decoded each token.

Errors have OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``) and a 4xx
status; a flood of them is a few lines in the worker's log. Request fields take their own JSON
types, as OpenAI's do (``request_bodies.py``: ``"max_tokens": "3"`` is a 400 naming
``max_tokens``); the answers, whole or streamed, are made in ``responses.py``. Sampling follows
the policy: ``temperature`` may be omitted, equal ``engine.temperature`` (the samples the learners train on) or be 0 (greedy; served,
not trained); ``top_p`` 1; ``seed`` is accepted and not honoured (one draw serves all slots).

Tools: a chat request's ``tools`` reach the model's chat template, and each reply is parsed by
the ``serve.tool_parser`` into ``message.tool_calls`` (``finish_reason: "tool_calls"``). An agent's
calls that carry the ``X-Streamrl-Rollout`` header join one token-faithful trajectory
(``serve/trajectories.py``), which ``POST /v1/streamrl/rollouts/{id}/finish`` hands over.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from streamrl.chat import content_as_text
from streamrl.chat.messages import MAX_CHARS_PER_TOKEN, MessageError, normalize, render
from streamrl.engines.stop_tokens import of_engine
from streamrl.serve.completion import Params, token_ids
from streamrl.recipe.serve import ServeConfig
from streamrl.rewards.scoring import REWARD_LIMIT
from streamrl.serve.admission import ADMISSION_BODIES, FEEDBACK_BODY_BYTES, admitted
from streamrl.serve.contained import RETRY_AFTER_S, Contained
from streamrl.serve.request_bodies import (APIError, ChatRequest, CompletionRequest, Feedback, RefusalLog, Sampling,
                                          busy, read_body)
from streamrl.serve.responses import Turn, respond
from streamrl.serve.traffic import STOPPING, Traffic
from streamrl.telemetry.thread_cpu import cpu_seconds
from streamrl.serve.trajectories import (ROLLOUT_HEADER, ROLLOUT_KEY_HEADER, RolloutFinished, RolloutLimit,
                                        Trajectories)

#: Seconds an engine on another worker that failed to answer is passed over (``engine_for``).
UNHEALTHY_S = 10.0


class Endpoint:
    """What the API serves from: the engine, its tokenizer, the traffic store and the settings."""

    def __init__(self, engine, config: ServeConfig, traffic: Traffic, model_name: str, tool_parser=None,
                 rollout_key: str = "", reward_limit: float = REWARD_LIMIT):
        self.engine, self.config, self.traffic, self.model_name = engine, config, traffic, model_name
        self.reward_limit = reward_limit
        """The run's ``reward.limit``: feedback past it either way is a 400 naming ``reward``."""
        self.rollout_key = rollout_key
        """The secret an agent's call must send in ``X-Streamrl-Rollout-Key`` (empty: this
        endpoint takes no agent calls, as a ``streamrl serve`` endpoint)."""
        self.tokenizer = engine.tokenizer
        self.tool_parser = tool_parser
        self.refusals = RefusalLog()
        """Refused requests in the worker's log, rate-limited."""
        self.ready = True
        """Whether the API answers: False while the run is still adding the models it will list
        (a request gets 503 with ``Retry-After``, ``GET /health`` says ``starting``)."""
        self.kept_tokens = token_ids(self.tokenizer, getattr(tool_parser, "keep_tokens", ()))
        """The ids of the parser's ``keep_tokens``: a reply to a request with tools keeps them in
        its text."""
        self.worker = ""
        """The name of the Dask worker serving (set by ``endpoint.start``)."""
        self.trajectories = Trajectories(self.tokenizer, self.encode_chat, of_engine(engine))
        self.pending = 0  # choices asked and not ended (serve.max_pending)
        self.admitted_bytes = 0
        """Bytes of the request bodies being read, parsed or tokenized now (as each declared, or
        ``serve.max_body_bytes`` for one that did not): at most :attr:`admission_budget`."""
        self.admission_budget = ADMISSION_BODIES * config.max_body_bytes
        self.created = int(time.time())
        self.engines: dict[str, list] = {model_name: [engine]}
        """The engines that answer each ``model`` a request may give: under ``model_name`` the
        served policy's, this worker's and the other generate workers' (``serve/remote_engines.py``),
        and under a side learner's name that learner's."""
        self.running: dict[int, int] = {}
        """Choices running per engine (by ``id``): a request goes to the least busy."""
        self._turn = 0
        # Prompts are tokenized here, one at a time, off the server's event loop: a long prompt
        # takes that thread, not every other client's requests and streams.
        self.tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamrl-tokenize")
        self.parse_lock = threading.Lock()
        """Held while a reply is parsed for tool calls (``response_bodies.Format.parse``, off the loop):
        the parser sees one reply at a time."""

    def host_counts(self) -> dict[str, Any]:
        """What the serving path has cost the host so far (call it on the server's thread): the
        CPU seconds of the HTTP server's thread and of this engine's decode loop (None where the
        platform cannot say), and the loop's own counters (``SlotEngine.loop_counts``). The two
        threads share the interpreter lock: their CPU per streamed token bounds how many tokens a
        second this process can stream, however fast the accelerator decodes."""
        loop = getattr(self.engine, "loop_thread", None)
        return {"http_cpu_s": cpu_seconds(threading.current_thread()), "decode_loop_cpu_s": cpu_seconds(loop),
                **{f"decode_loop_{k}": v for k, v in getattr(self.engine, "loop_counts", {}).items()}}

    def admission(self):
        """Room for a request's body while it is read, parsed and tokenized (``admission.py``)."""
        return admitted(self)

    async def off_loop(self, fn, *args):
        """``fn(*args)`` in the tokenizing thread (its exceptions raised here)."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, fn, *args)

    def check_characters(self, chars: int, param: str, messages: int = 0) -> None:
        """A 400 for a prompt of more characters than it could fit in tokens (before tokenizing
        it); each of its ``messages`` counts as a token's worth too, however empty: the template
        writes at least a token for it."""
        most = self.engine.config.max_prompt_tokens * MAX_CHARS_PER_TOKEN
        if chars + messages * MAX_CHARS_PER_TOKEN > most:
            held = f" in {messages} message{'s' * (messages != 1)} (each at least a token)" if messages else ""
            raise APIError(400, f"The prompt has {chars} characters{held}; this endpoint takes prompts of at most "
                                f"{self.engine.config.max_prompt_tokens} tokens (engine.max_prompt_tokens), and "
                                f"refuses more than {most} characters without tokenizing them.", param=param,
                           code="context_length_exceeded")

    def served(self, model: str) -> list:
        """The engines that answer ``model``; a 404 naming the models served otherwise."""
        engines = self.engines.get(model)
        if engines is None:
            names = ", ".join(f"'{m}'" for m in self.engines)
            raise APIError(404, f"The model '{model}' does not exist; this endpoint serves {names} (GET /v1/models).",
                           param="model", code="model_not_found")
        return engines

    def engine_for(self, model: str, rollout: bool = False):
        """The engine that answers ``model``, the least busy of those that can (an agent's
        rollout: always this worker's, whose trajectory store it joins); a 404 naming the models
        served otherwise."""
        if rollout:
            return self.engine
        engines = self.served(model)
        # one that failed to answer in the last few seconds is passed over while another can
        healthy = [e for e in engines if time.time() - getattr(e, "failed_at", 0.0) > UNHEALTHY_S] or engines
        self._turn += 1  # (ties go round: sequential requests spread over the workers too)
        k = self._turn % len(healthy)
        return min(healthy[k:] + healthy[:k], key=lambda e: self.running.get(id(e), 0))

    # -- checks ---------------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        """``Authorization: Bearer <serve.api_key>`` when a key is set."""
        if not self.config.api_key:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {self.config.api_key}".encode()):
            raise APIError(401, "Incorrect or missing API key (send 'Authorization: Bearer <key>').",
                           code="invalid_api_key")

    def check_rollout(self, request: Request) -> None:
        """A 403 for a call that names a rollout without the run's rollout key: only the run's
        own agents add to its trajectories."""
        given = request.headers.get(ROLLOUT_KEY_HEADER, "")
        if not self.rollout_key or not secrets.compare_digest(given.encode(), self.rollout_key.encode()):
            raise APIError(403, f"{ROLLOUT_HEADER} is for the run's own agent rollouts; this request is not one of "
                                "theirs (omit the header).", code="rollout_forbidden", kind="permission_error")

    def params(self, req: Sampling, prompt_ids: list[int] | None, rollout: bool = False) -> Params:
        """The request's sampling, checked against the engine and the policy (``rollout``: an
        agent's call, whose reply joins its rollout and waits for no feedback). ``prompt_ids``
        None: every check but the prompt's length, made before the prompt is tokenized (a request
        refused anyway costs no template and no tokenizer time, which others wait for)."""
        c = self.engine.config  # (a learner's engine has the served one's settings)
        if req.temperature not in (None, 0) and abs(req.temperature - c.temperature) > 1e-6:
            raise APIError(400, f"temperature {req.temperature} is not served: the policy samples at "
                                f"{c.temperature} (engine.temperature); omit it, or 0 for greedy.", param="temperature")
        if req.top_p not in (None, 1):
            raise APIError(400, "top_p other than 1 is not served (the policy samples from its whole distribution).",
                           param="top_p")
        limit = req.max_completion_tokens or req.max_tokens or c.max_new_tokens
        if limit > c.max_new_tokens:
            field = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"  # (the one it sent)
            raise APIError(400, f"{field} {limit} is more than this endpoint generates: at most "
                                f"{c.max_new_tokens} (engine.max_new_tokens).", param=field)
        if prompt_ids is not None and len(prompt_ids) > c.max_prompt_tokens:
            raise APIError(400, f"The prompt has {len(prompt_ids)} tokens; this endpoint takes at most "
                                f"{c.max_prompt_tokens} (engine.max_prompt_tokens).", param="messages",
                           code="context_length_exceeded")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > 4 or any(not s for s in stop):
            raise APIError(400, "stop takes at most 4 non-empty strings.", param="stop")
        if req.n > self.config.max_pending:  # (a 429 would be retried for ever: no wait makes room for it)
            raise APIError(400, f"n {req.n} is more than this endpoint runs at once: at most "
                                f"{self.config.max_pending} (serve.max_pending).", param="n")
        if self.pending + req.n > self.config.max_pending:
            raise busy(self.traffic, f"{self.pending} completions are running or queued "
                                     f"(serve.max_pending = {self.config.max_pending})")
        waits = self.config.reward == "feedback" and not rollout and req.temperature != 0  # (greedy: never trained)
        if waits and self.traffic.waiting() >= self.config.max_waiting:
            raise busy(self.traffic, f"{self.config.max_waiting} completions wait for their feedback "
                                     "(serve.max_waiting)")
        return Params(max_tokens=limit, n=req.n, greedy=req.temperature == 0, stop=stop, answer=req.answer)

    def messages(self, req: ChatRequest) -> list[dict[str, Any]]:
        """The request's messages in the canonical shape (``chat/messages.py``); a 400 naming the
        first bad one."""
        try:
            canonical = normalize(req.messages)
        except MessageError as e:
            raise APIError(400, str(e), param=e.param) from None
        # the raw messages go: what a client put in them besides the canonical fields (kept,
        # megabytes of it, for as long as the request ran) is no longer counted anywhere
        req.messages = canonical
        return canonical

    def encode_chat(self, text: str, contents: dict[str, str] | None = None) -> list[int]:
        """Rendered chat text as token ids: the template wrote the control tokens, and the
        guarded ``contents`` (``chat/content_as_text.py``) are text. A tokenizer without a
        template gets the engine's own encoding, BOS first. Text longer than the prompt limit
        could hold is refused before it is tokenized (thousands of empty messages, each a few
        characters of the template's)."""
        self.check_characters(len(text), "messages")
        if getattr(self.tokenizer, "chat_template", None):
            return content_as_text.encode(self.tokenizer, text, contents or {})
        if not contents:
            return self.engine.encode(text)
        return self.engine.encode("") + content_as_text.encode(self.tokenizer, text, contents)  # (BOS, if any)

    def chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> list[int]:
        """The messages (and tools) through the model's chat template (a plain ``role: content``
        layout for a tokenizer without one); their contents are text, whatever they hold."""
        guarded, contents = content_as_text.guard(self.tokenizer, messages)
        return self.encode_chat(render(self.tokenizer, guarded, tools, generation_prompt=True), contents)

    def completion_prompt(self, req: CompletionRequest) -> list[int]:
        """The prompt as the engine encodes a task's (BOS, then the text), or the given token ids.
        Text is text: a control token's string in it is not that token (send ids for those)."""
        if isinstance(req.prompt, list):
            vocab = len(self.tokenizer)
            if not req.prompt or any(not 0 <= t < vocab for t in req.prompt):
                raise APIError(400, f"prompt token ids must be a non-empty list of ids below {vocab}.", param="prompt")
            return list(req.prompt)
        pattern = content_as_text.added_pattern(self.tokenizer)
        if pattern is None or not pattern.search(req.prompt):
            ids = self.engine.encode(req.prompt)
        else:
            ids = self.engine.encode("") + content_as_text.text_ids(self.tokenizer, req.prompt)  # (BOS, if any)
        if not ids:  # (a model without a BOS token: an empty text is no tokens at all)
            raise APIError(400, "The prompt is empty, and this model's tokenizer puts no token in front of a text to "
                                "start from; send some text.", param="prompt")
        return ids


def make_app(endpoint: Endpoint) -> FastAPI:
    """The FastAPI application of ``endpoint``."""
    app = FastAPI(title="streamrl", docs_url=None, redoc_url=None, openapi_url=None)
    refusals = endpoint.refusals

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        # counted, each kind apart (a 429 is counted where it is decided: ``refused``); logged a
        # few lines at a time
        if exc.status >= 500:
            endpoint.traffic.count("server_errors")
        elif exc.status != 429:
            endpoint.traffic.count("invalid")
        refusals.say(f"{request.method} {request.url.path} -> {exc.status} {exc.message}")
        return exc.response()

    app.add_middleware(Contained, endpoint=endpoint)

    @app.exception_handler(404)
    async def not_found(request: Request, exc):
        return APIError(404, f"Unknown path {request.method} {request.url.path}.", code="not_found").response()

    @app.exception_handler(405)
    async def wrong_method(request: Request, exc):
        return APIError(405, f"{request.method} is not allowed on {request.url.path}.").response()

    @app.get("/health")
    async def health():
        # (no key asked: a load balancer's probe; it says nothing but whether the API answers)
        if not endpoint.ready:
            return JSONResponse({"status": "starting"}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request):
        endpoint.authorize(request)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": endpoint.created,
                                            "owned_by": "streamrl"} for name in list(endpoint.engines)]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        endpoint.authorize(request)
        rollout = request.headers.get(ROLLOUT_HEADER)
        with endpoint.admission() as room:
            req = await read_body(request, ChatRequest, endpoint.config, room)
            if req.top_logprobs:
                raise APIError(400, "top_logprobs is not served (only the sampled token's log-prob).",
                               param="top_logprobs")
            messages = endpoint.messages(req)
            problem = req.tool_choice_problem()
            if problem is not None:
                raise APIError(400, problem, param="tool_choice")
            tools = req.tool_list()
            # everything the template writes counts, not the contents alone: a tool call's arguments
            # or a tool's schema of megabytes is refused as fast as a content of as many characters;
            # and each message as at least one token, however empty (thousands of them are refused
            # before the template writes them all out, or the walk below reads them)
            endpoint.check_characters(sum(len(m["content"]) + sum(len(json.dumps(v)) for k, v in m.items()
                                                                  if k not in ("content", "role")) for m in messages)
                                      + (len(json.dumps(tools)) if tools else 0), "messages", len(messages))
            control = content_as_text.control_outside_content(endpoint.tokenizer, messages, tools)
            if control is not None:  # (the template would write it as the control token itself)
                raise APIError(400, f"Invalid value for '{control[0]}': it holds {control[1]!r}, a control token of "
                                    "this model; only a message's content may hold one (as text).", param=control[0])
            if rollout is None:
                endpoint.served(req.model)  # (the cheap refusals first: 404, 400s, 429)
                endpoint.params(req, None)
                try:
                    ids = await endpoint.off_loop(endpoint.chat_prompt, messages, tools)
                except MessageError as e:
                    raise APIError(400, str(e), param=e.param) from None
            else:
                endpoint.check_rollout(request)
                if req.n != 1:
                    raise APIError(400, "A rollout's call asks for one reply (n = 1); a group is several rollouts.",
                                   param="n")
                if req.temperature == 0:  # a greedy reply is not a sample of the policy: it cannot be trained
                    raise APIError(400, "A rollout's call samples from the policy: temperature 0 (greedy) is not "
                                        "served to rollouts; omit temperature.", param="temperature")
                try:
                    ids, segment = await endpoint.off_loop(endpoint.trajectories.prompt, rollout, messages, tools)
                except MessageError as e:
                    raise APIError(400, str(e), param=e.param) from None
                except RolloutLimit as e:
                    raise APIError(400, str(e)[0].upper() + str(e)[1:] + ".", code="rollout_limit") from None
                except RolloutFinished as e:
                    raise APIError(409, str(e)[0].upper() + str(e)[1:] + ".", code="rollout_finished") from None
                except ValueError as e:  # (the template or tokenizer refused these messages: not the rollout's state)
                    raise APIError(400, f"The messages could not be rendered as a prompt: {str(e)[:300]}",
                                   param="messages") from None
        if rollout is None:
            return await respond(endpoint, request, req, ids, chat=True)
        turn = Turn(rollout, segment, messages, ids)
        try:
            return await respond(endpoint, request, req, ids, chat=True, turn=turn)
        except BaseException:
            if not turn.done:
                endpoint.trajectories.abandon(rollout, segment)
            raise

    @app.post("/v1/completions")
    async def completions(request: Request):
        endpoint.authorize(request)
        with endpoint.admission() as room:
            req = await read_body(request, CompletionRequest, endpoint.config, room)
            if req.logprobs:
                raise APIError(400, "logprobs above 0 (top alternatives) is not served; the sampled tokens' "
                                    "log-probs are in the response's 'streamrl' object.", param="logprobs")
            if req.echo:
                raise APIError(400, "echo is not served.", param="echo")
            if isinstance(req.prompt, str):
                endpoint.check_characters(len(req.prompt), "prompt")
            endpoint.served(req.model)  # (the cheap refusals first: 404, 400s, 429)
            endpoint.params(req, None)
            ids = await endpoint.off_loop(endpoint.completion_prompt, req)
        return await respond(endpoint, request, req, ids, chat=False)

    @app.post("/v1/feedback")
    async def feedback(request: Request):
        endpoint.authorize(request)
        if endpoint.config.reward == "recipe":  # (it would be taken and never used)
            raise APIError(400, "This endpoint scores its completions with the recipe's reward (serve.reward = "
                                "\"recipe\"); it takes no feedback.", code="feedback_not_taken")
        with endpoint.admission() as room:  # (a feedback is a few hundred bytes: a body of megabytes is not one)
            fb = await read_body(request, Feedback, endpoint.config, room, limit=FEEDBACK_BODY_BYTES)
        if abs(fb.reward) > endpoint.reward_limit:
            raise APIError(400, f"Invalid value for 'reward': {fb.reward:g} is past this run's reward.limit; rewards "
                                f"must lie within [-{endpoint.reward_limit:g}, {endpoint.reward_limit:g}].", param="reward")
        if fb.session is not None:
            reached, problem = endpoint.traffic.session_feedback(fb.session, fb.reward)
            if problem is not None:
                raise refused_feedback(problem, "session")
            return {"object": "feedback", "session": fb.session, "accepted": True, "completions": reached}
        problem = endpoint.traffic.feedback(fb.id, fb.index, fb.reward)
        if problem is not None:  # (the field it is about: the traffic store says, the id unless told)
            raise refused_feedback(problem, getattr(problem, "field", "id"))
        return {"object": "feedback", "id": fb.id, "accepted": True}

    @app.post("/v1/streamrl/rollouts/{rollout}/finish")
    async def finish_rollout(rollout: str, request: Request):
        endpoint.authorize(request)
        endpoint.check_rollout(request)
        # (off the loop: decoding every segment of a long rollout; and a JSONResponse, not
        # FastAPI's encoder, which walks every token id in Python)
        trajectory = await endpoint.off_loop(endpoint.trajectories.finish, rollout)
        return JSONResponse({"object": "streamrl.rollout", "id": rollout, "worker": endpoint.worker, **trajectory})

    @app.get("/v1/serve/stats")
    async def stats(request: Request):
        endpoint.authorize(request)
        return {"object": "serve.stats", "pending": endpoint.pending, "policy_version": endpoint.engine.version,
                "rollouts_in_flight": endpoint.trajectories.in_flight(),
                "rollouts_dropped_stale": endpoint.trajectories.dropped_stale, **endpoint.traffic.snapshot(),
                "host": endpoint.host_counts()}

    return app


def refused_feedback(problem: str, param: str) -> APIError:
    """The error for feedback the traffic store refused (``problem``: its words): 404 for an
    unknown completion or session, 503 once the run is stopping (nothing sent now is trained),
    400 otherwise."""
    text = problem[0].upper() + problem[1:] + "."
    if problem == STOPPING:
        return APIError(503, text, code="stopping", kind="server_error")
    return APIError(404 if problem.startswith("no completion") else 400, text, param=param)
