"""W3 ``longtail-sim``: prompts whose output length is a hidden property of the prompt.

Each prompt of a fixed dataset gets a difficulty drawn once: the median of its own log-normal
length distribution. Samples of that prompt vary around it. Together the lengths follow the
capped log-normal of W3 (median 4 000, P90 ~11 000, cap 20 480: an R1-like long tail), and a
ranker that remembers or learns prompts has something to predict. A trace file (one observed
length per line) may replace the log-normal: each prompt's median is then a draw from the trace.

The ``sim_length`` reward is a stand-in with variance inside a group (1 when a sample is no
longer than its prompt's median), so GRPO-shaped training has something to do. Simulated.
"""

from __future__ import annotations

import math
import random
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from streamrl.api import Reward, Task
from streamrl.sample import Prompt

Z90 = 1.2815515655446004  # standard normal 90th percentile
#: Words a prompt's text uses for its (noisy) difficulty: what a learned ranker can pick up,
#: the way real prompts give away how long their answers run.
LEVELS = ["trivial", "basic", "easy", "simple", "light", "plain", "modest", "medium", "solid", "tricky",
          "involved", "hard", "tough", "gnarly", "brutal", "fiendish", "monstrous"]


#: A trace file larger than this is refused before it is read (a user's file: a wrong path to
#: gigabytes would be read whole, twice).
MAX_TRACE_BYTES = 64 * 1024 * 1024


def read_trace(path: Path) -> list[float]:
    """The output lengths of trace file ``path``, one per line; ValueError naming the file and
    the first line that is not a length (a number > 0: its log is a prompt's median), or an empty file."""
    size = path.stat().st_size
    if size > MAX_TRACE_BYTES:
        raise ValueError(f"trace file {path} has {size} bytes; at most {MAX_TRACE_BYTES} are read")
    out = []
    for k, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = float(line)
        except ValueError:
            value = float("nan")
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"trace file {path}: line {k} ({line.strip()[:40]!r}) is not an output length "
                             "(a number > 0)")
        out.append(value)
    if not out:
        raise ValueError(f"trace file {path} holds no output lengths (one per line)")
    return out


class LongTailSimConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)
    median: float = Field(4000, gt=0)
    """Median output length, tokens."""
    p90: float = Field(11000, gt=0)
    """90th percentile output length, tokens (sets the log-normal's spread)."""
    cap: int = Field(20480, ge=1)
    """Longest output (max_new_tokens)."""
    min_len: int = Field(16, ge=1)
    """Shortest output."""
    prompt_share: float = Field(0.8, ge=0, le=1)
    """Share of the log-length variance that belongs to the prompt (the predictable part)."""
    prompt_tokens_min: int = Field(200, ge=1)
    """Shortest prompt, tokens."""
    prompt_tokens_max: int = Field(1000, ge=1)
    """Longest prompt, tokens."""
    dataset_size: int = Field(4096, ge=1)
    """Prompts in the dataset; steps walk through it in a seeded shuffled order, epoch after epoch."""
    trace: str = ""
    """Optional file of observed output lengths, one per line; prompt medians are drawn from it."""
    seed: int = 0
    """Seed of the dataset and the prompt order."""
    text_noise: float = Field(0.25, ge=0)
    """Noise (in units of the prompt spread) on the difficulty word in a prompt's text; the text
    is how a learned ranker sees a prompt."""
    length_phases: list[tuple[int, float]] = []
    """``[[step, scale], ...]``: from ``step`` on, every output length is ``scale`` times longer
    (before the cap), as when a policy learns to reason longer mid-run. Empty: one phase."""

    @model_validator(mode="after")
    def _ordered(self):
        if self.p90 < self.median:
            raise ValueError(f"p90 ({self.p90}) must be >= median ({self.median})")
        if self.prompt_tokens_max < self.prompt_tokens_min:
            raise ValueError("prompt_tokens_max must be >= prompt_tokens_min")
        if any(scale <= 0 for _, scale in self.length_phases):
            raise ValueError("length_phases: every scale must be > 0")
        if self.min_len > self.cap:
            raise ValueError(f"min_len ({self.min_len}) must be <= cap ({self.cap})")
        if self.trace and not Path(self.trace).is_file():
            raise ValueError(f"trace file {self.trace} not found")
        if self.trace:
            read_trace(Path(self.trace))
        return self


