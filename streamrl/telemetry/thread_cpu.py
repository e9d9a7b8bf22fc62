"""CPU seconds of one thread of this process: what the serving path's threads cost per token.

A process's threads share one interpreter lock, so the HTTP server's event loop and the engine's
decode loop take turns; the CPU each spends per streamed token is the pace the host allows,
whatever the accelerator does (``streamrl bench serve`` reports it per phase).
"""

from __future__ import annotations

import threading
import time


def cpu_seconds(thread: threading.Thread | None) -> float | None:
    """CPU seconds ``thread`` has used so far (user and system), or None where it has not started,
    has ended, or the platform has no per-thread clock (``time.pthread_getcpuclockid``: Linux and
    most Unixes)."""
    if thread is None or thread.ident is None or not thread.is_alive():
        return None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (AttributeError, OSError):  # (no such clock here, or the thread ended in between)
        return None
