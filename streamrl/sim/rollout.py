"""A step's rollout over many simulated instances at once, in virtual time, under one dispatch
policy: what cross-instance scheduling (groups in chunks, longest first, stragglers moved)
does to the generation makespan, on the same cost model and the same sampled lengths as the
``sim`` engine (:mod:`streamrl.sim.batching`, :func:`streamrl.sim.workload.sample_length`).

The ``sim`` engine runs one instance per Dask worker, each on its own clock, so a sample cannot
leave its instance there; here every instance's :class:`~streamrl.sim.batching.ContinuousBatch`
advances on one virtual clock and the policy looks at all of them every ``tick_s`` simulated
seconds -- the view a rollout coordinator beside real engines would have. A moved sample is
taken out of its batch with the tokens it has and re-admitted on the target, prefilling its
prompt plus those tokens; its record keeps each stretch of tokens with the policy version
that generated it.

Two kinds of policy run here: a :class:`~streamrl.api.Scheduler` (``fcfs``, ``skew``: whole
groups placed once, as in a real run) and a
:class:`~streamrl.scheduling.longtail.LongTailPolicy`. Every figure is *simulated*.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from streamrl.scheduling.longtail import LongTailPolicy, Running
from streamrl.sim import latency
from streamrl.sim.batching import ContinuousBatch
from streamrl.sim.latency import Profile


@dataclass
class SampleRecord:
    """One sample's life in a simulated rollout."""

    group: str
    """Its group's key (the prompt's uid)."""
    index: int
    """Which of the group's samples."""
    length: int
    """Tokens it generates in all."""
    prompt_tokens: int
    """Its prompt's tokens."""
    segments: list[tuple[int, int, int]] = field(default_factory=list)
    """``(instance, policy version, tokens)`` per stretch it decoded: more than one when moved."""
    end_s: float = 0.0
    """Simulated second it finished."""


@dataclass
class StepResult:
    """What one simulated step's rollout gave."""

    makespan_s: float
    """First admission to last sample finished, simulated seconds."""
    group_end_s: dict[str, float]
    """When each group's last sample finished."""
    samples: list[SampleRecord]
    """Every sample, finished."""
    moved: int = 0
    """Samples moved between instances."""
    recall: dict[str, float] = field(default_factory=dict)
    """recall@20% of each estimate (``prior``: the ranker's, at dispatch; ``first``: the
    group's own, when its first sample finished) against the observed mean log lengths."""


class Rollout:
    """``instances`` simulated engines sharing one virtual clock."""

    def __init__(self, profile: Profile, instances: int, max_running: int = 0, tick_s: float = 2.0):
        """``tick_s``: simulated seconds between the policy's looks at the instances."""
        self.profile, self.n, self.tick_s = profile, instances, tick_s
        self.coeffs = (*latency.decode_coefficients(profile), latency.prefill_time(profile, 1),
                       latency.kv_capacity_tokens(profile), max_running)

    def run(self, samples: list[SampleRecord], placed: list[tuple[SampleRecord, int, float]],
            policy: LongTailPolicy | None = None, version: int = 0) -> StepResult:
        """Decode ``placed`` (``(sample, instance, priority)``) to the end; ``policy`` (if any)
        hears of each finished sample and moves stragglers at every tick."""
        batches = [ContinuousBatch(*self.coeffs) for _ in range(self.n)]
        clocks = [0.0] * self.n
        for s, i, prio in placed:
            batches[i].add(s.prompt_tokens, s.length, prio, s)
        left = {s.group: 0 for s in samples}
        for s in samples:
            left[s.group] += 1
        group_end: dict[str, float] = {}
        t, moved = 0.0, 0
        while any(b.running or b.waiting for b in batches):
            t += self.tick_s
            for i, b in enumerate(batches):
                for r, at in self._advance(b, clocks, i, t):
                    s = r.payload
                    s.segments.append((i, version, r.length))
                    s.end_s = at
                    left[s.group] -= 1
                    if policy is not None:
                        policy.finished(s.group, s.length, self._running_of(batches, s.group))
                    if left[s.group] == 0:
                        group_end[s.group] = at
            if policy is not None:
                moved += self._move(batches, clocks, policy, t, version)
        return StepResult(max(s.end_s for s in samples), group_end, samples, moved)

    def _advance(self, b: ContinuousBatch, clocks: list[float], i: int, until: float):
        """Run instance ``i`` up to ``until``; yields ``(request, finish time)``."""
        while clocks[i] < until:
            prefill = b.admit()
            clocks[i] += b.prefill_time(prefill)
            if not b.running:  # idle until the next tick
                clocks[i] = until
                return
            steps = min(b.steps_to_next_finish(), max(1, b.steps_within(until - clocks[i])))
            clocks[i] += b.decode_time(steps)
            for r in b.advance(steps):
                yield r, clocks[i]

    @staticmethod
    def _running_of(batches: list[ContinuousBatch], group: str) -> list[int]:
        return [Rollout._done_so_far(b, r) for b in batches for r in b.running if r.payload.group == group]

    def _move(self, batches, clocks, policy: LongTailPolicy, t: float, version: int) -> int:
        # (a sample moves at most once, as the engines' samples do: a moved one is not movable)
        view = [[Running(id(r), r.payload.group, self._done_so_far(b, r), r.payload.prompt_tokens,
                         movable=not r.payload.segments) for r in b.running] for b in batches]
        moves = policy.moves(view)
        by_key = {id(r): (i, r) for i, b in enumerate(batches) for r in b.running}
        for m in moves:
            i, r = by_key[m.key]
            s = r.payload
            gen = batches[i].remove(r)
            s.segments.append((i, version, gen))
            done = sum(n for _, _, n in s.segments)
            # re-prefilled on the target: the prompt and every token so far; first in its queue
            batches[m.target].add(s.prompt_tokens + done, s.length - done, float("inf"), s)
            clocks[m.target] = max(clocks[m.target], clocks[i])
        return len(moves)

    @staticmethod
    def _done_so_far(b: ContinuousBatch, r) -> int:
        """Tokens of ``r``'s sample generated in all (earlier stretches included)."""
        s = r.payload
        return sum(n for _, _, n in s.segments) + b.generated(r)
