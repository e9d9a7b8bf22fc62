"""The ``streamrl`` command run in the test's own process, as a caller of ``streamrl.cli.main``
would run it, with what a separate process would have printed captured.

Why: a run started as ``python -m streamrl`` pays its interpreter's imports and, for the
embedded cluster, a fork server that imports torch and transformers before it forks the
workers: about 9 of the 11 CPU-seconds of a two-step run of the tiny model. The first run in a
test process pays that too; every later one reuses the process's imports and its fork server
(``cluster/warm_start.begin`` is made for a second run in one process) and costs about 4
(docs/benchmarks.md, "The tests' runs in the test process"). The workers are still separate
processes on a real cluster; only the driver is the test's process.

What a test reads of it is what the command's process would have written: stdout and stderr
are captured at the file-descriptor level, into two files that this process keeps, so the
output of the workers (forked from a server that inherits them) is in it as well as the
driver's prints, logging and warnings. Python's warnings are shown as a fresh interpreter
shows them. What a run changes in the process (environment variables, Dask's start method
for workers, the working folder, signal handlers, logging handlers' streams) is put back after
it.

The smoke tests, the end-to-end check of each main path, always start the real command in a
process of its own (``conftest.py`` sets :data:`fresh_only` for them), as a user runs it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
import warnings
from pathlib import Path

#: Set for the test being run when it must start the command as a process of its own.
fresh_only = False
#: ``STREAMRL_TESTS_FRESH=1`` starts every command as a process of its own (to tell whether a
#: test behaves otherwise in-process, or to time the difference).
ALWAYS_FRESH = os.environ.get("STREAMRL_TESTS_FRESH") == "1"

# What a fresh interpreter's warnings module filters (CPython, not in development mode).
FRESH_FILTERS = [("default", DeprecationWarning, "__main__"), ("ignore", DeprecationWarning, None),
                 ("ignore", PendingDeprecationWarning, None), ("ignore", ImportWarning, None),
                 ("ignore", ResourceWarning, None)]
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGALRM)

_files: dict[int, int] = {}
_servers: set[int] = set()  # fork servers started during a run here: their workers write to _files


def _file(fd: int) -> int:
    """The file this process keeps for what is written to ``fd`` during a run: one for the
    process's life, since the fork server started in the first run keeps writing its workers'
    output to the descriptors it inherited then."""
    if fd not in _files:
        _files[fd], path = tempfile.mkstemp(prefix=f"streamrl-test-fd{fd}-")
        os.unlink(path)  # (open for this process's life, gone with it)
    return _files[fd]


def _plain_stream_handlers() -> list[logging.StreamHandler]:
    """Every logging handler that writes to a stream (Dask's, at import: to the stderr of that
    moment), not pytest's own capturing handlers."""
    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    return [h for lg in loggers for h in lg.handlers if type(h) is logging.StreamHandler]


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


class TimedOut(subprocess.TimeoutExpired):
    """:class:`subprocess.TimeoutExpired` whose message ends with the tails of what the command
    printed: pytest shows an exception's message, and a run that hung in CI said nothing else."""

    def __str__(self) -> str:
        def tail(text) -> str:
            text = text.decode(errors="replace") if isinstance(text, bytes) else (text or "")
            return text[-4000:]
        return f"{super().__str__()}\n--- its stdout, last lines:\n{tail(self.stdout)}\n--- its stderr:\n{tail(self.stderr)}"


class _Deadline:
    """After ``timeout`` seconds, what a user does to a run that hangs: Ctrl-C (the run stops
    after its step), then, ``grace`` seconds on, Ctrl-C again (it stops now). Why: in this
    process nothing else would end a hung run before pytest's own timeout, which ends the whole
    test process and every test still to run in it."""

    def __init__(self, timeout: float | None, grace: float = 20.0):
        self.fired = False
        self._lock = threading.Lock()
        self._done = False
        self._timers = [] if timeout is None else [threading.Timer(timeout + t, self._interrupt) for t in (0, grace)]
        for timer in self._timers:
            timer.daemon = True
            timer.start()

    def _interrupt(self) -> None:
        with self._lock:
            if not self._done:
                self.fired = True
                os.kill(os.getpid(), signal.SIGINT)

    def cancel(self) -> None:
        """No more interrupts (before the run's signal handlers are put back)."""
        with self._lock:
            self._done = True
        for timer in self._timers:
            timer.cancel()


