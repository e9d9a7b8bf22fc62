"""Stopping a run cleanly on Ctrl-C or SIGTERM.

The first signal asks the run to stop at the end of the current step: the runner writes a
checkpoint, marks the run folder ``interrupted``, closes the cluster and prints the resume
command. A second signal stops at once (the newest checkpoint stays the one to resume from).

Ctrl-C in a terminal goes to the whole process group, Dask's worker processes included, and so
does SIGTERM from systemd (every process of the unit), Slurm (every process of the job step) or
``kill -- -PGID``. A worker that died of it would take the step's work (and the trainer's state)
with it, and its nanny would restart it in the middle of the stop. So the embedded cluster's
worker processes ignore both signals and only this process handles them: it stops the workers
itself, in order, after the checkpoint. They are started with both ignored (a spawned process
inherits an ignored signal, so even its imports are covered), and each worker sets the ignore
again when it is built (:func:`ignore_stop_signals`), for workers a nanny restarts or the
elastic pool adds while this process has its own handler installed (a handler is not
inherited). A worker that ignores SIGTERM still ends with this process: its nanny closes it
(SIGKILL after a grace period), and Dask's worker process exits by itself when its parent's
pipe closes, whatever killed the parent.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

NAMES = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}


class StopRequest:
    """Set by the first SIGINT/SIGTERM; read by the run loop after each step."""

    def __init__(self, say: Callable[[str], None]):
        self.signal: int | None = None
        self.say = say
        self._old: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        """True once a stop was asked for."""
        return self.signal is not None

    def _handle(self, signum, frame) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt  # the second signal: stop now
        self.signal = signum
        self.say(f"{NAMES.get(signum, signum)}: stopping after this step with a checkpoint "
                 "(send it again to stop at once)")

    def install(self) -> None:
        """Handle SIGINT and SIGTERM in this process (main thread only; elsewhere, do nothing)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in NAMES:
            self._old[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        """Put the previous handlers back."""
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}


def ignore_stop_signals() -> None:
    """Ignore SIGINT and SIGTERM in this process (a worker process of the embedded cluster: the
    ``streamrl`` process stops it). Does nothing off the main thread, where Python cannot set
    signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in NAMES:
        signal.signal(sig, signal.SIG_IGN)


@contextmanager
def stop_signals_ignored() -> Iterator[None]:
    """Ignore SIGINT and SIGTERM while child processes are started, so they inherit the ignore;
    this process's handlers come back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in NAMES}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
