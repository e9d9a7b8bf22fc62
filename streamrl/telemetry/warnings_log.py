"""``warnings.log`` in the run folder: the workers' Python warnings, sent once each as Dask
events, and this process's library warnings (Dask's retelling of a worker's loss among them),
kept out of the terminal while the run's own lines say what matters."""

from __future__ import annotations

import logging
import sys
import threading
import time
import warnings
from pathlib import Path

from distributed import WorkerPlugin

from streamrl.telemetry.text import error_line, one_line

#: The Dask event topic of the workers' warnings.
TOPIC = "streamrl-warnings"

#: Characters of one line of ``warnings.log`` (a warning quoting a whole tensor, or a model's output).
MAX_WARNING_CHARS = 2000

#: Distinct warnings remembered (to write each once); past it the memory starts again.
MAX_DISTINCT_WARNINGS = 10_000


class WarningsToEvents(WorkerPlugin):
    """On a worker: each distinct Python warning (category and text) is sent once as a Dask event
    on :data:`TOPIC` instead of printed to the worker's stderr (which is the user's terminal for
    the embedded cluster). Works on any cluster: events travel through the scheduler."""

    name = "streamrl-warnings-to-events"

    def setup(self, worker) -> None:
        seen: set[tuple[str, str]] = set()

        def show(message, category, filename, lineno, file=None, line=None):
            key = (category.__name__, str(message)[:MAX_WARNING_CHARS])
            if key not in seen:
                if len(seen) >= MAX_DISTINCT_WARNINGS:
                    seen.clear()
                seen.add(key)
                # ("name": the scheduler overwrites a "worker" field with the address)
                worker.log_event(TOPIC, {"name": str(worker.name), "category": category.__name__,
                                         "message": key[1], "where": f"{filename}:{lineno}"})

        warnings.showwarning = show


class WarningsLog:
    """``warnings.log`` in the run folder: the workers' warnings (from their events) and this
    process's own library warnings while the run goes. Counts what it wrote."""

    def __init__(self, path: Path):
        self.path, self.count = Path(path), 0
        self.lock = threading.Lock()
        self.seen: set[tuple[str, str, str]] = set()
        self.broken = False
        """Whether writing failed once (nothing is written after that)."""
        self._default = None

    def write(self, where: str, category: str, message: str, origin: str) -> None:
        """Append one warning (once per distinct category, text and origin), on one line of
        bounded length. A log that cannot be written (a full disk) is said once on stderr and
        written no more: this runs inside ``warnings.warn`` and Dask's logging calls, anywhere."""
        with self.lock:
            if self.broken or (where, category, message) in self.seen:
                return
            if len(self.seen) >= MAX_DISTINCT_WARNINGS:  # (a run of months: what is kept stays bounded)
                self.seen.clear()
            self.seen.add((where, category, message))
            self.count += 1
            line = one_line(f"{time.strftime('%H:%M:%S')} [{where}] {category}: {message} ({origin})", MAX_WARNING_CHARS)
            try:
                with self.path.open("a") as f:
                    f.write(line + "\n")
            except OSError as exc:
                self.broken = True
                sys.stderr.write(f"streamrl: {one_line(str(self.path), 300)} cannot be written ({error_line(exc, 200)}); "
                                 "warnings are no longer kept there\n")

    def attach(self, client) -> None:
        """Take the workers' warnings (events) and this process's library warnings from now on.
        streamrl's own warnings (``PluginWarning``) stay on the terminal."""
        from streamrl.errors import PluginWarning

        client.subscribe_topic(TOPIC, lambda event: self.write(
            event[1]["name"], event[1]["category"], event[1]["message"], event[1]["where"]))
        client.register_plugin(WarningsToEvents())
        self._default = default = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, PluginWarning):
                default(message, category, filename, lineno, file, line)
            else:
                self.write("streamrl", category.__name__, str(message), f"{filename}:{lineno}")

        warnings.showwarning = show

    def detach(self) -> None:
        """Give this process's warnings back to the terminal."""
        if self._default is not None:
            warnings.showwarning = self._default
            self._default = None

    #: The Dask loggers of this process whose warnings :meth:`take_dask_warnings` keeps: the
    #: embedded cluster's nannies and its scheduler, which retell a worker's loss and restart
    #: (and a slow exit at the end) that streamrl reports in its own line, and the client, which
    #: says when it asks for a result again because the worker holding it died.
    DASK_LOGGERS = ("distributed.nanny", "distributed.scheduler", "distributed.client")

    #: Errors of those loggers that are Dask's recovery, not a failure: see :meth:`take_dask_warnings`.
    RECOVERED = ("broadcast to", "Couldn't gather keys")

    def take_dask_warnings(self) -> None:
        """Until :meth:`release_dask_warnings`, write the warnings of :data:`DASK_LOGGERS` here
        instead of the terminal (errors still go there, but for the scheduler's failed
        broadcasts); ``--verbose`` runs do not call it."""
        def tap(record: logging.LogRecord) -> bool:
            # The scheduler logs "broadcast to <worker> failed" as an error when a worker dies
            # between its loss and the scheduler noticing it, and streamrl asks every worker
            # something then (busy clocks, an elastic pool's probe) with errors ignored: the
            # loss is told by the lines that follow, the error itself is noise on the terminal.
            # Likewise "Couldn't gather keys" when a result's holder died as this process asked
            # for it: the client computes it again (its "rescheduling" warning) and the run goes on.
            if record.levelno >= logging.ERROR and not str(record.msg).startswith(self.RECOVERED):
                return True
            self.write(record.name, record.levelname, record.getMessage(), "dask")
            return False

        self._tap = tap
        for name in self.DASK_LOGGERS:
            logging.getLogger(name).addFilter(tap)

    def release_dask_warnings(self) -> None:
        """Dask's warnings to the terminal again."""
        tap = getattr(self, "_tap", None)
        if tap is not None:
            for name in self.DASK_LOGGERS:
                logging.getLogger(name).removeFilter(tap)
            self._tap = None
