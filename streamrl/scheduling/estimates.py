"""Output lengths learned from a prompt group's own samples, online.

The samples of one prompt group share most of their length: a prompt that asks for a long
answer gets long answers. So once some of a group's samples have finished, their lengths say
more about the others than any reading of the prompt's text can (Seer, arXiv 2511.14617,
schedules on exactly this). :class:`GroupLengths` keeps, per group in flight, a belief about
the group's mean log length and answers "how long will this running sample be in all?":

* **before anything finished**, the prior: a prompt-text ranker's score when the run has one
  (mapped onto the observed lengths by rank, :func:`prior_from_scores`), else the run's typical
  length;
* **as samples finish**, the prior and the finished lengths combine as in a normal model of log
  lengths (group mean ~ N(prior, tau^2), sample ~ N(group mean, sigma^2)); the siblings still
  running are *censored* observations (each is at least as long as what it has generated so
  far), which corrects the bias of the first finished samples being the short ones;
* **for a running sample**, the expected total length given that it is already longer than the
  tokens it has generated (a log-normal cut below at that point), so a sample that runs on
  keeps raising its own estimate even in a group that told little.

``tau`` and ``sigma`` are learned from the run's finished groups (:meth:`GroupLengths.learn`):
how far groups land from their prior, and how far samples spread inside a group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

SQRT2 = math.sqrt(2.0)


def norm_sf(z: float) -> float:
    """P(Z > z) for a standard normal Z."""
    return 0.5 * math.erfc(z / SQRT2)


def tail_mean(mu: float, sigma: float, at_least: float) -> float:
    """``E[L | L >= at_least]`` for ``log L ~ N(mu, sigma^2)``: the expected total length of a
    sample known to be at least ``at_least`` tokens long (``at_least <= 0``: the plain mean)."""
    full = math.exp(mu + sigma * sigma / 2)
    if at_least <= 0 or sigma <= 0:
        return max(full, at_least)
    z = (math.log(at_least) - mu) / sigma
    below = norm_sf(z)
    if below < 1e-12:  # far beyond what the belief expected: the length grows with the evidence
        return at_least * (1.0 + sigma * sigma / max(z * sigma, 1e-6))
    return max(full * norm_sf(z - sigma) / below, at_least)


def truncated_log_mean(mu: float, sigma: float, at_least: float) -> float:
    """``E[log L | L >= at_least]`` for ``log L ~ N(mu, sigma^2)`` (the inverse Mills ratio)."""
    if at_least <= 0 or sigma <= 0:
        return max(mu, math.log(max(at_least, 1.0)))
    z = (math.log(at_least) - mu) / sigma
    sf = norm_sf(z)
    if sf < 1e-12:
        return math.log(at_least) + sigma / max(z, 1e-6)
    pdf = math.exp(-z * z / 2) / math.sqrt(2 * math.pi)
    return mu + sigma * pdf / sf


class LengthEstimateConfig(BaseModel):
    """How a group's length belief starts and how much its own samples move it."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    sigma: float = Field(0.5, gt=0)
    """Starting spread of log lengths inside a group (learned from finished groups once there
    are some): small means one finished sample pins its siblings' lengths down."""
    tau: float = Field(0.8, gt=0)
    """Starting spread of a group's mean log length around its prior (learned the same way):
    large means the prompt's text says little and the group's own samples decide."""
    censored: bool = True
    """Count the siblings still running as at least as long as they are so far; without it the
    first finished samples (the short ones) pull the estimate down."""


@dataclass
class GroupBelief:
    """What is known of one prompt group in flight."""

    prior: float
    """Log length the group is expected to have before any of its samples finished."""
    finished: list[int] = field(default_factory=list)
    """Lengths of its finished samples."""
    first_estimate: float | None = None
    """Its estimated mean log length when its first sample finished (for recall)."""
    informed: bool = True
    """Whether the prior came from lengths seen in the run; a group started before any was
    seen has a placeholder prior, and how far it lands from it teaches nothing about ``tau``."""


