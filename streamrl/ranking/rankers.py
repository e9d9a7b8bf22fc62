"""Length rankers (``[ranker] name = ...``): ``predict(prompts) -> [score]`` (higher = longer)
and ``observe(prompts, lengths)`` with each prompt's observed output lengths.

* ``history`` -- the mean log length seen for the same prompt text before; unseen prompts get
  the mean over everything seen (they rank in the middle).
* ``learned`` -- a small torch model trained online on (prompt, observed log length) pairs:
  hashed words and character n-grams of the prompt, embedded and averaged, plus a few numeric
  features (prompt length, the log of the largest number in it), then a linear head. It
  generalises to prompts it has never seen, which ``history`` cannot.
* ``oracle`` -- the workload's hidden expected length (the ``longtail-sim`` and ``countdown``
  tasks have one); an upper bound for benchmarks, not something a real run can have.

A ranker lives on one worker (a ``rank`` pool if the recipe has one, else the reward worker) as
a resident, so its state survives across steps; the controller sends it small lists only.
"""

from __future__ import annotations

import math
import random
import re
import zlib
from collections import defaultdict

from pydantic import BaseModel, ConfigDict, Field

from streamrl.api import Ranker


class HistoryRankerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class HistoryRanker(Ranker):
    """Per-prompt memory of output lengths."""

    def __init__(self, config: HistoryRankerConfig):
        self.config = config
        self.sums: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    def predict(self, prompts) -> list[float]:
        """Mean observed log length per prompt text; the global mean for unseen ones."""
        total, n = sum(self.sums.values()), sum(self.counts.values())
        default = total / n if n else 0.0
        return [self.sums[p.text] / self.counts[p.text] if self.counts.get(p.text) else default for p in prompts]

    def observe(self, prompts, lengths: list[list[int]]) -> None:
        """Remember the log lengths of each prompt's samples."""
        for p, ls in zip(prompts, lengths):
            for n in ls:
                self.sums[p.text] += math.log(max(n, 1))
                self.counts[p.text] += 1

    def state_dict(self) -> dict:
        """Every prompt's summed log lengths and counts."""
        return {"sums": dict(self.sums), "counts": dict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""
        self.sums = defaultdict(float, state["sums"])
        self.counts = defaultdict(int, state["counts"])


class LearnedRankerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    ngram: int = Field(3, ge=1, le=8)
    """Character n-gram size of the prompt features (all sizes 1..ngram are used)."""
    buckets: int = Field(1024, ge=16)
    """Hash buckets for the n-grams."""
    dim: int = Field(8, ge=1)
    """Embedding size."""
    lr: float = Field(0.1, gt=0)
    """Adam learning rate."""
    train_steps: int = Field(30, ge=0)
    """Gradient steps after every observation, on minibatches from the replay buffer."""
    batch_size: int = Field(64, ge=1)
    """Minibatch size."""
    buffer: int = Field(8192, ge=1)
    """Most recent (prompt, log length) pairs kept for training."""
    numeric: bool = True
    """Also feed the prompt's length and the log of the largest number in it: output length
    often scales with a quantity the prompt asks for ("count down from 57", "list 12 items"),
    which n-grams of its digits express poorly."""
    seed: int = 0
    """Seed of initialisation and minibatch sampling."""


NUMBER = re.compile(r"\d+")


def numeric_features(text: str) -> list[float]:
    """``[log(1 + characters), log(1 + largest number), 1 if there is a number]``."""
    numbers = [int(x) for x in NUMBER.findall(text)[:16] if len(x) < 16]
    return [math.log1p(len(text)), math.log1p(max(numbers, default=0)), float(bool(numbers))]


class LearnedRanker(Ranker):
    """Hashed n-gram bag -> embedding mean -> linear; regresses log output length (MSE)."""

    def __init__(self, config: LearnedRankerConfig):
        import torch

        self.config = c = config
        torch.manual_seed(c.seed)
        self.embed = torch.nn.EmbeddingBag(c.buckets, c.dim, mode="mean")
        self.head = torch.nn.Linear(c.dim + (3 if c.numeric else 0), 1)
        params = list(self.embed.parameters()) + list(self.head.parameters())
        self.opt = torch.optim.Adam(params, lr=c.lr)
        self.data: list[tuple[tuple, float]] = []  # ((hashed features, numeric), mean log length)
        self.rng = random.Random(c.seed)
        self.mean = 0.0  # running mean of the target: the head learns the deviation from it

    def features(self, text: str) -> tuple[list[int], list[float]]:
        """Hash buckets of the words of ``text`` and of every character n-gram (sizes 2..ngram),
        and the numeric features. Whole words carry most of the signal; n-grams let related
        words share it."""
        t = f"^{text}$"
        grams = [f"w:{w}" for w in text.split()]
        grams += [t[i:i + k] for k in range(2, self.config.ngram + 1) for i in range(len(t) - k + 1)]
        hashed = [zlib.crc32(g.encode()) % self.config.buckets for g in grams] or [0]
        return hashed, numeric_features(text)

    def _forward(self, feats: list[tuple]):
        import torch

        hashed = [h for h, _ in feats]
        flat = torch.tensor([f for fs in hashed for f in fs], dtype=torch.long)
        offsets = torch.tensor([0] + [len(fs) for fs in hashed[:-1]], dtype=torch.long).cumsum(0)
        x = self.embed(flat, offsets)
        if self.config.numeric:
            x = torch.cat([x, torch.tensor([n for _, n in feats], dtype=torch.float32)], dim=1)
        return self.head(x).squeeze(-1) + self.mean

    def predict(self, prompts) -> list[float]:
        """Predicted log output length per prompt."""
        import torch

        if not prompts:
            return []
        with torch.no_grad():
            return self._forward([self.features(p.text) for p in prompts]).tolist()

    def observe(self, prompts, lengths: list[list[int]]) -> None:
        """Add (prompt, mean log length) pairs to the buffer and take ``train_steps`` Adam steps."""
        import torch

        for p, ls in zip(prompts, lengths):
            if ls:
                self.data.append((self.features(p.text), sum(math.log(max(n, 1)) for n in ls) / len(ls)))
        self.data = self.data[-self.config.buffer:]
        if not self.data:
            return
        self.mean = sum(y for _, y in self.data) / len(self.data)
        for _ in range(self.config.train_steps):
            batch = [self.rng.choice(self.data) for _ in range(min(self.config.batch_size, len(self.data)))]
            pred = self._forward([f for f, _ in batch])
            loss = torch.nn.functional.mse_loss(pred, torch.tensor([y for _, y in batch]))
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()

    def state_dict(self) -> dict:
        """Weights, Adam's state, the replay buffer, the target's mean and the sampling RNG: a
        restored ranker predicts, and goes on learning, exactly as this one would."""
        return {"embed": self.embed.state_dict(), "head": self.head.state_dict(), "opt": self.opt.state_dict(),
                "data": list(self.data), "mean": self.mean, "rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (a ranker built with the same config)."""
        self.embed.load_state_dict(state["embed"])
        self.head.load_state_dict(state["head"])
        self.opt.load_state_dict(state["opt"])
        self.data = [((list(h), list(n)), y) for (h, n), y in state["data"]]
        self.mean = state["mean"]
        self.rng.setstate(state["rng"])


class OracleRankerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class OracleRanker(Ranker):
    """The workload's hidden expected log length (``prompt.answer["log_median"]``): benchmarks only."""

    def __init__(self, config: OracleRankerConfig):
        self.config = config

    def predict(self, prompts) -> list[float]:
        """The hidden truth, where the task has one."""
        try:
            return [float(p.answer["log_median"]) for p in prompts]
        except (TypeError, KeyError):
            raise ValueError("the oracle ranker needs a task whose prompts carry their expected "
                             "length (answer['log_median']), such as longtail-sim or countdown") from None

    def observe(self, prompts, lengths) -> None:
        """Nothing to learn."""
