"""``digit_match``: a denser reward than exact match for arithmetic answers.

Compares the response with the expected answer right-aligned (units under units), and gives
the share of places that agree; a response of the wrong length loses ``length_penalty``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from streamrl.api import Reward


class DigitMatchConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    length_penalty: float = Field(0.5, ge=0, le=1)
    """Subtracted when the response has a different number of characters than the answer."""


class DigitMatch(Reward):
    """Partial credit per digit; 1.0 only for the exact answer."""

    def __init__(self, config: DigitMatchConfig):
        self.config = config

    def score(self, prompt, response: str) -> float:
        """Share of right-aligned places where response and answer agree, minus the penalty."""
        want, got = str(prompt.answer), response.strip()
        width = max(len(want), len(got), 1)
        same = sum(a == b for a, b in zip(want.rjust(width), got.rjust(width)))
        score = same / width
        if len(got) != len(want):
            score -= self.config.length_penalty
        return max(score, 0.0)
