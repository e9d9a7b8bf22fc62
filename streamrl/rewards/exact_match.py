"""``exact_match``: 1.0 when the response equals the prompt's expected answer, else 0.0."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from streamrl.api import Reward
from streamrl.sample import Prompt


class ExactMatchConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    strip: bool = True
    """Ignore leading and trailing whitespace in the response."""


class ExactMatch(Reward):
    """Verifiable reward: compares the decoded response with ``prompt.answer``."""

    def __init__(self, config: ExactMatchConfig):
        self.config = config

    def score(self, prompt: Prompt, response: str) -> float:
        """1.0 for an exact answer, 0.0 otherwise (and for a prompt without an answer: a reply
        "None" must not match a missing one)."""
        if prompt.answer is None:
            return 0.0
        text = response.strip() if self.config.strip else response
        return 1.0 if text == str(prompt.answer) else 0.0
