"""Stop signals while the embedded cluster starts (``run/stopping.py``), in this process: the
first is a stop request, a second stops at once -- one interrupt, not a stream of them."""

from __future__ import annotations

import _thread
import os
import signal
import time

from streamrl.run import stopping


def test_a_second_signal_while_the_cluster_starts_interrupts_the_main_thread_once(monkeypatch):
    # the watcher's interrupt_main writes the wakeup fd as a signal does; read back as another
    # signal, it sent one more, for ever (328,788 in two seconds), cutting the start's cleanup short
    calls, interrupt = [], _thread.interrupt_main

    def counting(*args):
        calls.append(args)
        interrupt(*args)

    monkeypatch.setattr(stopping._thread, "interrupt_main", counting)
    said = []
    stop = stopping.StopRequest(said.append)
    raised = 0
    try:
        try:
            with stop.deferred():
                os.kill(os.getpid(), signal.SIGINT)  # the first: a stop request
                deadline = time.time() + 10  # (two at once would wait as one while the signal is blocked)
                while stop.signal is None and time.time() < deadline:
                    time.sleep(0.01)
                os.kill(os.getpid(), signal.SIGINT)  # the second: stop now
                for _ in range(10):
                    try:
                        time.sleep(0.1)
                    except KeyboardInterrupt:
                        raised += 1
        except KeyboardInterrupt:  # (and once more at the start's end: the run stops)
            raised += 1
    finally:
        stop.uninstall()
    assert len(calls) == 1 and raised == 2 and stop.signal == signal.SIGINT and said
