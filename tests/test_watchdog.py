"""The step deadline (``run.step_timeout_s``) without a cluster: a wait in the main thread that
outlasts it is interrupted with :class:`StepTimeout`; a body that ends in time is left alone,
and a late signal finds a handler that does nothing. (The run's own test, a hung plugin call on
a live train worker: ``tests/test_hangs.py``.)"""

from __future__ import annotations

import signal
import threading
import time

import pytest

from streamrl.run.watchdog import SIGNAL, StepTimeout, Watchdog


def test_a_wait_that_outlasts_the_deadline_is_interrupted_and_one_that_ends_in_time_is_not():
    dog = Watchdog(client=None, limit_s=0.3)  # (no scheduler to ask: the message says so)
    dog.install()
    try:
        t0 = time.perf_counter()
        with pytest.raises(StepTimeout) as caught:
            with dog.watching("step 3"):
                threading.Event().wait(30)  # a blocking wait, as the controller's on a future
        assert time.perf_counter() - t0 < 10
        assert str(caught.value).startswith("step 3 did not finish within 0.3 s (run.step_timeout_s); "
                                            "still running: the scheduler did not say")
        with dog.watching("step 4"):
            time.sleep(0.05)
        time.sleep(0.5)  # its timer was cancelled: nothing comes
        signal.pthread_kill(threading.main_thread().ident, SIGNAL)  # a late signal: handled, ignored
        time.sleep(0.05)
        with dog.watching("step 5", limit_s=0):  # 0: no deadline
            time.sleep(0.4)
    finally:
        dog.uninstall()
    assert signal.getsignal(SIGNAL) == signal.SIG_DFL
