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
        with dog.watching("step 4", limit_s=1.0):  # (in time, with room for a loaded machine)
            time.sleep(0.05)
        time.sleep(1.5)  # its timer was cancelled: nothing comes
        signal.pthread_kill(threading.main_thread().ident, SIGNAL)  # a late signal: handled, ignored
        time.sleep(0.05)
        with dog.watching("step 5", limit_s=0):  # 0: no deadline
            time.sleep(0.4)
    finally:
        dog.uninstall()
    assert signal.getsignal(SIGNAL) == signal.SIG_DFL


def test_a_deadline_swallowed_by_a_catch_all_comes_again_until_it_ends_the_body():
    # (an observer's or a scheduler's call keeps a plugin's failure from ending the run with an
    # `except Exception`; the deadline landing inside one must still end the step)
    dog = Watchdog(client=None, limit_s=0.3)
    dog.install()
    swallowed = []
    try:
        t0 = time.perf_counter()
        with pytest.raises(StepTimeout):
            with dog.watching("step 7"):
                for _ in range(2):
                    try:
                        threading.Event().wait(30)
                    except Exception as exc:  # noqa: BLE001 -- what a plugin's catch-all does
                        swallowed.append(exc)
                threading.Event().wait(30)  # the step hangs again after it
        assert len(swallowed) == 2 and all(isinstance(e, StepTimeout) for e in swallowed)
        assert time.perf_counter() - t0 < 20
        # swallowed once, and the body then ends on its own: the timeout is raised at its end
        with pytest.raises(StepTimeout):
            with dog.watching("step 8"):
                try:
                    threading.Event().wait(30)
                except StepTimeout:
                    pass
        with dog.watching("step 9", limit_s=1.0):  # a later body in time is left alone
            time.sleep(0.05)
        assert dog._pending is None and dog._armed is None  # (nothing left to signal again)
        # the handler put back while a body still runs past its deadline (the runner's own
        # finally): disarmed first, so no signal reaches the default handler, which would end
        # this process (the test's), and nothing is raised after it
        with dog.watching("step 10"):
            try:
                threading.Event().wait(30)
            except StepTimeout:
                pass
            dog.uninstall()
            time.sleep(2.5)  # (past the next signal)
            dog.install()
    finally:
        dog.uninstall()


def test_a_scheduler_that_never_answers_does_not_hold_the_deadline_back(monkeypatch):
    # a scheduler frozen with its connection open: the timer asked it what runs without a bound,
    # and the step it should have ended hung for ever
    from streamrl.run import watchdog

    monkeypatch.setattr(watchdog, "ASK_S", 0.3)

    class Frozen:  # (what a frozen scheduler's client does: its sync calls never return)
        scheduler = type("Rpc", (), {"identity": None})()

        def sync(self, *args, **kwargs):
            threading.Event().wait(600)

        def processing(self):
            threading.Event().wait(600)

    dog = Watchdog(client=Frozen(), limit_s=0.3)
    dog.install()
    try:
        t0 = time.perf_counter()
        with pytest.raises(StepTimeout, match=r"still running: the scheduler did not say \(no answer within 0.3 s\)"):
            with dog.watching("step 2"):
                threading.Event().wait(30)
        assert time.perf_counter() - t0 < 10
    finally:
        dog.uninstall()


@pytest.mark.slow
def test_a_checkpoint_has_a_deadline_of_its_own_not_what_its_step_left(tiny_recipe, monkeypatch):
    # a step that took most of run.step_timeout_s, then its checkpoint: the step's deadline fired
    # in the checkpoint (a stop asked for lost every step since the one before)
    from streamrl.checkpoints import saving
    from streamrl.recipe.recipe import load_recipe
    from streamrl.run import runner
    from streamrl.run.controller import Controller
    from tests.helpers import read_records

    step, write = Controller.step, saving.checkpoint
    slowed = {"step": 0, "checkpoint": 0}

    # only the second step (the first has twice the deadline) and its checkpoint are slow, each
    # well inside the deadline alone (4 s and 5 s of 8) and past it together: wide margins, as a
    # loaded machine slows the rest of a step too
    def slow_step(self, *args, **kwargs):
        slowed["step"] += 1
        if slowed["step"] == 2:
            time.sleep(4.0)
        return step(self, *args, **kwargs)

    def slow_checkpoint(*args, **kwargs):
        slowed["checkpoint"] += 1
        if slowed["checkpoint"] == 2:
            time.sleep(5.0)
        return write(*args, **kwargs)

    monkeypatch.setattr(Controller, "step", slow_step)
    monkeypatch.setattr(saving, "checkpoint", slow_checkpoint)
    folder = runner.run(load_recipe(tiny_recipe, ["run.steps=2", "run.checkpoint_every=1", "run.step_timeout_s=8",
                                                  "run.report=false"]), plain=True)
    assert [r["step"] for r in read_records(folder)] == [0, 1]
