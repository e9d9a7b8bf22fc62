"""W1 ``addition``: multi-digit addition with an exact-match answer (the learning demo).

Prompt ``"37+48="``, expected response ``"85"`` then EOS. Small enough for a 2-layer model to
learn on a laptop CPU in minutes, and verifiable, so the reward needs no model.
"""

from __future__ import annotations

import random

from pydantic import BaseModel, ConfigDict, Field

from streamrl.api import Task
from streamrl.sample import Prompt


class AdditionConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    digits: int = Field(2, ge=1, le=6)
    """Digits per operand (2 means operands 0..99)."""
    seed: int = 0
    """Seed of the prompt stream (combined with the step number, so a resumed run sees the same
    prompts)."""
    eval_size: int = Field(64, ge=0)
    """Held-out prompts for ``[eval]``: a fixed set drawn from a stream of their own."""


class AdditionTask(Task):
    """Hands out random ``a+b=`` prompts; the answer is the decimal sum."""

    alphabet = "0123456789+="

    def __init__(self, config: AdditionConfig):
        self.config = config

    def example(self, rng: random.Random) -> tuple[str, str]:
        """One (prompt text, answer text) pair."""
        hi = 10 ** self.config.digits - 1
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        return f"{a}+{b}=", str(a + b)

    def prompts(self, step: int, n: int) -> list[Prompt]:
        """The ``n`` prompts of ``step`` (deterministic in seed and step)."""
        rng = random.Random(self.config.seed * 1_000_003 + step)
        out = []
        for i in range(n):
            text, answer = self.example(rng)
            out.append(Prompt(uid=f"{step}-{i:03d}", text=text, answer=answer))
        return out

    def eval_prompts(self) -> list[Prompt]:
        """``eval_size`` fixed prompts (the same every call and every run with this seed)."""
        rng = random.Random(self.config.seed * 1_000_003 - 1)  # no step's stream starts here
        out = []
        for i in range(self.config.eval_size):
            text, answer = self.example(rng)
            out.append(Prompt(uid=f"eval-{i:03d}", text=text, answer=answer))
        return out

    def max_prompt_chars(self) -> int:
        """Longest prompt, in characters (sizes the model's context)."""
        return 2 * self.config.digits + 2