class GroupLengths:
    """Online length estimates of the groups in flight (see the module's docstring)."""

    def __init__(self, config: LengthEstimateConfig | None = None):
        self.config = config or LengthEstimateConfig()
        self.sigma = self.config.sigma
        self.tau = self.config.tau
        self.groups: dict[str, GroupBelief] = {}
        self._within: list[float] = []  # squared deviations of samples from their group's mean log
        self._between: list[float] = []  # squared deviations of groups' mean logs from their prior

    def start(self, group: str, prior_log: float, informed: bool = True) -> None:
        """A group enters with its prior log length (``informed``: see :class:`GroupBelief`)."""
        self.groups[group] = GroupBelief(prior_log, informed=informed)

    def mean_log(self, group: str, running: list[int] = ()) -> float:
        """The group's estimated mean log length: the prior and its finished samples combined,
        with ``running`` (tokens generated so far by each sibling still running) as censored
        observations when ``censored`` is on."""
        g = self.groups[group]
        w0, ws = 1 / (self.tau * self.tau), 1 / (self.sigma * self.sigma)
        logs = [math.log(max(n, 1)) for n in g.finished]
        mu = (g.prior * w0 + sum(logs) * ws) / (w0 + ws * len(logs))
        if not (self.config.censored and running and g.finished):
            return mu
        # censored siblings: two fixed-point rounds, each imputing E[log L | L >= so far]
        for _ in range(2):
            imputed = [truncated_log_mean(mu, self.sigma, t) for t in running]
            mu = (g.prior * w0 + (sum(logs) + sum(imputed)) * ws) / (w0 + ws * (len(logs) + len(imputed)))
        return mu

    def estimate(self, group: str, generated: int = 0, running: list[int] = ()) -> float:
        """Expected total length (tokens) of one of ``group``'s samples that has generated
        ``generated`` tokens so far (0: not started); ``running``: the tokens so far of its
        siblings still running."""
        g = self.groups[group]
        mu = self.mean_log(group, running)
        # a group with samples of its own knows its mean to within sigma / sqrt(k); without,
        # the prior's error adds to a sample's own spread
        k = len(g.finished)
        var = self.sigma ** 2 + (1.0 / (1 / self.tau ** 2 + k / self.sigma ** 2))
        return tail_mean(mu, math.sqrt(var), generated)

    def finish(self, group: str, length: int, running: list[int] = ()) -> None:
        """One of the group's samples finished at ``length`` tokens."""
        g = self.groups[group]
        g.finished.append(length)
        if g.first_estimate is None:
            g.first_estimate = self.mean_log(group, running)

    def close(self, group: str) -> GroupBelief:
        """The group is done: learn ``sigma`` and ``tau`` from it; returns its record."""
        g = self.groups.pop(group)
        if g.finished:
            logs = [math.log(max(n, 1)) for n in g.finished]
            m = sum(logs) / len(logs)
            self._within += [(x - m) ** 2 for x in logs][:]
            if g.informed:
                self._between.append((m - g.prior) ** 2)
            self.learn()
        return g

    def state_dict(self) -> dict:
        """The spreads learned so far and what they were learned from (a checkpoint's)."""
        return {"sigma": self.sigma, "tau": self.tau, "within": list(self._within), "between": list(self._between)}

    def load_state_dict(self, state: dict) -> None:
        """Take back :meth:`state_dict`'s spreads (a resumed run's estimates go on from them)."""
        self.sigma, self.tau = float(state["sigma"]), float(state["tau"])
        self._within = [float(x) for x in state["within"]]
        self._between = [float(x) for x in state["between"]]

    def learn(self) -> None:
        """Refit ``sigma`` (spread inside groups) and ``tau`` (groups around their prior) from the
        groups closed so far, once there are enough of them (most recent 4096 each)."""
        self._within, self._between = self._within[-4096:], self._between[-4096:]
        if len(self._within) >= 32:
            self.sigma = max(math.sqrt(sum(self._within) / len(self._within)), 0.05)
        if len(self._between) >= 16:
            self.tau = max(math.sqrt(sum(self._between) / len(self._between)), 0.05)


def tied_means(by_rank: list[float], ranked_scores: list[float] | None) -> list[float]:
    """``by_rank`` with each run of equal ``ranked_scores`` (both in rank order) given the run's mean."""
    if ranked_scores is None:
        return by_rank
    out, start = list(by_rank), 0
    for r in range(1, len(by_rank) + 1):
        if r == len(by_rank) or ranked_scores[r] != ranked_scores[start]:
            mean = sum(by_rank[start:r]) / (r - start)
            out[start:r] = [mean] * (r - start)
            start = r
    return out


def prior_from_scores(scores: list[float], observed: list[int]) -> list[float]:
    """Prior log lengths for prompts from a ranker's ``scores`` (higher = longer; any scale):
    the prompt ranked ``r`` of ``n`` gets the log of the observed length quantile at that rank,
    so scores only need to order prompts. Equal scores (no ranker) give every prompt the mean
    observed log length; without observed lengths every prior is 0."""
    n = len(scores)
    if not observed or n == 0:
        return [0.0] * n
    if len(set(scores)) == 1:  # no ranking: every prompt is the typical one
        return [sum(math.log(max(x, 1)) for x in observed) / len(observed)] * n
    s = sorted(observed)
    order = sorted(range(n), key=lambda i: (-scores[i], i))
    by_rank = [math.log(max(s[min(len(s) - 1, max(0, math.ceil((1 - (r + 0.5) / n) * len(s)) - 1))], 1))
               for r in range(n)]
    # (tied scores share their ranks' mean: their order among themselves is only their place in the list)
    by_rank = tied_means(by_rank, [scores[i] for i in order])
    out = [0.0] * n
    for r, i in enumerate(order):
        out[i] = by_rank[r]
    return out


__all__ = ["GroupBelief", "GroupLengths", "LengthEstimateConfig", "prior_from_scores", "tail_mean"]
