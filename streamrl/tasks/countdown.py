"""W2 ``longtail-cpu``: count down from a number in the prompt -- output length set by the prompt.

Prompt ``"12:"``, expected response ``"12 11 10 9 8 7 6 5 4 3 2 1"`` then EOS. The start number is
drawn per prompt from a capped log-normal, so response lengths (in characters = tokens of the
char tokenizer) have a heavy tail: median ~24, up to 254 with the default cap of 88. Three things
make it the workload for the length ranker and the skew scheduler on a real engine:

* the length is a property of the prompt (a ranker can learn it; ``answer["log_median"]`` holds
  the truth for the ``oracle`` ranker in benchmarks);
* each step is local (copy the number, then decrement), so a 2-layer model learns it in a short
  warm start, and the length of what it generates follows the prompt;
* the reward is verifiable: ``countdown`` gives 1.0 for the exact sequence, partial credit for a
  correct prefix.
"""

from __future__ import annotations

import math
import random

from pydantic import BaseModel, ConfigDict, Field

from streamrl.api import Reward, Task
from streamrl.sample import Prompt


def countdown(n: int) -> str:
    """``"n n-1 ... 1"``."""
    return " ".join(str(k) for k in range(n, 0, -1))


class CountdownConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    median: float = Field(11.5, gt=1)
    """Median start number (11.5 gives a median response of ~24 characters)."""
    sigma: float = Field(0.7, gt=0)
    """Log-normal shape of the start number: larger means a heavier tail."""
    low: int = Field(3, ge=1)
    """Smallest start number (3 -> ``"3 2 1"``, 5 characters)."""
    high: int = Field(88, ge=1)
    """Largest start number (88 -> 254 characters); sizes the engine's ``max_new_tokens``."""
    seed: int = 0
    """Seed of the prompt stream (combined with the step number, so a resumed run sees the same
    prompts)."""


class CountdownTask(Task):
    """Hands out ``"n:"`` prompts; the answer is the countdown from ``n`` to 1."""

    alphabet = "0123456789 :"

    def __init__(self, config: CountdownConfig):
        if config.high < config.low:
            raise ValueError(f"high ({config.high}) must be at least low ({config.low})")
        self.config = config

    def start(self, rng: random.Random) -> int:
        """One start number from the capped log-normal."""
        c = self.config
        return min(c.high, max(c.low, round(rng.lognormvariate(math.log(c.median), c.sigma))))

    def example(self, rng: random.Random) -> tuple[str, str]:
        """One (prompt text, answer text) pair (the warm start trains on these)."""
        n = self.start(rng)
        return f"{n}:", countdown(n)

    def prompts(self, step: int, n: int) -> list[Prompt]:
        """The ``n`` prompts of ``step`` (deterministic in seed and step)."""
        rng = random.Random(self.config.seed * 1_000_003 + step)
        out = []
        for i in range(n):
            text, target = self.example(rng)
            out.append(Prompt(uid=f"{step}-{i:03d}", text=text,
                              answer={"target": target, "log_median": math.log(len(target))}))
        return out

    def max_prompt_chars(self) -> int:
        """Longest prompt, in characters."""
        return len(str(self.config.high)) + 1

    def max_response_chars(self) -> int:
        """Longest correct response, in characters (sizes the model's context)."""
        return len(countdown(self.config.high))


class CountdownRewardConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    prefix_credit: float = Field(0.5, ge=0, le=1)
    """Most credit for a response that is not exact: this times the share of the expected
    numbers it gets right before its first mistake (0 makes the reward exact-match only)."""


class CountdownReward(Reward):
    """Verifiable reward for ``countdown``: 1.0 exact, else partial credit for a correct prefix."""

    def __init__(self, config: CountdownRewardConfig):
        self.config = config

    def stop_early(self, prompt: Prompt, text: str) -> bool:
        """Stop at the first wrong number: the score counts the numbers before it, and nothing
        after it can change the score (a complete number is one followed by a space)."""
        want = prompt.answer["target"].split()
        done = text.split()[:-1] if text and not text[-1].isspace() else text.split()
        return any(w != g for w, g in zip(want, done)) or len(done) > len(want)

    def score(self, prompt: Prompt, response: str) -> float:
        """Compare the response with ``prompt.answer["target"]`` number by number."""
        target = prompt.answer["target"]
        if response.strip() == target:
            return 1.0
        want, got = target.split(), response.split()
        right = 0
        for w, g in zip(want, got):
            if w != g:
                break
            right += 1
        return self.config.prefix_credit * right / len(want)
