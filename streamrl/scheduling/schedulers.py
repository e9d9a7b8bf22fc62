"""Schedulers (``[scheduler] name = ...``): ``dispatch(prompts, scores, workers, ctx) -> [Assignment]``.

* ``fcfs`` -- the baseline: prompts go round-robin over the generate workers in the order the
  task gave them, all at the same priority (the engine admits them first come, first served).
* ``skew`` -- StreamRL's skewness-aware dispatch: the predicted top ``alpha`` of prompts are
  the long tail. Their length and the regular length are estimated from the observed lengths
  (``long_quantile`` and ``regular_quantile``, P99 and P80 by default). Using the engine's
  per-token latency model, it tries every split of the instances between long-tail and
  regular prompts and keeps the one with the smallest estimated makespan: long-tail prompts
  go to a few instances that run them at a small batch (memory-bound decoding is faster per
  token there), the rest share the others. Inside an instance, prompts are admitted
  longest-predicted first (LPT), so the longest start earliest.

``ctx`` (:class:`streamrl.api.DispatchContext`) carries what a scheduler may use: samples per prompt, the
observed output lengths so far, prompt lengths, and the engine's latency model.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from streamrl.api import Assignment, DispatchContext, Scheduler
from streamrl.scheduling.estimates import tied_means


def makespan(n_requests: int, length: float, prompt_tokens: float, step_latency) -> float:
    """Estimated seconds for one instance to decode ``n_requests`` concurrent requests of
    ``length`` tokens each: every decode step costs ``step_latency(total context)``."""
    if n_requests <= 0 or length <= 0:
        return 0.0
    # the context grows linearly, and step_latency is affine in it in the models we know, so
    # the mean step costs the latency at the mean context; a few points keep it honest otherwise
    points = 8
    total = 0.0
    for i in range(points):
        t = (i + 0.5) / points * length
        total += step_latency(n_requests * (prompt_tokens + t))
    return total / points * length


def best_split(n_long: int, n_regular: int, workers: int, long_len: float, regular_len: float,
               prompt_tokens: float, step_latency) -> tuple[int, float]:
    """The number of instances for long-tail requests minimising the estimated makespan.

    ``m = 0`` is no split: every instance gets its share of both kinds, decodes them together
    until the regular ones end, then finishes its long ones at a smaller batch. ``m > 0``: ``m``
    instances decode only long requests, the others only regular ones. Requests are spread
    evenly within each side. Returns ``(m, estimated makespan)``.
    """
    a, b = math.ceil(n_long / workers), math.ceil(n_regular / workers)
    mixed = makespan(a + b, min(regular_len, long_len), prompt_tokens, step_latency)
    mixed += makespan(a, max(long_len - regular_len, 0), prompt_tokens + regular_len, step_latency)
    best = (0, mixed)
    if workers < 2 or n_long == 0 or n_regular == 0:
        return best
    for m in range(1, workers):
        t = max(makespan(math.ceil(n_long / m), long_len, prompt_tokens, step_latency),
                makespan(math.ceil(n_regular / (workers - m)), regular_len, prompt_tokens, step_latency))
        if t < best[1]:
            best = (m, t)
    return best


class FCFSConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class FCFS(Scheduler):
    """Round-robin in task order, one priority for all."""

    def __init__(self, config: FCFSConfig):
        self.config = config

    def dispatch(self, prompts, scores, workers: list[str], ctx: DispatchContext) -> list[Assignment]:
        """Prompt ``i`` to worker ``i mod W``."""
        return [Assignment(i, workers[i % len(workers)]) for i in range(len(prompts))]


class SkewConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    alpha: float = Field(0.2, gt=0, lt=1)
    """Share of prompts (by predicted length) treated as long-tail."""
    long_quantile: float = Field(0.99, gt=0, lt=1)
    """Quantile of observed lengths used as the long-tail length estimate: the longest request
    sets a long-tail instance's makespan, so near the top (P99)."""
    regular_quantile: float = Field(0.8, gt=0, lt=1)
    """Quantile of observed lengths used as the regular length estimate: the longest regular
    request, about the ``1 - alpha`` quantile."""
    min_observed: int = Field(32, ge=1)
    """Observed samples needed before splitting; until then prompts are spread LPT-balanced."""
    lpt: bool = True
    """Admit longest-predicted first inside each instance."""
    split: bool = True
    """Try a long-tail/regular split of the instances; false: only balance predicted work."""


