"""Stopping, in this process: signals while the embedded cluster starts (``run/stopping.py``) --
the first is a stop request, a second stops at once, one interrupt and not a stream of them --
and the end of a run, whose wait for its clean-up of the cluster is bounded."""

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


def test_the_end_of_a_run_waits_for_its_clean_up_of_the_cluster_within_a_bound(monkeypatch, caplog):
    # a cluster someone else runs, whose worker hangs in a plugin's teardown: the removal of
    # streamrl's plugins waited for it, and Ctrl-C was only noted meanwhile, for ever
    import threading
    import time

    from streamrl.cluster import lifecycle

    hung = threading.Event()
    monkeypatch.setattr(lifecycle, "release", lambda client: hung.wait(600))

    class Client:
        id = "c"

        def close(self):
            pass

    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="streamrl.cluster.lifecycle"):
        lifecycle.stop_meanwhile(None, Client(), timeout=0.5)()
    hung.set()
    assert time.monotonic() - t0 < 10 and "did not finish within 0 s" in caplog.text
