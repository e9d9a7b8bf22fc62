"""Scoring a group with a reward, with failures contained (used by reward tasks and by the
reference loop)."""

from __future__ import annotations

import math
import time

from streamrl.api import Reward
from streamrl.sample import Group


def score_group(reward: Reward, group: Group) -> Group:
    """Score every sample in place. A reward that raises or gives no finite number is contained:
    reward 0, the sample flagged (``times["reward_error"]``, counted in ``reward_errors``) and
    the error appended to its text. Returns the group."""
    for s in group:
        try:
            value = float(reward.score(s.prompt, s.response_text))
            if not math.isfinite(value):
                raise ValueError(f"reward is {value}")
            s.reward = value
        except Exception as exc:  # one bad sample must not fail the step
            s.reward = 0.0
            s.times["reward_error"] = 1.0
            s.response_text += f"\n[reward error: {type(exc).__name__}: {exc}]"
        s.times["reward_end"] = time.time()
    return group
