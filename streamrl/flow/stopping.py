"""Stopping a run cleanly on Ctrl-C or SIGTERM.

The first signal asks the run to stop at the end of the current step: the runner writes a
checkpoint, marks the run folder ``interrupted``, closes the cluster and prints the resume
command. A second signal stops at once (the newest checkpoint stays the one to resume from).

Ctrl-C in a terminal goes to the whole process group, Dask's worker processes included; a worker
that died of it would take the step's work (and the trainer's state) with it. So the cluster is
started with SIGINT ignored -- its processes inherit that -- and only this process handles it.
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


@contextmanager
def sigint_ignored() -> Iterator[None]:
    """Ignore SIGINT while child processes are started, so they inherit the ignore."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
