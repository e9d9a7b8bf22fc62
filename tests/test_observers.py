"""Observers of a step's record: one failure policy for all (``run/observers.py``)."""

from __future__ import annotations

import pluggy

from streamrl.plugins import hookspecs
from streamrl.api import hookimpl
from streamrl.run.observers import Called, Observers, plugin_observers, sink_observers


def records(n):
    return [{"step": s, "reward_mean": s / 10} for s in range(n)]


def test_an_observer_that_raises_is_reported_once_and_left_out_while_the_others_go_on():
    seen, warned = {"a": [], "c": []}, []

    def broken(m):
        if m["step"] == 1:
            raise ValueError("disk\nfull")
        seen.setdefault("b", []).append(m["step"])

    observers = Observers([Called("a", lambda m: seen["a"].append(m["step"])), Called("b", broken),
                           Called("c", lambda m: seen["c"].append(m["step"]))], warned.append)
    for m in records(4):
        observers.step(m)
    assert seen == {"a": [0, 1, 2, 3], "b": [0], "c": [0, 1, 2, 3]}
    assert warned == ["b failed at step 2 and is left out from now on: ValueError: disk full"]


class Unsayable(Exception):
    def __str__(self):  # (a user's exception class whose text itself fails)
        raise RuntimeError("no words")


def test_an_observer_that_exits_or_whose_error_cannot_be_said_is_left_out_and_the_run_goes_on():
    # a tracker plugin's sys.exit("tracker down") ended the run; an exception whose str() raises
    # raised again from the handler; escapes in the text reached the terminal
    import sys

    from streamrl.run.observers import run_end

    warned, seen = [], []

    def exits(m):
        sys.exit("tracker down\x1b[2J")

    def unsayable(m):
        raise Unsayable()

    observers = Observers([Called("a", exits), Called("b", unsayable), Called("c", lambda m: seen.append(m["step"]))],
                          warned.append)
    for m in records(2):
        observers.step(m)
    assert seen == [0, 1]
    assert warned == ["a failed at step 1 and is left out from now on: SystemExit: tracker down\\x1b[2J",
                      "b failed at step 1 and is left out from now on: Unsayable: "]

    class Exits:
        @hookimpl
        def on_run_end(self, metrics):
            sys.exit(3)

    pm = pluggy.PluginManager("streamrl")
    pm.add_hookspecs(hookspecs)
    pm.register(Exits(), name="exits")
    run_end(pm.hook.on_run_end, "runs/x", records(1), warned.append)
    assert warned[-1] == "plugin 'exits': on_run_end raised SystemExit: 3"


def test_each_plugins_on_step_end_is_an_observer_of_its_own_and_sinks_are_observers_too():
    calls = []

    class Fine:
        @hookimpl
        def on_step_end(self, step, metrics):
            calls.append(("fine", step, metrics["reward_mean"]))

    class Failing:
        @hookimpl
        def on_step_end(self, metrics):  # a hook may name only the arguments it wants
            raise RuntimeError(f"tracker down at {metrics['step']}")

    class Sink:
        def write(self, m):
            calls.append(("sink", m["step"]))

    pm = pluggy.PluginManager("streamrl")
    pm.add_hookspecs(hookspecs)
    pm.register(Fine(), name="fine-plugin")
    pm.register(Failing(), name="failing-plugin")
    warned = []
    observers = Observers([*sink_observers([Sink()]), *plugin_observers(pm.hook.on_step_end)], warned.append)
    for m in records(3):
        observers.step(m)
    assert calls == [("sink", 0), ("fine", 0, 0.0), ("sink", 1), ("fine", 1, 0.1), ("sink", 2), ("fine", 2, 0.2)]
    assert warned == ["plugin 'failing-plugin' (on_step_end) failed at step 1 and is left out from now on: "
                      "RuntimeError: tracker down at 0"]


def test_an_observer_that_changes_its_record_changes_nobody_elses_and_every_on_run_end_is_called():
    from streamrl.run.observers import run_end

    class Pops:  # a tracker's idiom: step = metrics.pop("step")
        @hookimpl
        def on_step_end(self, metrics):
            metrics.pop("step")
            metrics["reward_mean"] = None

        @hookimpl
        def on_run_end(self, metrics):
            metrics.clear()
            raise OSError("flush failed")

    got, ended = [], []

    class Reads:
        @hookimpl
        def on_step_end(self, step, metrics):
            got.append((step, metrics["reward_mean"]))

        @hookimpl
        def on_run_end(self, run_dir, metrics):
            ended.append((run_dir, [m["step"] for m in metrics]))

    pm = pluggy.PluginManager("streamrl")
    pm.add_hookspecs(hookspecs)
    pm.register(Reads(), name="reads")
    pm.register(Pops(), name="pops")  # (pluggy calls the last registered first)
    warned = []
    observers = Observers(plugin_observers(pm.hook.on_step_end), warned.append)
    kept = records(2)
    for m in kept:
        observers.step(m)
    assert got == [(0, 0.0), (1, 0.1)] and warned == [] and kept == records(2)
    run_end(pm.hook.on_run_end, "runs/x", kept, warned.append)
    assert ended == [("runs/x", [0, 1])] and kept == records(2)
    assert warned == ["plugin 'pops': on_run_end raised OSError: flush failed"]


def test_a_sink_that_cannot_open_is_one_line_and_one_that_fails_to_close_is_a_warning(tiny_recipe):
    # a sink's close() that raised replaced the run's outcome with a traceback and skipped the
    # cleanup after it (the trace, the cluster's stop, the report); an open() that raised was a traceback
    import pytest

    from streamrl.errors import RunWarning, UserError
    from streamrl.recipe.recipe import load_recipe
    from streamrl.run.run_folder import RunFolder

    class Sink:
        def __init__(self, fails_at=""):
            self.fails_at, self.calls = fails_at, []

        def open(self, path):
            self.calls.append("open")
            if self.fails_at == "open":
                raise ConnectionError("tracker unreachable")

        def close(self):
            self.calls.append("close")
            if self.fails_at == "close":
                raise RuntimeError("flush failed")

    loaded = load_recipe(tiny_recipe)
    good, bad = Sink(), Sink("open")
    folder = RunFolder.create(loaded)
    with pytest.raises(UserError, match="metrics: the Sink sink could not start: ConnectionError: tracker unreachable"):
        folder.open(loaded, [good, bad], None)
    assert good.calls == ["open", "close"] and bad.calls == ["open"]  # the opened one closed, the other not

    first, last = Sink("close"), Sink()
    folder.open(loaded, [first, last], None)
    with pytest.warns(RunWarning, match="metrics: the Sink sink failed to close: RuntimeError: flush failed"):
        folder.close()
    assert last.calls == ["open", "close"]  # the sinks after it are still closed