def run(args: list[str], cwd: Path, timeout: float | None = None) -> subprocess.CompletedProcess:
    """``streamrl ARGS`` through ``streamrl.cli.main`` in this process, in ``cwd``: its exit
    status and its captured output, as :func:`subprocess.run` would give them; past ``timeout``
    seconds the run is interrupted as by Ctrl-C and :class:`subprocess.TimeoutExpired` raised
    with what it printed."""
    import multiprocessing.forkserver

    from streamrl.cli import main
    from streamrl.cluster import warm_start

    # a fork server started outside this harness (a test calling the cluster's start itself)
    # writes its workers' output to that moment's descriptors, not to the files read below
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    if server is not None and server not in _servers:
        warm_start.stop_server()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    out_file, err_file = _file(1), _file(2)
    start = {1: os.fstat(out_file).st_size, 2: os.fstat(err_file).st_size}
    saved_fds = {1: os.dup(1), 2: os.dup(2)}
    saved_streams = sys.stdout, sys.stderr
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    import dask

    # (only the start method: a run sets it for its process, and the next cluster this process
    # starts would take it; what streamrl's modules set in Dask's config when imported stays,
    # as it does in any process that imported them)
    saved_method = dask.config.get("distributed.worker.multiprocessing-method")
    saved_signals = {sig: signal.getsignal(sig) for sig in SIGNALS}
    handlers = _plain_stream_handlers()
    saved_handler_streams = [h.stream for h in handlers]
    os.dup2(out_file, 1)
    os.dup2(err_file, 2)
    sys.stdout = open(os.dup(1), "w", buffering=1, encoding="utf-8", errors="replace")
    sys.stderr = open(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
    for h in handlers:  # (not setStream: it flushes the old stream, which may be closed)
        h.stream = sys.stderr
    status = 1
    deadline = _Deadline(timeout)
    try:
        os.chdir(cwd)
        with warnings.catch_warnings():
            warnings.resetwarnings()
            for action, category, module in reversed(FRESH_FILTERS):
                warnings.filterwarnings(action, category=category, module=module or "")
            warnings.showwarning = _show_warning
            try:
                status = main(list(args))
            except SystemExit as exc:  # (argparse's usage errors), as the interpreter ends on it
                status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if not isinstance(exc.code, int | None):
                    print(exc.code, file=sys.stderr)
            except Exception:  # as the interpreter would print it, ending the process with 1
                traceback.print_exc()
                status = 1
            except KeyboardInterrupt:  # (the deadline's second Ctrl-C, raised outside the run's handling)
                traceback.print_exc()
                status = 130
    finally:
        deadline.cancel()
        for h, stream in zip(handlers, saved_handler_streams):
            h.stream = stream
        for h in _plain_stream_handlers():  # (one the run added, on the streams closed next)
            if h.stream in (sys.stdout, sys.stderr):
                h.stream = saved_streams[h.stream is sys.stderr]
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
            stream.close()
        sys.stdout, sys.stderr = saved_streams
        for fd, saved in saved_fds.items():
            os.dup2(saved, fd)
            os.close(saved)
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        dask.config.set({"distributed.worker.multiprocessing-method": saved_method})
        for sig, handler in saved_signals.items():
            if handler is not None:
                signal.signal(sig, handler)
    if multiprocessing.forkserver._forkserver._forkserver_pid is not None:
        _servers.add(multiprocessing.forkserver._forkserver._forkserver_pid)
    # (pread: the file's offset, shared with every descriptor on it, stays at its end)
    captured = {fd: os.pread(f, os.fstat(f).st_size - start[fd], start[fd]).decode("utf-8", errors="replace")
                for fd, f in ((1, out_file), (2, err_file))}
    if deadline.fired:
        raise TimedOut(["streamrl", *args], timeout, captured[1], captured[2])
    return subprocess.CompletedProcess(["streamrl", *args], status, captured[1], captured[2])