def rank_lengths(n: int, observed: list[int], ranked_scores: list[float] | None = None) -> list[float]:
    """Length estimates for the prompts ranked 0 (longest predicted) .. n-1: the observed
    length quantile at each rank (scale-free: scores only need to order prompts). Equal
    estimates when nothing was observed yet; prompts whose scores tie (``ranked_scores``, in
    rank order) share the mean of their ranks' estimates -- their order among themselves is
    their place in the list, which says nothing of their lengths."""
    if not observed:
        return [1.0] * n
    return tied_means([quantile(observed, 1 - (r + 0.5) / n) for r in range(n)], ranked_scores)


def balance(order: list[int], est: list[float], workers: list[str], prio: dict[int, float]) -> list[Assignment]:
    """Greedy LPT bin packing: longest predicted first, each to the instance with the least
    predicted work so far. ``est[r]`` is the estimate of the prompt ranked ``r``."""
    load = {w: 0.0 for w in workers}
    out = []
    for r, i in enumerate(order):
        w = min(workers, key=lambda x: (load[x], workers.index(x)))
        load[w] += est[r]
        out.append(Assignment(i, w, prio[i]))
    return sorted(out, key=lambda a: a.index)


def quantile(values: list[int], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank)."""
    s = sorted(values)
    return float(s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))])


def has_tail(observed: list[int], ratio: float, min_observed: int) -> bool:
    """Whether the output lengths seen so far have a long tail worth placing by length: their
    P99 more than ``ratio`` times their median. With fewer than ``min_observed`` seen, assume
    one (the first steps of a run do not know yet)."""
    if len(observed) < min_observed:
        return True
    return quantile(observed, 0.99) > ratio * quantile(observed, 0.5)


class Skew(Scheduler):
    """StreamRL's skewness-aware dispatching and LPT ordering."""

    def __init__(self, config: SkewConfig):
        self.config = config
        self.last_split: int = 0
        """Instances given to long-tail prompts at the last dispatch (0: no split)."""

    def metrics(self) -> dict[str, float]:
        """``long_tail_instances``: instances the last dispatch gave to long-tail prompts."""
        return {"long_tail_instances": self.last_split}

    def dispatch(self, prompts, scores, workers: list[str], ctx: DispatchContext) -> list[Assignment]:
        """Split instances between long-tail and regular prompts; LPT inside each."""
        c = self.config
        order = sorted(range(len(prompts)), key=lambda i: (-scores[i], i))  # longest predicted first
        prio = {i: (len(order) - r if c.lpt else 0.0) for r, i in enumerate(order)}
        n_long = max(1, round(c.alpha * len(prompts)))
        long_idx, regular_idx = order[:n_long], order[n_long:]
        m = 0
        if len(workers) > 1 and len(ctx.observed_lengths) >= c.min_observed and ctx.step_latency:
            n = ctx.samples_per_prompt
            m, _ = best_split(n_long * n, len(regular_idx) * n, len(workers),
                              quantile(ctx.observed_lengths, c.long_quantile),
                              quantile(ctx.observed_lengths, c.regular_quantile), ctx.prompt_tokens,
                              ctx.step_latency)
        # (scores tied across the long-tail boundary: nothing tells which of them are long, and
        # their order is only their place in the list)
        straddles = 0 < n_long < len(order) and scores[order[n_long - 1]] == scores[order[n_long]]
        if not c.split or straddles:
            m = 0
        self.last_split = m
        if m == 0:  # no split: balance the predicted work over all instances
            est = rank_lengths(len(order), ctx.observed_lengths, [scores[i] for i in order])
            return balance(order, est, workers, prio)
        long_w, regular_w = workers[:m], workers[m:]
        out = [Assignment(i, long_w[r % m], prio[i]) for r, i in enumerate(long_idx)]
        out += [Assignment(i, regular_w[r % len(regular_w)], prio[i]) for r, i in enumerate(regular_idx)]
        return sorted(out, key=lambda a: a.index)


__all__ = ["Assignment", "DispatchContext", "FCFS", "FCFSConfig", "Skew", "SkewConfig", "best_split", "has_tail",
           "makespan"]
