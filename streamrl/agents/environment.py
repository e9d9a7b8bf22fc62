"""streamrl's rollout of a gym-style :class:`~streamrl.api.Environment`: reset, then one model
reply and one ``step`` per turn, through the same endpoint and client a user's rollout function
gets, so both shapes train the same way."""

from __future__ import annotations

import inspect
from typing import Any


async def _maybe(value):
    return await value if inspect.isawaitable(value) else value


async def environment_rollout(client, row: dict[str, Any], env_class, max_turns: int, max_tokens: int | None,
                              model: str = "policy") -> float:
    """Run one episode of ``env_class`` on ``row``; the sum of its step rewards. It ends at
    ``done``, after ``max_turns`` model replies, or when the conversation no longer fits the
    engine's prompt (``engine.max_prompt_tokens``)."""
    env = env_class()
    try:
        messages = list(await _maybe(env.reset(row)))
        total = 0.0
        for _ in range(max_turns):
            kwargs: dict[str, Any] = {"tools": env.tools} if env.tools else {}
            if max_tokens:
                kwargs["max_tokens"] = max_tokens
            try:
                reply = await client.chat.completions.create(model=model, messages=messages, **kwargs)
            except Exception as e:  # noqa: BLE001 -- only the context's end is the episode's end
                if getattr(e, "code", None) == "context_length_exceeded":
                    break  # (the conversation outgrew the engine's prompt: the episode ends there, as
                    # at max_turns, with the rewards it earned; its turns so far are the sample)
                raise
            message = reply.choices[0].message.model_dump(exclude_none=True)
            messages.append(message)
            new, reward, done = await _maybe(env.step(message))
            if isinstance(reward, (str, bytes, bytearray)):  # (float() reads "0.5": text is not a reward)
                raise TypeError(f"step() gave a reward of type {type(reward).__name__}; expected a number")
            total += float(reward)
            messages += list(new)
            if done:
                break
        return total
    finally:
        await _maybe(env.close())
