"""Continuous batching on the affine decode model, shared by the ``sim`` engine (in scaled real
time) and ``streamrl plan``'s predictor (in virtual time), so the planner forecasts exactly the
engine the simulated runs use.

Every running request advances one token per decode step; a step costs
``c0 + per_context_token * (total context of the running batch)``. The work per event is
O(log n): a request stores the step count at which it finishes and its context as an offset
from the batch's step count, so advancing the batch by ``k`` steps touches nothing but a
counter. (Walking every request per chunk made the simulator CPU-bound on two cores at
batches of hundreds: it ran ~25% slower than its own cost model.)
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Any


class Request:
    """One sequence: ``length`` tokens to generate after ``prompt_tokens`` of prompt."""

    __slots__ = ("prompt_tokens", "length", "priority", "order", "end_step", "base", "payload")

    def __init__(self, prompt_tokens: int, length: int, priority: float, order: int, payload: Any = None):
        self.prompt_tokens, self.length, self.priority, self.order = prompt_tokens, length, priority, order
        self.end_step = 0  # the batch's step count at which it finishes (set on admission)
        self.base = 0  # context = base + the batch's step count
        self.payload = payload

    def __lt__(self, other: Request) -> bool:  # the running heap: soonest to finish first
        return (self.end_step, self.order) < (other.end_step, other.order)


class ContinuousBatch:
    """The running batch and waiting queue of one engine instance (no clock of its own)."""

    def __init__(self, c0: float, per_context_token: float, prefill_per_token: float, capacity: int,
                 max_running: int = 0):
        self.c0, self.per_ctx, self.prefill_per_token = c0, per_context_token, prefill_per_token
        self.capacity, self.max_running = capacity, max_running or 1 << 40
        self.steps = 0  # decode steps taken so far
        self.running: list[Request] = []
        self.base_sum = 0
        self.waiting: list[tuple[float, int, Request]] = []  # (-priority, order, request)
        self.counter = itertools.count()

    def add(self, prompt_tokens: int, length: int, priority: float = 0.0, payload: Any = None) -> Request:
        """Queue a request (highest priority first, then arrival order)."""
        r = Request(prompt_tokens, length, priority, next(self.counter), payload)
        heapq.heappush(self.waiting, (-priority, r.order, r))
        return r

    def context(self) -> int:
        """Total context tokens of the running batch."""
        return self.base_sum + len(self.running) * self.steps

    def admit(self) -> int:
        """Move waiting requests into the batch while the KV cache and ``max_running`` allow
        (the first always fits); returns the prompt tokens to prefill."""
        ctx, prefill = self.context(), 0
        while self.waiting and len(self.running) < self.max_running:
            r = self.waiting[0][2]
            if self.running and ctx + r.prompt_tokens > self.capacity:
                break
            heapq.heappop(self.waiting)
            r.base = r.prompt_tokens - self.steps
            r.end_step = self.steps + r.length
            heapq.heappush(self.running, r)
            self.base_sum += r.base
            ctx += r.prompt_tokens
            prefill += r.prompt_tokens
        return prefill

    def prefill_time(self, tokens: int) -> float:
        """Seconds to prefill ``tokens`` prompt tokens."""
        return tokens * self.prefill_per_token

    def steps_to_next_finish(self) -> int:
        """Decode steps until the next running request finishes (0 when none runs)."""
        return self.running[0].end_step - self.steps if self.running else 0

    def decode_time(self, steps: int) -> float:
        """Seconds for ``steps`` decode steps of the running batch (context grows every step)."""
        n = len(self.running)
        return steps * (self.c0 + self.per_ctx * self.context()) + self.per_ctx * n * steps * (steps - 1) / 2

    def steps_within(self, seconds: float) -> int:
        """Most whole decode steps that fit in ``seconds`` (inverse of :meth:`decode_time`)."""
        a = self.c0 + self.per_ctx * self.context()
        b = self.per_ctx * len(self.running)
        if b == 0:
            return int(seconds / a) if a > 0 else 1 << 40
        h = a - b / 2
        return max(int((-h + math.sqrt(h * h + 2 * b * seconds)) / b), 0)

    def generated(self, r: Request) -> int:
        """Tokens ``r`` has generated so far (0 while it waits)."""
        return self.steps - (r.end_step - r.length) if r in self.running else 0

    def remove(self, r: Request) -> int:
        """Take ``r`` out of the batch or the queue (a sample moved elsewhere); returns the
        tokens it had generated."""
        if r in self.running:
            done = self.generated(r)
            self.running.remove(r)
            heapq.heapify(self.running)
            self.base_sum -= r.base
            return done
        self.waiting = [w for w in self.waiting if w[2] is not r]
        heapq.heapify(self.waiting)
        return 0

    def advance(self, steps: int) -> list[Request]:
        """Take ``steps`` decode steps (at most up to the next finish); returns the requests
        that finished."""
        self.steps += steps
        done = []
        while self.running and self.running[0].end_step <= self.steps:
            r = heapq.heappop(self.running)
            self.base_sum -= r.base
            done.append(r)
        return done
