"""Stopping a run cleanly on Ctrl-C or SIGTERM.

The first signal asks the run to stop at the end of the current step: the runner writes a
checkpoint, marks the run folder ``interrupted``, closes the cluster and prints the resume
command. A second signal stops at once (the newest checkpoint stays the one to resume from).

Ctrl-C in a terminal goes to the whole process group, Dask's worker processes included, and so
does SIGTERM from systemd (every process of the unit), Slurm (every process of the job step) or
``kill -- -PGID``. A worker that died of it would take the step's work (and the trainer's state)
with it, and its nanny would restart it in the middle of the stop. So the embedded cluster's
worker processes ignore both signals and only this process handles them: it stops the workers
itself, in order, after the checkpoint. They start with both blocked (a spawned process
inherits its parent's signal mask, so even its imports are covered) while this process handles
a signal that comes meanwhile as a stop request, counting each one so that a second one
still stops at once (:meth:`StopRequest.deferred`), and each worker
ignores both for good, and ends the block, when it is built (``cluster/pool_workers.ignore_stop_signals``); a
worker that a nanny restarts or the elastic pool adds is started from a thread that still
blocks them, so it is covered the same way. A worker that ignores SIGTERM still ends with this
process: its nanny closes it (SIGKILL after a grace period), and Dask's worker process exits by
itself when its parent's pipe closes, whatever killed the parent.
"""

from __future__ import annotations

import _thread
import os
import select
import signal
import sys
import threading
from multiprocessing import resource_tracker
from contextlib import contextmanager
from typing import Callable, Iterator

NAMES = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}


class StopRequest:
    """Set by the first SIGINT/SIGTERM; read by the run loop after each step."""

    def __init__(self, say: Callable[[str], None]):
        self.signal: int | None = None
        self.say = say
        self._now = False  # a second signal came while the cluster started: stop at once
        self._old: dict[int, object] = {}
        self._listeners: list[Callable[[], None]] = []

    def listen(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (in a thread of its own) when the stop is requested: what waits on
        the outside world (an endpoint's traffic) lets the step end."""
        self._listeners.append(listener)

    @property
    def requested(self) -> bool:
        """True once a stop was asked for."""
        return self.signal is not None

    def stop_now_if_asked_twice(self) -> None:
        """Raise ``KeyboardInterrupt`` when a second signal came but its interrupt was lost: one
        that lands in a garbage-collector callback (``distributed`` installs one) is printed as
        "Exception ignored" and the run would go on to its checkpoint."""
        if self._now:
            raise KeyboardInterrupt

    def _handle(self, signum, frame) -> None:
        if self.signal is not None:
            self._now = True  # (kept: Python drops an exception raised inside a gc callback)
            raise KeyboardInterrupt  # the second signal: stop now
        self.signal = signum
        self.say(f"{NAMES.get(signum, signum)}: stopping after this step with a checkpoint "
                 "(send it again to stop at once)")
        for listener in self._listeners:
            threading.Thread(target=listener, name="streamrl-stopping", daemon=True).start()

    def winding_down(self) -> None:
        """The run is closing (its folder, its cluster): a signal from now on is only noted, so
        that the cluster is still shut down; :meth:`stop_now_if_asked_twice` acts on it after."""
        if self._old:
            for sig in NAMES:
                signal.signal(sig, self._note)

    def _note(self, signum, frame) -> None:
        if self.signal is None:
            self.signal = signum
        else:
            self._now = True

    def install(self) -> None:
        """Handle SIGINT and SIGTERM in this process (main thread only; elsewhere, do nothing)."""
        if threading.current_thread() is not threading.main_thread() or self._old:
            return  # (installed already, by :meth:`deferred`)
        for sig in NAMES:
            self._old[sig] = signal.signal(sig, self._handle)
        # the second signal's interrupt, when it lands in a callback Python cannot raise from
        # (a garbage-collector callback): kept for the run to act on, not printed as a traceback
        self._old_unraisable = sys.unraisablehook
        sys.unraisablehook = self._unraisable

    def _unraisable(self, unraisable) -> None:
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
            self._now = True
            return
        self._old_unraisable(unraisable)

    @contextmanager
    def deferred(self, hold: bool = True) -> Iterator[None]:
        """While a cluster starts its processes, so that they start with SIGINT and SIGTERM
        held off and a signal meanwhile is not lost. With ``hold`` (the embedded cluster), this
        process handles them (:meth:`install`) but blocks them in this thread, whose mask the
        threads that start the workers inherit, and so do the workers, which end the block
        themselves once they ignore both (``cluster/pool_workers.ignore_stop_signals``); a signal meanwhile is a
        stop request (after the first step). Without (a cluster factory's processes, which
        would keep a block), both are ignored while it starts, as the processes then inherit,
        and a signal meanwhile is lost. Main thread only; elsewhere it only installs."""
        if threading.current_thread() is not threading.main_thread():
            yield
            self.install()
            return
        if not hold:
            old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in NAMES}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)
            self.install()
            return
        self.install()  # (a thread that does not block them, a library's, takes a signal for this handler)
        # multiprocessing's resource tracker, started with the first process, ends the block of
        # SIGINT and SIGTERM in the thread that starts it: start it before
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, NAMES)
        # Two signals meanwhile must count as two (the second stops at once), but signals of one
        # kind wait as one while every thread blocks them, and Python runs its handler once for
        # several that reached a thread of a library before the main thread looked. So a watcher
        # thread counts each one: those pending on the process (sigtimedwait) and those a thread
        # took (the wakeup fd, one byte per signal); the handler only raises once it says so.
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        old_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        old = {sig: signal.signal(sig, self._while_starting) for sig in NAMES}
        done = threading.Event()
        watcher = threading.Thread(target=self._count_signals, args=(done, read_end), name="streamrl-signals",
                                   daemon=True)
        watcher.start()
        try:
            yield
        finally:
            done.set()
            watcher.join()
            signal.set_wakeup_fd(old_fd)
            for sig, handler in old.items():
                signal.signal(sig, handler)
            os.close(read_end)
            os.close(write_end)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, NAMES)
        if self._now:  # the second signal came while the main thread could not be interrupted
            raise KeyboardInterrupt

    def _while_starting(self, signum, frame) -> None:
        # Python's handler while the cluster starts: the watcher counts the signals
        if self._now:
            raise KeyboardInterrupt

    def _count_signals(self, done: threading.Event, wakeup: int) -> None:
        while not done.is_set():
            taken = []
            # pending while every thread blocks them (Linux; elsewhere they wait for the block's end)
            info = signal.sigtimedwait(NAMES, 0) if hasattr(signal, "sigtimedwait") else None
            if info is not None:
                taken.append(info.si_signo)
            if select.select([wakeup], [], [], 0.05)[0]:
                taken += list(os.read(wakeup, 64))
            for signum in taken:
                if self.signal is None:
                    self._handle(signum, None)  # the first: a stop request, said now
                elif not self._now:
                    self._now = True  # the second: the main thread raises KeyboardInterrupt, once
                    # (interrupt_main writes the wakeup fd as a signal does: read here again, it
                    # interrupted the main thread for ever, its cleanup included)
                    _thread.interrupt_main(signal.SIGINT)

    def uninstall(self) -> None:
        """Put the previous handlers back."""
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}
        if getattr(self, "_old_unraisable", None) is not None:
            sys.unraisablehook, self._old_unraisable = self._old_unraisable, None
