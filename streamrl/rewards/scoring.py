"""Scoring a group with a reward, with failures contained (used by reward tasks and by the
reference loop)."""

from __future__ import annotations

import math
import time
from typing import Any

from streamrl.api import Reward
from streamrl.sample import Group


def reward_value(value: Any) -> tuple[float, dict[str, float]]:
    """The score and the named values of what a reward gave for one response: a number, or a
    dict with ``"score"`` and other named values (those that are not numbers are left out, as
    verl's dicts carry strings such as the extracted answer). Raises on anything else, or on a
    score that is not a finite number."""
    info: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"a dict without 'score' (keys: {', '.join(map(str, value)) or 'none'})")
        for key, extra in value.items():
            if key == "score" or isinstance(extra, (str, bytes)):
                continue
            try:
                number = float(extra)
            except (TypeError, ValueError):
                continue
            if math.isfinite(number):
                info[str(key)] = number
        value = value["score"]
    if value is None:
        raise TypeError("got None; expected a number or a dict with 'score'")
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"reward is {score}")
    return score, info


def score_group(reward: Reward, group: Group) -> Group:
    """Score every sample in place, with one :meth:`Reward.score_group` call. A reward that
    raises or gives no finite number for a sample is contained: reward 0, the sample flagged
    (``times["reward_error"]``, counted in ``reward_errors``), the error kept in
    ``Sample.reward_error`` and appended to its text. Returns the group."""
    prompts, responses = [s.prompt for s in group], [s.response_text for s in group]
    try:
        values = list(reward.score_group(prompts, responses))
        if len(values) != len(group):
            raise ValueError(f"score_group gave {len(values)} scores for {len(group)} responses")
    except Exception:  # (the batch as a whole failed) each response alone, so one bad one fails alone
        values = []
        for prompt, response in zip(prompts, responses):
            try:
                values.append(reward.score(prompt, response))
            except Exception as exc:
                values.append(exc)
    end = time.time()
    for s, value in zip(group, values):
        try:
            if isinstance(value, Exception):
                raise value
            s.reward, s.reward_info = reward_value(value)
        except Exception as exc:  # one bad sample must not fail the step
            s.reward, s.reward_info = 0.0, {}
            s.times["reward_error"] = 1.0
            s.reward_error = f"{type(exc).__name__}: {exc}"[:500]  # (the step's first goes into its record)
            s.response_text += f"\n[reward error: {s.reward_error}]"
        s.times["reward_end"] = end
    return group
