"""Agents: the ``tool_parser`` contract and the gym-style :class:`Environment`.

Plugins and users' agent files import these from ``streamrl.api``."""

from __future__ import annotations

from typing import Any


class ToolParser:
    """Turns the text of a model's reply into OpenAI's ``tool_calls`` (runs on the generate worker
    that serves the endpoint, once per reply of a request that offered ``tools``).

    A model writes a tool call in the format its chat template taught it; the endpoint hands
    agent code OpenAI's structured form, so the code runs unchanged against any model. Register
    a parser for another format with ``register_tool_parsers`` and name it in ``[serve]
    tool_parser``."""

    start: str | tuple[str, ...] = ""
    """The text that opens a tool call in the model's output (``"<tool_call>"``), or several: a
    streamed reply sends its text as content up to the first of them and holds the rest back
    for :meth:`parse`, as OpenAI's API never streams call markup as content. Empty: the text
    streams as written."""

    call_start: str | tuple[str, ...] | None = None
    """The text that opens a tool call itself, where :attr:`start` also holds others (Qwen3's
    ``<think>`` opens its reasoning); None: :attr:`start`. Where it is one token of the model, a
    reply calls a tool only if it generated that token (the same characters spelled out, as a
    user's text may ask the model to copy, are content)."""

    keep_tokens: tuple[str, ...] = ()
    """Special tokens the format writes its calls with (Mistral's ``[TOOL_CALLS]``): a reply's
    text keeps them for :meth:`parse`, where every other special token is dropped from it."""

    def parse(self, text: str) -> tuple[str | None, list[dict[str, str]]]:
        """``(content, calls)``: the reply's text outside its tool calls (None when nothing is
        left) and each call as ``{"name": ..., "arguments": <JSON text>}``, in order (with an
        ``"id"`` where the format needs ids of its own; else the endpoint makes one). Text that
        looks like a call but does not parse stays in the content (the agent sees what the model
        wrote)."""
        return text, []

    def close(self) -> None:
        """Release what the parser holds (nothing, by default)."""


class Environment:
    """A gym-style environment, for users who prefer SkyRL's or TRL's shape to writing the
    rollout loop themselves (``[task] name = "agent"``, ``environment = "MyEnv"``).

    streamrl's rollout builds one environment per rollout, calls :meth:`reset`, then asks the
    model for a reply to the conversation so far and hands it to :meth:`step`, until ``done`` or
    ``task.max_turns`` replies; the rewards :meth:`step` returns are summed. :meth:`close` runs
    however the rollout ends. Methods may be plain or ``async``."""

    tools: list[dict[str, Any]] = []
    """Tools offered to the model on every call, in OpenAI's format (``{"type": "function",
    "function": {"name", "description", "parameters"}}``); empty: none."""

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """Start a rollout on dataset row ``row``: the conversation's first messages."""
        raise NotImplementedError

    def step(self, message: dict[str, Any]) -> tuple[list[dict[str, Any]], float, bool]:
        """The model replied ``message`` (OpenAI's assistant message as a dict: ``content``,
        ``tool_calls``): the messages that follow it (tool results, a user turn), the reward of
        this step, and whether the rollout is over."""
        raise NotImplementedError

    def close(self) -> None:
        """The rollout ended (also after a timeout or an error)."""
