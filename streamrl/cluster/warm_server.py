"""Imported by the warm-start server alone, last of what it loads (``warm_start.begin``): the
server ends as soon as its parent, the ``streamrl`` process, has ended.

The server has torch and transformers loaded, and an interpreter that finalizes them takes more
than a second of C-level teardown; meanwhile the server holds the terminal's (or a caller's)
output pipes open, so whoever waits for ``streamrl``'s output waits for that too. Nothing in the
server needs finalizing (it only forks workers), so the exit hook registered here, which runs
first, ends the process at once. A worker forked from the server never runs it: the server ends
a forked child with ``os._exit`` itself."""

from __future__ import annotations

import atexit
import os
import sys


def exit_now() -> None:
    """Flush what the server printed and end the process without finalizing the interpreter."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # (closed)
            pass
    os._exit(0)


atexit.register(exit_now)
