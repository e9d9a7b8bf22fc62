"""The step deadline (``run.step_timeout_s``): the backstop that keeps a run from hanging in
silence.

Each part of a step has its own deadline where it can stall (a reward's score, a weight
transfer, an engine request, a collective of the train group), and a worker that dies is seen
by Dask. What none of them covers -- a plugin's call that never returns, a disk that stops
answering while a checkpoint is written, a task stuck on a live worker -- ends here: when a
step (with the checkpoint after it) outlasts the deadline, the run stops in one line naming the
tasks still running and where, and the resume command (:class:`StepTimeout`).

The controller waits on Dask futures in the main thread (``as_completed``, ``Future.result``),
so the deadline is a timer thread that interrupts it: a signal sent to the main thread wakes
its wait (a lock wait returns on a signal to run Python's handler), and the handler raises.
The exception lands wherever the main thread is, and that may be inside a catch-all that keeps
a plugin's failure from ending the run (an observer's call, a scheduler's): so until the body
ends the signal comes again every :data:`REFIRE_S`, and a body that ends after swallowing it
raises it at its end.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

from distributed import Client

from streamrl.cluster import lifecycle
from streamrl.errors import RunStopped
from streamrl.telemetry.text import message_line

#: The signal that carries the timer's news to the main thread (nothing else of streamrl uses it).
SIGNAL = signal.SIGUSR1

#: After the deadline, how often the signal comes again while the body still runs (the first
#: one was swallowed by a catch-all on its way out).
REFIRE_S = 2.0


class StepTimeout(RunStopped):
    """A step did not finish within ``run.step_timeout_s``; the message names what was running."""


#: Seconds the timer waits for the scheduler to say what runs before it signals regardless: a
#: scheduler that froze with its connection open (a stopped process, a partition without a
#: reset) never answers, and the deadline must still end the step.
ASK_S = 5.0


def running(client: Client, most: int = 4, within: float | None = None) -> str:
    """What the cluster is running now, as ``task on worker`` (the first ``most``), or why that
    cannot be said (it did not answer ``within`` seconds)."""
    within = ASK_S if within is None else within
    said: list[str] = []
    # (asked in a thread of its own, given up after ``within``: Dask's sync calls have no bound)
    asking = threading.Thread(target=lambda: said.append(_running(client, most)), name="streamrl-watchdog-ask",
                              daemon=True)
    asking.start()
    asking.join(within)
    return said[0] if said else f"the scheduler did not say (no answer within {within:g} s)"


def _running(client: Client, most: int) -> str:
    try:
        names = {addr: str(info.get("name")) for addr, info in lifecycle.workers(client).items()}
        busy = [f"{_key(key)} on {names.get(addr, addr)}" for addr, keys in client.processing().items()
                for key in keys]
    except Exception as exc:  # (the scheduler itself may be what stopped answering)
        return f"the scheduler did not say ({type(exc).__name__}: {message_line(exc, 200)})"
    if not busy:
        return "no task is running (the step waits on something outside its tasks)"
    return ", ".join(busy[:most]) + (f" and {len(busy) - most} more" if len(busy) > most else "")


def _key(key) -> str:
    """A task key as its phase and name (``('train-5', '003')`` -> ``train-5 003``)."""
    return " ".join(map(str, key)) if isinstance(key, tuple) else str(key)


class Watchdog:
    """Interrupts the main thread when a step outlasts its deadline. Its signal handler stays
    installed from :meth:`install` to :meth:`uninstall`, so a signal that comes just after a
    step ended finds the handler, which then does nothing."""

    def __init__(self, client: Client, limit_s: float):
        self.client, self.limit_s = client, limit_s
        self.message = ""
        self._armed: object | None = None  # the watched body's token while it runs
        self._fired: object | None = None  # the body's token once its deadline passed
        self._pending: threading.Timer | None = None  # the timer that signals next
        self._lock = threading.RLock()  # (the handler takes it in the main thread, which may hold it)
        self._old = None

    def install(self) -> None:
        """Handle the watchdog's signal in this process (main thread only)."""
        if threading.current_thread() is threading.main_thread() and self._old is None:
            self._old = signal.signal(SIGNAL, self._raise)

    def uninstall(self) -> None:
        """Disarm, and put the previous handler back (a signal after it would end the process)."""
        with self._lock:
            self._armed = self._fired = None
        self._cancel()
        if self._old is not None:
            signal.signal(SIGNAL, self._old)
            self._old = None

    @contextmanager
    def watching(self, what: str, limit_s: float | None = None) -> Iterator[None]:
        """Run the body under the deadline (``limit_s``, default the watchdog's; 0: none);
        ``what`` names it in the message (``step 5``). Without :meth:`install` (off the main
        thread), it only runs the body."""
        limit = self.limit_s if limit_s is None else limit_s
        if not limit or self._old is None:
            yield
            return
        token = object()
        with self._lock:
            self._armed, self._fired = token, None
        self._timer(limit, token, what, limit)
        try:
            yield
        finally:
            while True:  # (a signal coming again just as the body ends must not skip the disarm)
                try:
                    with self._lock:
                        self._armed = None
                        fired, self._fired = self._fired, None
                    break
                except StepTimeout:
                    continue
            self._cancel()
        if fired is token:  # it expired, and the exception was swallowed on its way out
            raise StepTimeout(self.message)

    def _timer(self, delay: float, token: object, what: str, limit: float) -> None:
        timer = threading.Timer(delay, self._expire, args=(token, what, limit))
        timer.daemon = True
        with self._lock:
            if self._armed is not token:
                return
            self._pending = timer
        timer.start()

    def _cancel(self) -> None:
        with self._lock:
            timer, self._pending = self._pending, None
        if timer is not None:
            timer.cancel()

    def _expire(self, token: object, what: str, limit: float) -> None:
        stuck = running(self.client) if self._fired is not token else ""  # (before the lock: it asks the scheduler)
        with self._lock:
            if self._armed is not token or self._old is None:  # the body ended meanwhile, or the handler is gone
                return
            if self._fired is not token:
                self.message = f"{what} did not finish within {limit:g} s (run.step_timeout_s); still running: {stuck}"
                self._fired = token
            signal.pthread_kill(threading.main_thread().ident, SIGNAL)
        self._timer(REFIRE_S, token, what, limit)  # (again, until the body ends)

    def _raise(self, signum, frame) -> None:
        with self._lock:
            armed = self._armed is not None and self._fired is self._armed
        if armed:
            raise StepTimeout(self.message)
