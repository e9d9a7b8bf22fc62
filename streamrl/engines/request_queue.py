"""The request queue the ``hf`` engine's batching loops share.

Generate tasks (one per Dask worker thread) put their requests here and wait on a future per
request; a batching loop (continuous or static) takes them out, highest ``priority`` first and
then in arrival order, and hands each one's :class:`Response` back. That priority order is how a
scheduler's longest-first ordering and a long-tail instance's smaller batch (``max_running``)
reach the engine, whichever loop runs it.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as RequestTimeout
from dataclasses import dataclass


@dataclass
class Response:
    """What a batching loop hands back for one request."""

    tokens: list[int]
    """Sampled token ids, ending at the first EOS (included) or after ``max_new_tokens``."""
    logprobs: list[float]
    """Logprob of each sampled token under the tempered distribution."""
    version: int | None = None
    """Policy version that generated the response; None when the loop cannot tell (continuous
    batching loads weights between decode steps), and the version the group was asked under
    stands."""
    error: str | None = None
    """Why the request failed; None when it did not."""
    token_versions: list[int] | None = None
    """The policy version that produced each token, where the loop tracks it (a served request
    on the slot decoder: a weight load mid-response shows as a change)."""
    stopped_early: bool = False
    """The reward's ``stop_early`` ended it before EOS or its token limit."""
    moved: bool = False
    """Taken out mid-response to be finished on another instance (``Engine.move_out``): the
    tokens are the response so far."""


class RequestQueue:
    """Requests waiting for a batching loop, a future per request id, and how many run now."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # a loop waiting for requests sleeps on this; put() and wake() rouse it
        self._ready = threading.Condition(self._lock)
        self._heap: list[tuple[float, int, str, list[int]]] = []  # (-priority, order, id, prompt ids)
        self._order = itertools.count()
        self._futures: dict[str, Future] = {}
        self._running = 0
        self._ended: str | None = None  # why no loop takes requests any more (fail_all)

    def put(self, requests: list[tuple[str, list[int], float]]) -> dict[str, Future]:
        """Queue ``(request id, prompt ids, priority)`` requests, all under one lock so a loop
        taking a batch sees all or none of them, and wake a waiting loop. Returns each
        request's future, resolved with its :class:`Response`."""
        futures = {}
        asked = Counter(rid for rid, _, _ in requests)
        twice = sorted(rid for rid, n in asked.items() if n > 1)
        if twice:  # one future per id: two requests under one id in one call is a caller's mistake
            raise ValueError(f"hf engine: request {twice[0]} asked twice at once; every request needs its own id")
        superseded = []
        with self._lock:
            if self._ended is not None:  # no loop will ever take them: each fails now, not in a timeout
                for rid, _, _ in requests:
                    futures[rid] = Future()
                    futures[rid].set_exception(RuntimeError(f"hf engine: request {rid} cannot run: {self._ended}"))
                return futures
            for rid, ids, priority in requests:
                # An id still waiting is a request asked again (Dask retrying a generate task whose
                # wait timed out): the new ask takes the id, and the old one fails at once rather
                # than wait for a response that now goes to the new one. An old copy still queued
                # leaves the queue, so only the new one runs (a loop may hold settings per id).
                if rid in self._futures:
                    superseded.append((rid, self._futures[rid]))
                    kept = [e for e in self._heap if e[2] != rid]
                    if len(kept) != len(self._heap):
                        self._heap = kept
                        heapq.heapify(self._heap)
                futures[rid] = self._futures[rid] = Future()
                heapq.heappush(self._heap, (-priority, next(self._order), rid, ids))
            self._ready.notify()
        for rid, fut in superseded:
            fut.set_exception(RuntimeError(f"hf engine: request {rid} was asked again while waiting"))
        return futures

    def admit(self, start: Callable[[str, list[int]], bool], limit: int) -> None:
        """Start waiting requests, highest priority first, while fewer than ``limit`` (0: no cap)
        run. ``start(request id, prompt ids)`` hands one to the loop and returns False when the
        loop refused it (it died or is stopping): that request fails, naming itself, rather
        than wait forever (Dask retries the task)."""
        room = limit or float("inf")
        refused = []
        with self._lock:  # held while starting, so concurrent tasks cannot reorder the queue
            while self._heap and self._running < room:
                _, _, rid, ids = heapq.heappop(self._heap)
                if start(rid, ids):
                    self._running += 1
                else:
                    refused.append((rid, self._futures.pop(rid)))
        for rid, fut in refused:
            fut.set_exception(RuntimeError(f"hf engine refused request {rid}: its generation loop is not running"))

    def next_batch(self, limit: int, closed: threading.Event) -> list[tuple[str, list[int]]]:
        """Wait until requests are queued (or ``closed`` is set), then take up to ``limit``
        (0: all) of them, highest priority first, as ``[(request id, prompt ids)]``, and count
        them running until :meth:`finish`."""
        with self._ready:
            while not self._heap and not closed.is_set():
                self._ready.wait(0.5)
            batch = [heapq.heappop(self._heap)[2:] for _ in range(min(limit or len(self._heap), len(self._heap)))]
            self._running += len(batch)
        return batch

    def finish(self, rid: str, response: Response) -> None:
        """Hand ``response`` to the task waiting on request ``rid`` (if any still does) and
        free its running slot."""
        with self._lock:
            fut = self._futures.pop(rid, None)
            self._running -= 1
        if fut is not None:
            fut.set_result(response)

    def fail(self, rid: str, why: str) -> None:
        """Fail request ``rid``, which was running (its task or client learns ``why``), and free
        its running slot."""
        with self._lock:
            fut = self._futures.pop(rid, None)
            self._running -= 1
        if fut is not None:
            fut.set_exception(RuntimeError(f"hf engine: request {rid} failed: {why}"))

    def cancel(self, rid: str) -> bool:
        """Take request ``rid`` out of the queue if it is still waiting there (it is answered
        with an empty response); False when it is not waiting (running, or finished)."""
        with self._lock:
            kept = [e for e in self._heap if e[2] != rid]
            if len(kept) == len(self._heap):
                return False
            self._heap = kept
            heapq.heapify(self._heap)
            fut = self._futures.pop(rid, None)
        if fut is not None:
            fut.set_result(Response([], []))
        return True

    def wake(self) -> None:
        """Rouse a loop waiting in :meth:`next_batch` (to see that the engine closed)."""
        with self._ready:
            self._ready.notify_all()

    def fail_all(self, why: str = "the engine closed") -> None:
        """Fail every request not finished yet and empty the queue (the engine is closing, or its
        loop died): a task blocked on a request that will never finish would hang its worker
        thread. Requests put after it fail at once, for the same reason."""
        with self._lock:
            waiting, self._futures, self._heap = self._futures, {}, []
            self._ended = why
        for rid, fut in waiting.items():
            fut.set_exception(RuntimeError(f"hf engine: request {rid} did not finish: {why}"))

    def counts(self) -> tuple[int, int]:
        """``(running, queued)``, read together."""
        with self._lock:
            return self._running, len(self._heap)


def await_response(rid: str, future: Future, timeout: float) -> Response:
    """The response to request ``rid``, waiting at most ``timeout`` seconds; raises naming the
    request when it failed or got no response (a stuck generation loop must not hang the step)."""
    try:
        out = future.result(timeout=timeout)
    except RequestTimeout:  # concurrent.futures' own class before Python 3.11
        raise RuntimeError(f"hf engine: request {rid} got no response within "
                           f"{timeout:.0f} s (engine.request_timeout)") from None
    if out.error:
        raise RuntimeError(f"hf engine failed request {rid}: {out.error}")
    return out
