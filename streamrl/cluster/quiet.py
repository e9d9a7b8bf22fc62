"""What Dask says, kept for the user: streamrl reports a run's errors once, in one line, so the
Dask lines that only retell them (a worker's "Compute Failed", a heartbeat cut by the run's own
end, a nanny restarting a train rank the run has already given up on) stay out of the terminal
unless ``--verbose``; and a worker that closed cleanly exits without the interpreter's slow
finalization. The embedded cluster's workers get these as worker plugins (``lifecycle.start``).
"""

from __future__ import annotations

import logging
import os

from distributed import WorkerPlugin


class QuickExit(WorkerPlugin):
    """After a clean close, end the worker process without the interpreter's slow finalization.

    A worker that imported torch and transformers spends seconds in C-level teardown after its
    last line of Python (under load, past the Nanny's 4 s grace period), so
    the Nanny kills it and warns "Worker process still alive after 4.0 seconds, killing" at the
    end of every run. Once the worker has closed cleanly there is nothing left to finalize: an
    ``atexit`` hook registered last runs first, flushes, and calls ``os._exit(0)``. A worker
    that dies any other way (an error, a kill) exits normally, with its own exit code.
    """

    name = "streamrl-quick-exit"

    def setup(self, worker) -> None:
        import atexit

        self.closed = False
        atexit.register(self._exit)

    def teardown(self, worker) -> None:
        self.closed = True

    def _exit(self) -> None:
        if self.closed:
            import sys

            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


class QuietTaskErrors(WorkerPlugin):
    """A failed task is reported once, by the ``streamrl`` process, in one line or with its
    traceback; the worker's own "Compute Failed" log of the same error (a second traceback in
    the user's terminal) is kept out unless ``--verbose``. So is the traceback of a fetch from
    a worker that died ("Worker stream died during communication", and on the sending side
    "failed during get data"): Dask recovers on its own
    (another holder, or the task again), and a loss that ends the run is streamrl's one line."""

    name = "streamrl-quiet-task-errors"

    def setup(self, worker) -> None:
        logging.getLogger("distributed.worker").addFilter(_drop_compute_failed)
        logging.getLogger("distributed.worker").addFilter(_drop_lost_peer_fetch)


class QuietShutdown(WorkerPlugin):
    """A worker whose own connections are closing (the run is over, or it failed and is being
    shut down) may have a heartbeat in flight; it fails with "ConnectionPool closing" and the
    worker logs it with a traceback in the user's terminal, under the run's real error. Only
    that record is dropped: a heartbeat failing while the worker runs is still logged."""

    name = "streamrl-quiet-shutdown"

    def setup(self, worker) -> None:
        from distributed.core import Status

        def keep(record: logging.LogRecord) -> bool:
            if not str(record.msg).startswith("Failed to communicate with scheduler during heartbeat"):
                return True
            exc = record.exc_info[1] if record.exc_info else None
            return worker.status == Status.running and "ConnectionPool closing" not in str(exc)

        logging.getLogger("distributed.worker").addFilter(keep)

        def keep_cancelled(record: logging.LogRecord) -> bool:
            # a task cancelled because the worker is closing (the run stopped) is no news
            return worker.status == Status.running or not (
                str(record.msg).startswith("Async instruction for") and "CancelledError" in record.getMessage())

        logging.getLogger("distributed.worker.state_machine").addFilter(keep_cancelled)


def quiet_lost_train_workers(train: dict[str, str]) -> None:
    """In the ``streamrl`` process (unless ``--verbose``): Dask's own lines about a lost worker
    of the train pool (``train``: ``{name: address}``) are left out -- the scheduler's failed
    broadcast to it and the tasks it held, its nanny restarting it. A lost rank ends the run,
    and streamrl says so in one line naming the rank and the resume command; Dask's lines above
    it only told the same story in its own words. A lost generate worker is still reported."""
    addresses = tuple(train.values())
    names = set(train)

    def keep(record: logging.LogRecord) -> bool:
        text = str(record.msg)
        if text.startswith(("Removing worker", "broadcast to")):
            return not any(a in record.getMessage() for a in addresses)
        if text.startswith("Restarting worker"):
            return _logging_nanny() not in names
        return True

    logging.getLogger("distributed.scheduler").addFilter(keep)
    logging.getLogger("distributed.nanny").addFilter(keep)


def _logging_nanny() -> str | None:
    """The name of the nanny whose method is logging now (its record names no worker), found
    up the calling frames; None if there is none."""
    import sys

    from distributed import Nanny

    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Nanny):
            return str(owner.name)
        frame = frame.f_back
    return None


#: What a nanny logs (with a traceback) when the worker process it is starting is stopped.
CUT_SHORT = ("Failed to start process", "Failed to restart worker after its process exited",
             "Nanny failed to start process")


def drop_cut_short_restart(record: logging.LogRecord) -> bool:
    """Logging filter, set while streamrl stops its cluster: False for a nanny's record of a
    worker start cut short (:data:`CUT_SHORT`); everything else stays."""
    return not str(record.msg).startswith(CUT_SHORT)


def _drop_lost_peer_fetch(record: logging.LogRecord) -> bool:
    """Logging filter: False for a worker's "Worker stream died during communication" record
    (a fetch from a peer that died; Dask handles it) and for the other end of the same event,
    "failed during get data" (a peer that died while this worker sent it data: an ``OSError``,
    which is all Dask logs it for); everything else the worker logs stays."""
    msg = str(record.msg)
    return not (msg.startswith("Worker stream died during communication")
                or msg.startswith("failed during get data"))


def drop_vanished_scratch(record: logging.LogRecord) -> bool:
    """Logging filter: False for Dask's "Failed to remove" record of a worker's scratch folder
    that is already gone (two processes cleaning one folder as a cluster stops or starts: the
    second finds nothing to remove); any other failure to remove stays."""
    try:
        text = record.getMessage()
    except Exception:  # noqa: BLE001 -- a record that cannot be formatted is kept as it is
        return True
    return not (text.startswith("Failed to remove") and "No such file or directory" in text)


def _drop_compute_failed(record: logging.LogRecord) -> bool:
    """Logging filter: False for the worker's "Compute Failed" record (the error reaches the
    client anyway); everything else the worker logs stays."""
    return not str(record.msg).startswith("Compute Failed")


def quiet_dask(verbose: bool) -> int:
    """Dask logs at INFO by default; keep the user's terminal for streamrl unless ``--verbose``."""
    level = logging.INFO if verbose else logging.WARNING
    for name in ("distributed", "distributed.scheduler", "distributed.nanny", "distributed.worker",
                 "distributed.core", "distributed.http.proxy", "bokeh"):
        logging.getLogger(name).setLevel(level)
    # bokeh warns that its dashboard allows any Host header; the dashboard binds to
    # cluster.host (loopback by default), and streamrl refuses foreign Host headers in front of
    # it (telemetry/dashboard_guard.guard_host), so the warning is noise for the user
    logging.getLogger("bokeh.server.util").setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return level
