"""Bubble accounting: how long each pool's workers were busy and idle.

Every worker carries a :class:`BusyClock`, a ``WorkerPlugin`` that watches its tasks enter and
leave the ``executing`` state and adds up the time during which at least one task ran. The
controller reads the clocks (``client.run``, outside the task queue, so a worker full of
generate tasks answers at once) at every step boundary: busy seconds in the step are the
difference, idle seconds the rest of the step's wall time, and the idle ratio is the bubble the
StreamRL paper measures. Tasks still running at the boundary are counted up to the boundary.

On a generate worker "busy" means the engine had at least one request in flight: a task's, or a
served request's (an endpoint's, or a replica's token server's), which no task carries and which
say so themselves (:func:`begin_work` / :func:`end_work`).
"""

from __future__ import annotations

import threading
import time

from distributed import WorkerPlugin

ACTIVE = {"executing", "long-running"}

_PROCESS_CLOCK: list = [None]  # this worker process's BusyClock (none outside a worker)


class BusyClock(WorkerPlugin):
    """Seconds during which the worker executed at least one task."""

    name = "streamrl-busy-clock"

    def setup(self, worker) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.busy = 0.0
        self.since = 0.0
        # (the process's clock, for work that runs outside tasks: the threads of an endpoint or a
        # token server are not Dask's, and get_worker() does not answer there)
        _PROCESS_CLOCK[0] = self

    def transition(self, key, start, finish, **kwargs) -> None:
        now = time.time()
        with self.lock:
            if finish in ACTIVE and start not in ACTIVE:
                if self.running == 0:
                    self.since = now
                self.running += 1
            elif start in ACTIVE and finish not in ACTIVE and self.running > 0:
                self.running -= 1
                if self.running == 0:
                    self.busy += now - self.since

    def begin(self) -> None:
        """Work that is not a task began here (a served request): busy until :meth:`end`."""
        with self.lock:
            if self.running == 0:
                self.since = time.time()
            self.running += 1

    def end(self) -> None:
        """Work :meth:`begin` counted ended."""
        with self.lock:
            if self.running > 0:
                self.running -= 1
                if self.running == 0:
                    self.busy += time.time() - self.since

    def read(self) -> float:
        """Busy seconds so far, the task running now included."""
        with self.lock:
            return self.busy + (time.time() - self.since if self.running else 0.0)


_SERVED = [0]  # served requests in flight in this process (a worker retires once none are)
_SERVED_LOCK = threading.Lock()


class Work:
    """A served request counted by :func:`begin_work`: ended once, on the clock that counted it
    (a clock registered again meanwhile, by another run on the same cluster, is not touched)."""

    def __init__(self, clock: "BusyClock | None"):
        self.clock, self.ended = clock, False


def begin_work() -> Work:
    """A served request began in this worker process: its clock counts it busy, and the elastic
    pool does not retire the worker under it (:func:`served_in_flight`); pass what this returns
    to :func:`end_work`. No clock outside a worker."""
    with _SERVED_LOCK:
        _SERVED[0] += 1
    work = Work(_clock())
    if work.clock is not None:
        work.clock.begin()
    return work


def end_work(work: Work) -> None:
    """The served request :func:`begin_work` counted ended (once, however often it is said)."""
    with _SERVED_LOCK:
        if work.ended:
            return
        work.ended = True
        _SERVED[0] = max(0, _SERVED[0] - 1)
    if work.clock is not None:
        work.clock.end()


def served_in_flight() -> int:
    """Served requests running in this process now."""
    return _SERVED[0]


_TAKES_REQUESTS = [False]


def takes_requests(yes: bool | None = None) -> bool:
    """Whether this worker process is sent served requests (a replica's token server runs here);
    ``yes`` sets it. An elastic pool gives such a worker time to be taken out of the endpoint's
    lists before it looks whether it is idle."""
    if yes is not None:
        _TAKES_REQUESTS[0] = yes
    return _TAKES_REQUESTS[0]


def _clock() -> "BusyClock | None":
    return _PROCESS_CLOCK[0]


def read_clock(dask_worker) -> tuple[str, float]:
    """Runs on a worker via ``client.run``: its name and busy seconds so far."""
    plugin = dask_worker.plugins.get(BusyClock.name)
    return str(dask_worker.name), (plugin.read() if plugin is not None else 0.0)


def snapshot(client) -> tuple[float, dict[str, float]]:
    """(now, {worker name: busy seconds so far}) for every worker. By name: a worker restarted
    by its nanny keeps its name, not its address. A worker dying as it is asked is left out (its
    clock starts again from zero when its nanny restarts it; ``pool_bubbles`` counts no negative
    busy time), so a lost worker never ends the run here."""
    return time.time(), dict(client.run(read_clock, on_error="ignore").values())


def pool_bubbles(before: tuple[float, dict], after: tuple[float, dict],
                 pools: dict[str, dict[str, str]]) -> dict[str, dict[str, float]]:
    """Per pool: ``busy_s`` and ``idle_s`` summed over its workers, and ``idle_ratio``."""
    (t0, b0), (t1, b1) = before, after
    wall = max(t1 - t0, 1e-9)
    out = {}
    for pool, workers in pools.items():
        if not workers:
            continue
        busy = sum(min(max(b1.get(n, 0.0) - b0.get(n, 0.0), 0.0), wall) for n in workers)
        capacity = wall * len(workers)
        out[pool] = {"busy_s": round(busy, 4), "idle_s": round(capacity - busy, 4),
                     "idle_ratio": round(1.0 - busy / capacity, 4)}
    return out
