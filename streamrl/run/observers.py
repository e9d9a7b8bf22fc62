"""Observers: what watches each step's record without changing the run -- the metric sinks
(trackers), the trace, the dashboard page, plugins' ``on_step_end`` and the console.

One failure policy for all of them: an observer that raises is reported once, in one line
naming it, and left out for the rest of the run; the run goes on. ``metrics.jsonl`` is not an
observer: the run folder writes every record before the observers see it, so a resumed run
and ``streamrl report`` always have the whole run.

An observer is anything with a ``name`` and a ``step(record)`` method (:class:`StepObserver`);
a plugin observes with ``on_step_end`` (``plugins/hookspecs.py``) and each plugin's hook is an observer
of its own, so one failing plugin does not silence the others.
"""

from __future__ import annotations

import copy
from typing import Callable

from streamrl.errors import RunFailed, RunStopped, UserError
from streamrl.telemetry.text import message_line


class StepObserver:
    """Watches each step's record (the dict written to ``metrics.jsonl``)."""

    name: str = "observer"
    """How a failure names it."""

    def step(self, record: dict) -> None:
        """Called after each step's record is written to ``metrics.jsonl``."""


class Called(StepObserver):
    """An observer made of a function of the record."""

    def __init__(self, name: str, fn: Callable[[dict], None]):
        self.name, self.fn = name, fn

    def step(self, record: dict) -> None:
        """Call the function."""
        self.fn(record)


def sink_observers(sinks: list) -> list[StepObserver]:
    """Each metric sink (``[[metrics]]``, a tracker) as an observer."""
    return [Called(f"metric sink {type(s).__name__}", s.write) for s in sinks]


def plugin_observers(hook) -> list[StepObserver]:
    """Each plugin's ``on_step_end`` (``hook``: the plugin manager's ``on_step_end`` caller) as
    an observer of its own, called with the arguments it names."""
    out = []
    for impl in hook.get_hookimpls():
        def call(record: dict, impl=impl) -> None:
            given = {"step": record["step"], "metrics": record}
            impl.function(*[given[a] for a in impl.argnames])
        out.append(Called(f"plugin {impl.plugin_name!r} (on_step_end)", call))
    return out


class Observers:
    """The run's observers, called in order with each step's record (see the module docstring)."""

    def __init__(self, observers: list[StepObserver], warn: Callable[[str], None]):
        self.observers, self.warn = list(observers), warn

    def step(self, record: dict) -> None:
        """Hand ``record`` to every observer still in, each its own copy (a sink that pops
        ``step`` from it, as trackers' examples do, takes nothing from the others or from the
        run's records); one that raises is reported and left out."""
        for obs in list(self.observers):
            try:
                obs.step(copy.deepcopy(record))
            except RunStopped:  # the step's deadline, landing while this one ran: the run's, not its
                raise
            except (Exception, SystemExit) as exc:  # (a plugin's sys.exit() is its failure, not the run's end)
                self.observers.remove(obs)
                text = message_line(exc, 300)
                self.warn(f"{obs.name} failed at step {record.get('step', 0) + 1} and is left out from now on: "
                          f"{type(exc).__name__}: {text}")


def run_start(hook, recipe, run_dir) -> None:
    """Each plugin's ``on_run_start`` (``hook``: the plugin manager's caller), in pluggy's order.
    One that raises stops the run before its first step, as its contract says, in one line
    naming the plugin (:class:`~streamrl.errors.RunFailed`), not in a traceback."""
    impls = hook.get_hookimpls()
    if any(i.hookwrapper or i.wrapper for i in impls):  # (a wrapper wraps the others' calls: pluggy calls them all)
        calls = [("a plugin", lambda: hook(recipe=recipe, run_dir=run_dir))]
    else:
        given = {"recipe": recipe, "run_dir": run_dir}
        calls = [(repr(i.plugin_name), lambda i=i: i.function(*[given[a] for a in i.argnames])) for i in reversed(impls)]
    for name, call in calls:
        try:
            call()
        except (UserError, RunFailed):
            raise
        except (Exception, SystemExit) as exc:
            raise RunFailed(f"plugin {name}: on_run_start raised {type(exc).__name__}: "
                            f"{message_line(exc, 300)}; the run stopped before its first step") from None


def run_end(hook, run_dir, records: list[dict], warn: Callable[[str], None]) -> None:
    """Each plugin's ``on_run_end`` with its own copy of the run's records, one after another:
    one that raises is reported in one line naming it, and the others are still called (a
    tracker's flush must not depend on another plugin). The run's own outcome stands."""
    impls = hook.get_hookimpls()
    if any(i.hookwrapper or i.wrapper for i in impls):  # (a wrapper wraps the others' calls: pluggy calls them all)
        calls = [("a plugin", lambda: hook(run_dir=run_dir, metrics=copy.deepcopy(records)))]
    else:
        calls = [(repr(i.plugin_name), lambda i=i: i.function(*[{"run_dir": run_dir, "metrics": copy.deepcopy(records)}[a]
                                                                for a in i.argnames])) for i in reversed(impls)]
    for name, call in calls:
        try:
            call()
        except (Exception, SystemExit) as exc:  # noqa: BLE001 -- an observer's failure must not hide the run's outcome
            warn(f"plugin {name}: on_run_end raised {type(exc).__name__}: {message_line(exc, 300)}")