class LongTailSimTask(Task):
    """The W3 prompt source. ``Prompt.answer`` carries the hidden length model for the sim engine."""

    def __init__(self, config: LongTailSimConfig):
        self.config = c = config
        sigma = math.log(c.p90 / c.median) / Z90
        self.sigma_prompt = sigma * math.sqrt(c.prompt_share)
        self.sigma_sample = sigma * math.sqrt(1 - c.prompt_share)
        rng = random.Random(c.seed)
        trace = read_trace(Path(c.trace)) if c.trace else None
        self._orders: dict[int, list[int]] = {}  # epoch -> the dataset's order in it
        self.dataset = []
        for i in range(c.dataset_size):
            mu = math.log(rng.choice(trace)) if trace else rng.gauss(math.log(c.median), self.sigma_prompt)
            tokens = rng.randint(c.prompt_tokens_min, c.prompt_tokens_max)
            z = (mu - math.log(c.median)) / max(self.sigma_prompt, 1e-9) + rng.gauss(0, c.text_noise)
            level = LEVELS[min(len(LEVELS) - 1, max(0, round(z * 3) + len(LEVELS) // 2))]
            text = f"q{i} {rng.choice(['algebra', 'geometry', 'counting', 'proof', 'code'])} {level}"
            self.dataset.append((i, mu, tokens, text))

    def _order(self, epoch: int) -> list[int]:
        # the dataset's order in ``epoch``, shuffled once (shuffled again for every prompt, it
        # was most of the controller's time a step); the latest two epochs kept (a step may span two)
        cache = self._orders
        if epoch not in cache:
            order = list(range(len(self.dataset)))
            random.Random(self.config.seed * 7919 + epoch).shuffle(order)
            cache[epoch] = order
            for old in sorted(cache)[:-2]:
                del cache[old]
        return cache[epoch]

    def scale(self, step: int) -> float:
        """The length scale of ``step`` (``length_phases``)."""
        out = 1.0
        for start, scale in sorted(self.config.length_phases):
            if step >= start:
                out = scale
        return out

    def prompts(self, step: int, n: int) -> list[Prompt]:
        """The ``n`` prompts of ``step``: the next slice of a seeded shuffle of the dataset."""
        c, size = self.config, len(self.dataset)
        out = []
        for j in range(step * n, step * n + n):
            epoch, pos = divmod(j, size)
            i, mu, tokens, text = self.dataset[self._order(epoch)[pos]]
            out.append(Prompt(uid=f"{step}-{j - step * n:03d}", text=text, answer={
                "prompt_id": i, "prompt_tokens": tokens, "log_median": mu + math.log(self.scale(step)),
                "sigma": self.sigma_sample,
                "min_len": c.min_len, "cap": c.cap}))
        return out


def sample_length(prompt: Prompt, rng: random.Random) -> int:
    """Draw one output length for ``prompt`` from its hidden distribution."""
    a = prompt.answer
    return int(min(a["cap"], max(a["min_len"], round(math.exp(rng.gauss(a["log_median"], a["sigma"]))))))


class SimLengthConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class SimLengthReward(Reward):
    """1.0 when the simulated response is no longer than its prompt's median length."""

    def __init__(self, config: SimLengthConfig):
        self.config = config

    def score(self, prompt: Prompt, response: str) -> float:
        """Reads the length the sim engine wrote into the response text."""
        m = re.search(r"\[simulated: (\d+) tokens\]", response)
        if m is None:
            raise ValueError("sim_length scores only responses of the sim engine")
        return 1.0 if int(m.group(1)) <= math.exp(prompt.answer["log_median"]) else 0.0
