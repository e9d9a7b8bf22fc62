"""The recipe's ``[serve]`` table: where the OpenAI-compatible endpoint listens and how its
traffic becomes training samples."""

from __future__ import annotations

import ipaddress
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from streamrl.errors import UserError
from streamrl.recipe.strict import Strict


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address or ``localhost`` (no one else can connect)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ServeConfig(Strict):
    """``[serve]``: a run whose samples are the traffic of an OpenAI-compatible endpoint on the
    generate pool (``streamrl serve R.toml``), not a task's prompts."""

    host: str = "127.0.0.1"
    """Address the endpoint binds. Loopback by default: anything else exposes the policy to the
    network and needs :attr:`api_key`."""
    port: int = Field(8000, ge=0, le=65535)
    """TCP port of the endpoint (0: any free port, printed at start and written to
    ``serve.json`` in the run folder)."""
    api_key: str = ""
    """When set, every request must carry ``Authorization: Bearer <api_key>`` (required when
    :attr:`host` is not loopback)."""
    model_name: str = ""
    """The name ``GET /v1/models`` lists and requests' ``model`` may give (empty: the run's
    name). Any other ``model`` is a 404."""
    reward: Literal["feedback", "recipe"] = "feedback"
    """Where a completion's reward comes from: ``feedback``, a client's ``POST /v1/feedback``
    (completions without one within :attr:`feedback_timeout_s` are dropped and counted);
    ``recipe``, the recipe's ``[reward]`` applied as each completion finishes, with the request's
    extra ``answer`` field (if any) as the reference answer."""
    feedback_timeout_s: float = Field(600.0, gt=0, le=1e6)  # (bounded: a timer of 1e300 s cannot be armed)
    """Seconds a finished completion waits for its feedback before it is dropped (counted as
    ``serve/unrewarded_dropped``)."""
    samples_per_step: int = Field(16, ge=1)
    """A training step starts once this many rewarded samples have come in (whole requests:
    the ``n`` completions of one request are one group and stay together)."""
    tool_parser: str | dict[str, Any] = "hermes"
    """How a reply's text becomes OpenAI's ``tool_calls`` when a request offers ``tools``: the
    name of a registered ``tool_parser``, or ``{ name = ..., <its options> }`` for one that takes
    options: ``hermes`` (``<tool_call>{json}</tool_call>`` blocks: Qwen2.5,
    Hermes and the shipped tiny calculator model), ``qwen3`` (the same, its ``<think>`` block
    left out of the content), ``llama3_json`` (Llama 3.x's ``{"name", "parameters"}`` replies)
    or ``mistral`` (``[TOOL_CALLS]``), or one a plugin adds."""

    @field_validator("tool_parser")
    @classmethod
    def _named(cls, value):
        if isinstance(value, dict) and not isinstance(value.get("name"), str):
            raise ValueError("a table needs a 'name' (a registered tool_parser)")
        return value

    def build_tool_parser(self, registry):
        """The :attr:`tool_parser` built from ``registry`` (its options validated: one-line
        errors naming ``serve.tool_parser``)."""
        options = {"name": self.tool_parser} if isinstance(self.tool_parser, str) else dict(self.tool_parser)
        name = options.pop("name")
        component = registry.get("tool_parser", name, "serve.tool_parser")
        config = component.validate(options, "serve.tool_parser")
        try:
            return component.factory(config)
        except (Exception, SystemExit) as exc:  # (the plugin's constructor: one line naming it, not a traceback)
            where = f", from plugin {component.plugin}" if component.plugin else ""
            try:
                said = " ".join(str(exc).split())[:300]
            except Exception:
                said = ""
            raise UserError(f"serve.tool_parser: {name!r} could not be built{where}: {type(exc).__name__}: "
                            f"{said}") from None
    variants: bool = True
    """Serve each side learner's current policy too (``[[learners]]``, and those added while
    the run goes on), from an engine on its own worker: a request whose ``model`` is
    ``<model_name>/<learner>`` is answered by that learner's policy, and every learner trains on
    all rewarded traffic, whichever policy answered it (an A/B comparison of algorithms on live
    traffic). False: only the served policy answers; side learners build no engine for it."""
    max_body_bytes: int = Field(4 * 2**20, ge=1024)
    """The largest request body the endpoint reads (4 MiB by default); a larger one is answered
    ``413`` before it is read to the end or parsed, so one client cannot stall the others or
    fill the serving worker's memory. (A prompt must also fit ``engine.max_prompt_tokens``.)"""
    body_timeout_s: float = Field(30.0, gt=0, le=1e6)  # (bounded: a timer of 1e300 s cannot be armed)
    """Seconds a client has to send a request's body once its headers came; past them it is
    answered ``408``. Why: a client that declares a body and sends it a byte at a time would
    hold its connection, and a task of the serving worker, for as long as it liked."""
    max_pending: int = Field(256, ge=1)
    """Completions asked for but not finished, across all requests; a request that would go
    past it is answered ``429`` with ``Retry-After`` instead of queueing without bound. An agent
    run's own rollout calls are never refused for it (they queue: the agent pool bounds them)."""
    max_waiting: int = Field(4096, ge=1)
    """Samples (finished choices) held to learn from, at most: waiting for their feedback, or
    rewarded and waiting for a step. A request that would go past it is answered but not kept
    (``serve/unkept``; feedback naming it is refused) until a step, or
    :attr:`feedback_timeout_s`, frees room. Each holds its prompt and its tokens: clients that
    never send feedback, or traffic faster than the steps, would otherwise fill the worker's
    memory (and refusing the requests instead let one such client keep every other client out)."""

    @model_validator(mode="after")
    def _room_for_a_step(self):
        # a step waits for samples_per_step rewarded samples, and those are held within
        # max_waiting: with less room than that (and one request's 64) no step could ever fill
        if self.max_waiting < self.samples_per_step + 64:
            raise ValueError(f"serve.max_waiting ({self.max_waiting}) must be at least serve.samples_per_step + 64 "
                             f"({self.samples_per_step + 64}): a step waits for samples_per_step rewarded samples, "
                             "held within max_waiting (64: the most one request brings)")
        return self

    @model_validator(mode="after")
    def _key_off_loopback(self):
        if not is_loopback(self.host) and not self.api_key:
            raise ValueError(f"serve.host = {self.host!r} is not loopback: set serve.api_key too (clients then send "
                             "'Authorization: Bearer <key>')")
        return self
