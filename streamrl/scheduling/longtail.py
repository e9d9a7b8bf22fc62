"""Longest first everywhere, groups in chunks, stragglers moved: a rollout policy that acts on
lengths learned from a group's own samples (:mod:`streamrl.scheduling.estimates`).

It decides three things, as pure policy over what it is told (no clock, no engine):

* **placement** (:meth:`LongTailPolicy.place`): each prompt group is cut into chunks of
  ``chunk`` samples; chunks are taken longest-estimated first and each goes to the instance
  with the least estimated work so far, so one group's long samples can land on different
  instances instead of crowding one (and where the run's lengths have no long tail, whole
  groups go round-robin, as ``fcfs`` places them, without asking the ranker);
* **admission order**: every chunk carries its estimated length as its priority, so inside an
  instance the longest start first;
* **stragglers** (:meth:`LongTailPolicy.moves`): a running sample far past its group's estimate,
  on an instance that will finish well after another, is moved to the instance that finishes
  first (re-prefilled there from the tokens it has; they keep their policy versions). An
  instance's finish is estimated from what runs on it: the decode-step overhead times its
  longest remaining sample, plus the per-context-token cost of every remaining token.

Estimates come from :class:`~streamrl.scheduling.estimates.GroupLengths`: the ranker's prior,
updated by each group's finished samples (``online``) and each sample's own progress.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field

from streamrl.api import Assignment, DispatchContext, Scheduler
from streamrl.scheduling.estimates import GroupLengths, LengthEstimateConfig, prior_from_scores
from streamrl.scheduling.schedulers import has_tail


class LongTailConfig(BaseModel):
    """Options of the long-tail rollout policy (``[scheduler]`` options of ``longtail``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    chunk: int = Field(4, ge=0)
    """Samples per chunk of a group (0: the whole group is one chunk, on one instance). Small
    chunks let one long group's samples spread over several instances; each chunk is a generate
    task, and an instance runs at most ``pools.generate.threads`` at once, so chunks that
    outnumber the threads wait (measured on W3, docs/benchmarks.md)."""
    split_share: float = Field(1.0, ge=0, le=1)
    """Share of the groups, longest estimated first, that are cut into chunks; the others stay
    whole (one generate task each: chunks cost tasks). All by default: a group's samples are
    alike in length, so spreading every group evens the instances out even with no ranker."""
    online: bool = True
    """Update a group's estimate from its own finished samples (and each sample's progress);
    false: the prior alone, as at dispatch."""
    migrate: bool = False
    """Move stragglers between instances: a run looks at every engine's running samples every
    ``move_every_s`` and moves what :meth:`LongTailPolicy.moves` picks (the engine must declare
    ``moves_samples``: ``sim``, and ``hf`` with ``batching = "slots"``); the rollout model of
    ``streamrl bench skew`` does the same in virtual time. Off by default: on the long-tail
    workload measured it does not pay (docs/benchmarks.md)."""
    move_every_s: float = Field(0.25, gt=0, le=1e6)  # (bounded: a timer of 1e300 s cannot be armed)
    """Real seconds between two looks at the engines when ``migrate`` (each look is one small
    call to every generate worker)."""
    straggler_ratio: float = Field(1.0, gt=0)
    """A running sample is a straggler once it has generated this many times its group's
    estimated sample length (the estimate of a sample not yet started)."""
    gain: float = Field(0.05, ge=0)
    """A move must bring the later of the two instances' estimated finishes forward by at least
    this share of it; small moves are not worth a re-prefill."""
    max_moves: int = Field(8, ge=0)
    """Most moves per decision (each re-prefills its sample's tokens so far)."""
    estimate: LengthEstimateConfig = LengthEstimateConfig()
    """How a group's length belief starts and moves (``[scheduler.estimate]``)."""
    tail_ratio: float = Field(1.5, ge=1)
    """Lengths have a tail worth placing when the run's observed P99 output length is more than
    this many times the median. Without one the scheduler places whole groups round-robin, as
    ``fcfs`` does, and asks the ranker nothing: where there is no tail, ordering by length
    cannot pay for the ranker's round trip."""
    tail_min_observed: int = Field(64, ge=1)
    """Observed samples needed before the run's lengths are judged tail-less; until then the
    scheduler assumes a tail."""


@dataclass(frozen=True)
class GroupSpec:
    """A prompt group to place."""

    group: str
    """Its key (the prompt's uid)."""
    samples: int
    """Samples to generate."""
    prompt_tokens: int
    """Prompt length in tokens."""
    prior: float
    """Prior log length (from the ranker's score, :func:`~streamrl.scheduling.estimates.prior_from_scores`)."""
    informed: bool = True
    """False when no length had been seen yet and ``prior`` is a placeholder."""


@dataclass(frozen=True)
class Chunk:
    """Some samples of one group, placed on one instance."""

    group: str
    """The group's key."""
    samples: tuple[int, ...]
    """Which of the group's samples (0-based)."""
    instance: int
    """Index of the instance."""
    priority: float
    """Admission priority inside the instance (its estimated length: longest first)."""


@dataclass(frozen=True)
class Running:
    """A sample decoding on an instance, as the policy sees it."""

    key: object
    """Whatever identifies it to the caller (returned in a :class:`Move`)."""
    group: str
    """Its group's key."""
    generated: int
    """Tokens generated so far."""
    prompt_tokens: int
    """Its prompt's tokens."""
    movable: bool = True
    """False for one that cannot move (moved once already): it only loads its instance."""


@dataclass(frozen=True)
class Move:
    """Move a running sample to another instance."""

    key: object
    """The :attr:`Running.key` of the sample."""
    source: int
    """Instance it leaves."""
    target: int
    """Instance that continues it (re-prefilling prompt + tokens so far)."""


def coefficients(step_latency: Callable[[float], float]) -> tuple[float, float]:
    """``(c0, per_context_token)`` of an affine decode-step latency model."""
    c0 = step_latency(0.0)
    return c0, max((step_latency(1e6) - c0) / 1e6, 0.0)


class LongTailPolicy:
    """The policy of the module's docstring; one per run, its estimates learn across steps."""

    def __init__(self, config: LongTailConfig, step_latency: Callable[[float], float]):
        """``step_latency``: seconds of one decode step given the batch's total context."""
        self.config = config
        self.c0, self.per_ctx = coefficients(step_latency)
        self.lengths = GroupLengths(config.estimate)
        self.siblings: dict[str, set] = {}  # group -> keys of its samples still running or waiting
        self.moved = 0
        """Samples moved so far."""

    # -- estimates --------------------------------------------------------------------------
    def start(self, groups: list[GroupSpec]) -> None:
        """Groups enter: their beliefs start at their priors."""
        for g in groups:
            self.lengths.start(g.group, g.prior, g.informed)

    def estimate(self, group: str, generated: int = 0, running: list[int] = ()) -> float:
        """Expected total length of a sample of ``group`` that has ``generated`` tokens so far."""
        if not self.config.online:
            b = self.lengths.groups[group]
            return max(math.exp(b.prior + self.lengths.sigma ** 2 / 2), generated + 1)
        return self.lengths.estimate(group, generated, running)

    def finished(self, group: str, length: int, running: list[int] = ()) -> None:
        """A sample of ``group`` finished at ``length`` tokens (``running``: its siblings'
        tokens so far)."""
        self.lengths.finish(group, length, running)

    def close(self, group: str):
        """``group`` is done; returns its belief (its prior and first online estimate)."""
        return self.lengths.close(group)

    # -- placement ---------------------------------------------------------------------------
    def place(self, groups: list[GroupSpec], instances: int) -> list[Chunk]:
        """Chunks of every group on ``instances`` instances, longest estimated first, each to
        the instance with the least estimated work so far: the per-context-token cost of every
        token placed on it (equal work: the lower index).

        The decode-step overhead (``c0`` times an instance's longest sample) is left out here: an
        estimate is a group's *expected* length, while an instance's longest sample is the
        longest of the many it holds, about the same on every instance of a long-tailed step.
        Counting the expected longest made long groups look free to stack on the instance that
        already had one (measured in docs/benchmarks.md)."""
        self.start(groups)
        pieces = []
        ests = {g.group: self.estimate(g.group) for g in groups}
        ranked = sorted(groups, key=lambda g: -ests[g.group])
        cut = {g.group for g in ranked[:round(self.config.split_share * len(groups))]} if instances > 1 else set()
        for g in groups:
            size = (self.config.chunk or g.samples) if g.group in cut else g.samples
            est = ests[g.group]
            for s in range(0, g.samples, size):
                pieces.append((est, g, tuple(range(s, min(s + size, g.samples)))))
        pieces.sort(key=lambda p: -p[0])
        work = [0.0] * instances  # context-token reads of the tokens placed (only ratios matter)
        out = []
        for est, g, samples in pieces:
            i = min(range(instances), key=lambda j: (work[j], j))
            work[i] += len(samples) * est * (g.prompt_tokens + est / 2)
            out.append(Chunk(g.group, samples, i, est))
        return out

    # -- stragglers --------------------------------------------------------------------------
    def finish_estimate(self, running: list[tuple[float, float]]) -> float:
        """Estimated seconds for an instance to finish ``[(context so far, remaining tokens)]``."""
        if not running:
            return 0.0
        longest = max(r for _, r in running)
        return self.c0 * longest + self.per_ctx * sum(r * (c + r / 2) for c, r in running)

    def moves(self, instances: list[list[Running]], usable: list[bool] | None = None) -> list[Move]:
        """Stragglers to move now: repeatedly, the longest-remaining straggler on the instance
        that finishes last goes to the one that finishes first, while that brings the later
        finish of the two forward by at least ``gain``. ``usable``: which instances may take a
        sample (one that did not answer the look is gone or stuck: it looks idle, and is not)."""
        c = self.config
        usable = usable if usable is not None else [True] * len(instances)
        if not c.migrate or len(instances) < 2:
            return []
        by_group: dict[str, list[int]] = {}
        for inst in instances:
            for s in inst:
                by_group.setdefault(s.group, []).append(s.generated)
        state = []  # per instance: [(context, remaining, straggler, key)]
        for inst in instances:
            rows = []
            for s in inst:
                est = self.estimate(s.group, s.generated, by_group[s.group])
                fresh = self.estimate(s.group, 0, by_group[s.group])
                rows.append((s.prompt_tokens + s.generated, max(est - s.generated, 1.0),
                             s.movable and s.generated >= c.straggler_ratio * fresh, s.key))
            state.append(rows)
        out: list[Move] = []
        moved: set = set()
        for _ in range(c.max_moves):
            finish = [self.finish_estimate([(x, r) for x, r, _, _ in rows]) for rows in state]
            src = max(range(len(state)), key=lambda i: finish[i])
            targets = [i for i in range(len(state)) if usable[i]]
            if not targets:
                break
            dst = min(targets, key=lambda i: finish[i])
            candidates = [row for row in state[src] if row[2] and row[3] not in moved]
            if src == dst or not candidates:
                break
            row = max(candidates, key=lambda x: x[1])
            src_after = self.finish_estimate([(x, r) for x, r, _, k in state[src] if k != row[3]])
            dst_after = self.finish_estimate([(x, r) for x, r, _, _ in state[dst]] + [(row[0], row[1])])
            if max(src_after, dst_after) > finish[src] * (1 - c.gain):
                break
            state[src] = [x for x in state[src] if x[3] != row[3]]
            state[dst] = state[dst] + [row]
            moved.add(row[3])
            out.append(Move(row[3], src, dst))
        self.moved += len(out)
        return out


class LongTail(Scheduler):
    """``[scheduler] name = "longtail"``: a run's groups cut into chunks and placed by
    :meth:`LongTailPolicy.place` (priors from the ranker's scores, longest first, least
    estimated work), admitted longest first inside each instance. One policy serves the whole
    run, so the spreads of its estimates are learned from every step's groups."""

    def __init__(self, config: LongTailConfig):
        self.config = config
        self.moves_samples = config.migrate
        self.last_chunks = 0
        self.policy: LongTailPolicy | None = None
        """The placement policy; its length estimates learn across the run's steps."""
        self.seen_online: dict[str, list[int]] = {}  # group -> lengths the mover reported mid-step
        # the mover's thread and the controller's (dispatch, observe) share the policy
        self.lock = threading.Lock()
        self.restored: dict | None = None  # a checkpoint's learned spreads, for the policy once it exists

    def state_dict(self) -> dict:
        """The spreads its length estimates learned across steps (a resumed run places as the
        uninterrupted one would have, not from the starting spreads)."""
        with self.lock:
            return {"lengths": self.policy.lengths.state_dict()} if self.policy is not None else dict(self.restored or {})

    def load_state_dict(self, state: dict) -> None:
        """Take back :meth:`state_dict`'s spreads."""
        if "lengths" in state:  # (checked now, not at the first dispatch: a bad one raises here, said once)
            GroupLengths().load_state_dict(state["lengths"])
        with self.lock:
            self.restored = dict(state)
            if self.policy is not None and "lengths" in state:
                self.policy.lengths.load_state_dict(state["lengths"])

    def metrics(self) -> dict[str, float]:
        """``chunks``: generate tasks the last dispatch made."""
        return {"chunks": self.last_chunks}

    def moves(self, instances: list) -> list[tuple[str, int, int]]:
        """Stragglers to move now (:meth:`LongTailPolicy.moves`), after the samples that finished
        since the last look have taught their groups' estimates."""
        with self.lock:
            if self.policy is None:
                return []
            open_groups = self.policy.lengths.groups
            views = [[Running(uid, uid.rsplit("-", 1)[0], n, prompt, movable) for uid, n, prompt, movable in
                      (now.running if now is not None else [])] for now in instances]
            running: dict[str, list[int]] = {}
            for v in views:
                for r in v:
                    running.setdefault(r.group, []).append(r.generated)
            for now in instances:
                for uid, length in (now.finished if now is not None else []):
                    group = uid.rsplit("-", 1)[0]
                    if group in open_groups:
                        self.policy.finished(group, length, running.get(group, []))
                        self.seen_online.setdefault(group, []).append(length)
            views = [[r for r in v if r.group in open_groups] for v in views]
            return [(m.key, m.source, m.target) for m in self.policy.moves(views, [now is not None for now in instances])]

    def needs_scores(self, workers: list[str], ctx: DispatchContext) -> bool:
        """Only when there is something to place by length: a long tail in the lengths seen so
        far (``tail_ratio``)."""
        return has_tail(ctx.observed_lengths, self.config.tail_ratio, self.config.tail_min_observed)

    def dispatch(self, prompts, scores, workers: list[str], ctx: DispatchContext) -> list[Assignment]:
        """One assignment per chunk (see :meth:`LongTailPolicy.place`); whole groups round-robin
        when there is nothing to place by length (:meth:`needs_scores`)."""
        with self.lock:
            return self._dispatch(prompts, scores, workers, ctx)

    def _dispatch(self, prompts, scores, workers: list[str], ctx: DispatchContext) -> list[Assignment]:
        every = tuple(range(ctx.samples_per_prompt)) if self.moves_samples else ()  # movable: a chunk task
        if not self.needs_scores(workers, ctx):
            self.last_chunks = len(prompts)
            return [Assignment(i, workers[i % len(workers)], 0.0, every) for i in range(len(prompts))]
        if self.policy is None:  # the latency model is known from the first dispatch on
            self.policy = LongTailPolicy(self.config, ctx.step_latency or (lambda context: 1.0))
            if self.restored and "lengths" in self.restored:
                self.policy.lengths.load_state_dict(self.restored["lengths"])
        priors = prior_from_scores(scores, ctx.observed_lengths)
        specs = [GroupSpec(p.uid, ctx.samples_per_prompt, int(ctx.prompt_tokens), prior, bool(ctx.observed_lengths))
                 for p, prior in zip(prompts, priors)]
        index = {p.uid: i for i, p in enumerate(prompts)}
        merged: dict[tuple[int, int], list] = {}  # a group's chunks on one instance: one task
        for c in self.policy.place(specs, len(workers)):
            merged.setdefault((index[c.group], c.instance), [c.priority, []])[1].extend(c.samples)
        per_group: dict[int, int] = {}
        for i, _ in merged:
            per_group[i] = per_group.get(i, 0) + 1
        self.last_chunks = len(merged)
        self._forget_unobserved()
        return [Assignment(i, workers[w], prio, () if per_group[i] == 1 and not every else tuple(sorted(samples)))
                for (i, w), (prio, samples) in sorted(merged.items())]

    def observe(self, prompts, lengths: list[list[int]]) -> None:
        """A step's groups are done: their lengths teach the estimates how far a group lands
        from its prior (``tau``) and how far its samples spread (``sigma``). Without it every
        step would place on the starting spreads, which on a long tail is about as good as
        round-robin (docs/benchmarks.md)."""
        with self.lock:
            if self.policy is None:
                return
            open_groups = self.policy.lengths.groups
            for p, ls in zip(prompts, lengths):
                seen = Counter(self.seen_online.pop(p.uid, []))  # taught mid-step by the mover already
                if p.uid in open_groups:
                    for n in ls:
                        if seen[n] > 0:
                            seen[n] -= 1
                        else:
                            self.policy.finished(p.uid, n)
                    self.policy.close(p.uid)

    def _forget_unobserved(self, keep: int = 4096) -> None:
        # groups whose step never reports back (a step cut short, served traffic) must not pile up
        groups = self.policy.lengths.groups
        for uid in list(groups)[:max(len(groups) - keep, 0)]:
            del groups[uid]
            self.seen_online.pop(uid, None)


__all__ = ["Chunk", "GroupSpec", "LongTail", "LongTailConfig", "LongTailPolicy", "Move", "Running"]
