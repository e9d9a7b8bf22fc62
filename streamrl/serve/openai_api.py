"""The OpenAI-compatible HTTP API (FastAPI), served on a generate worker.

``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions`` (both streamed as
server-sent events with ``stream: true``, one event per decode step's tokens) and ``POST
/v1/feedback`` (a reward for a completion). Responses carry, beside OpenAI's fields, a
``streamrl`` object an OpenAI client ignores: the prompt's and each choice's token ids, their
log-probs and the policy version that decoded each token. This module holds the
:class:`Endpoint` (what the API serves, its bounds and the prompts it makes); ``routes.py`` the
routes that ask it.

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
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Request

from streamrl.chat import content_as_text
from streamrl.chat.messages import MAX_CHARS_PER_TOKEN, MessageError, normalize, render
from streamrl.engines.stop_tokens import of_engine
from streamrl.serve.completion import Params, token_ids
from streamrl.recipe.serve import ServeConfig
from streamrl.rewards.scoring import REWARD_LIMIT
from streamrl.serve.admission import ADMISSION_BODIES, admitted
from streamrl.serve.request_bodies import APIError, ChatRequest, CompletionRequest, RefusalLog, Sampling, busy
from streamrl.serve.traffic import Traffic
from streamrl.telemetry.thread_cpu import cpu_seconds
from streamrl.serve.trajectories import ROLLOUT_HEADER, ROLLOUT_KEY_HEADER, Trajectories

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
        self.learns_from_traffic = not rollout_key
        """Whether requests other than the run's rollouts become samples: not on an agent run's
        endpoint (its steps train on its rollouts and take no served traffic, which would be
        kept, unrewarded or rewarded, for the run's whole life); they are answered all the same."""
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
                                f"{c.max_prompt_tokens} (engine.max_prompt_tokens).",
                           param="messages" if hasattr(req, "messages") else "prompt", code="context_length_exceeded")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > 4 or any(not s for s in stop):
            raise APIError(400, "stop takes at most 4 non-empty strings.", param="stop")
        if req.n > self.config.max_pending:  # (a 429 would be retried for ever: no wait makes room for it)
            raise APIError(400, f"n {req.n} is more than this endpoint runs at once: at most "
                                f"{self.config.max_pending} (serve.max_pending).", param="n")
        # (the run's own rollouts queue instead: their number is bounded by the agent pool, and a
        # rollout refused for load failed, trained as the policy's failure)
        if self.pending + req.n > self.config.max_pending and not rollout:
            raise busy(self.traffic, f"{self.pending} completions are running or queued "
                                     f"(serve.max_pending = {self.config.max_pending})")
        learned = not rollout and req.temperature != 0 and self.learns_from_traffic  # (greedy: never trained)
        # past serve.max_waiting samples held (waiting for feedback, or for a step) a request is
        # answered and not kept: refused, one client that never sends feedback kept every other
        # client's requests out; kept, traffic faster than the steps filled the worker's memory
        kept = not learned or self.traffic.held() + req.n <= self.config.max_waiting
        return Params(max_tokens=limit, n=req.n, greedy=req.temperature == 0, stop=stop, answer=req.answer, kept=kept)

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
