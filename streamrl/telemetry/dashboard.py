"""A streamrl page on the Dask dashboard: reward, eval score, samples/s, staleness and each pool's
busy share over steps, live, at ``http://HOST:PORT/streamrl`` next to Dask's ``/status``.

The page is a Bokeh app served by the scheduler's own dashboard server
(``streamrl/telemetry/dashboard_app.py`` runs there). Two ways to put it on a scheduler:

* :func:`install`, from the run's client: it sends ``dashboard_app.attach`` to the scheduler
  (``client.run_on_scheduler``), which adds the page to the running dashboard. That covers the
  embedded cluster and a hand-started scheduler alike, as long as the scheduler's Python can
  import ``streamrl`` (and accepts pickled functions, Dask's default).
* a scheduler preload, for a hand-started scheduler::

      dask scheduler --host 127.0.0.1 --preload streamrl.telemetry.dashboard

  (or ``distributed.scheduler.preload: [streamrl.telemetry.dashboard]`` in Dask's config): the
  page is there from the scheduler's start, before any run connects; :func:`install` then only
  finds it and returns its address.

Data path: :func:`publish` logs a small summary of each step (no ``sample_log``) as a scheduler
event under the topic ``streamrl`` without waiting for the scheduler's answer; the page reads
``scheduler.get_events("streamrl")`` once a second. Anyone attached to the scheduler can read them
too: ``client.get_events("streamrl")``.

Neither function can fail or stall the run: errors are swallowed, with at most one warning per
process.
"""

from __future__ import annotations

import asyncio
import math
import threading
import uuid
import warnings
import weakref
from dataclasses import dataclass, field

from streamrl.telemetry.dashboard_app import PATH, TOPIC, attach

__all__ = ["install", "publish", "summarize", "dask_setup", "TOPIC"]

#: Summaries sent but not yet answered past which :func:`publish` drops a step's summary
#: instead of queueing more work for a scheduler that has stopped keeping up.
MAX_IN_FLIGHT = 64


@dataclass
class _Run:
    """What the page needs to know about the run on one client, beyond its records."""

    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    name: str | None = None
    mode: str | None = None
    steps: int | None = None
    # two counters rather than one: each is written by one thread only (sent by the caller of
    # publish, answered on the client's event loop), so no update is lost without a lock
    sent: int = 0
    answered: int = 0


# one run per client; a client that goes away takes its entry with it
_runs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
warned_once = threading.Event()
"""Set once the page's failure was warned about (one warning per process); cleared, the next
failure is warned about again."""


def _warn_once(text: str) -> None:
    """The page is an extra: say once that it is not working, then stay quiet."""
    if not warned_once.is_set():
        warned_once.set()
        warnings.warn(f"streamrl page: {text}; the run goes on without it", RuntimeWarning, stacklevel=3)


def install(client, *, name: str | None = None, mode: str | None = None, steps: int | None = None) -> str | None:
    """Make the page available on the scheduler's dashboard; returns its URL (None if it cannot).

    ``name``, ``mode`` and ``steps`` (the run's name, mode and step count) go into the page's
    header; a new call starts a new run on the page (an earlier run on the same scheduler is
    replaced by this one as soon as it publishes its first step).
    """
    _runs[client] = _Run(name=name, mode=mode, steps=steps)
    try:
        info = client.run_on_scheduler(attach)
    except Exception as exc:  # e.g. a scheduler that cannot import streamrl: see the docstring
        _warn_once(f"not added to the Dask dashboard ({type(exc).__name__}: {exc})")
        return None
    if not info:  # the scheduler serves no dashboard
        return None
    try:
        return page_url(client, info)
    except Exception as exc:
        _warn_once(f"its address is unknown ({type(exc).__name__}: {exc})")
        return None


def page_url(client, info: dict) -> str:
    """The page's address as a browser reaches it: Dask's own dashboard link with ``status``
    replaced (that keeps a link template the user configured, e.g. behind a proxy), or else the
    scheduler's host, the dashboard's port and the page's path."""
    link = client.dashboard_link
    if link.endswith("/status"):
        return link[: -len("status")] + PATH
    from urllib.parse import urlsplit

    host = urlsplit(client.scheduler.address.replace("tcp://", "http://", 1)).hostname
    return f"http://{host}:{info['port']}{info['path']}"


#: The evaluation figures the page draws (of a record's ``eval/*``).
EVAL_SHOWN = ("reward_mean", "pass@1")

def summarize(record: dict, run: _Run | None = None) -> dict:
    """The page's summary of one step record: a few numbers, msgpack-ready (plain ints, floats
    and strings), never the per-sample log."""
    run = run or _Run()
    pools = record.get("pools") or {}
    busy = {}
    for pool, acc in pools.items():
        ratio = acc.get("idle_ratio")
        if ratio is None:  # busy share from the seconds when no ratio is given
            total = acc.get("busy_s", 0.0) + acc.get("idle_s", 0.0)
            busy[str(pool)] = float(acc.get("busy_s", 0.0)) / total if total else math.nan
        else:
            busy[str(pool)] = 1.0 - float(ratio)
    # (only the figures the page draws: a reward's many named values stay in metrics.jsonl)
    evals = {key: float(record[f"eval/{key}"]) for key in EVAL_SHOWN
             if isinstance(record.get(f"eval/{key}"), (int, float))}
    if "eval_error" in record:
        evals["error"] = str(record["eval_error"])[:200]
    return {
        "run": run.id, "name": run.name, "mode": run.mode, "steps": run.steps,
        "step": int(record["step"]), "version": int(record.get("policy_version", -1)),
        "reward": float(record.get("reward_mean", math.nan)),
        "samples_per_s": float(record.get("samples_per_s", math.nan)),
        "tokens_per_s": float(record.get("tokens_per_s", math.nan)),
        "staleness": int(record.get("staleness_max", 0)),
        "token_staleness": float(record.get("offpolicy/token_staleness_mean", math.nan)),
        "ess": float(record.get("offpolicy/ess", math.nan)),
        "step_s": float(record.get("step_s", math.nan)),
        "time": float(record.get("time", math.nan)),
        "busy": busy, "eval": evals,
    }


def publish(client, record: dict) -> None:
    """Send one step's record to the page: its summary is logged as a scheduler event, and the
    call returns at once (the send runs on the client's event loop; measured cost: docs/dashboard.md)."""
    try:
        run = _runs.get(client)
        if run is None:  # install was not called (or not for this client): the page still gets the steps
            run = _runs[client] = _Run()
        waiting = run.sent - run.answered
        if waiting >= MAX_IN_FLIGHT:
            _warn_once(f"the scheduler is not taking the page's updates ({waiting} waiting); steps are dropped")
            return
        msg = summarize(record, run)
        client.loop.add_callback(_send, client, run, msg)
        run.sent += 1
    except Exception as exc:
        _warn_once(f"a step was not sent ({type(exc).__name__}: {exc})")


async def _send(client, run: _Run, msg: dict) -> None:
    """On the client's loop: log ``msg`` under :data:`TOPIC`; a failure is one warning at most,
    none at all once the client is closing (the end of the run)."""
    try:
        await client.scheduler.log_event(topic=TOPIC, msg=msg)
    except asyncio.CancelledError:  # the client is closing
        pass
    except Exception as exc:
        if client.status == "running":
            _warn_once(f"a step was not sent ({type(exc).__name__}: {exc})")
    finally:
        run.answered += 1


def dask_setup(server) -> None:
    """Dask preload hook (``dask scheduler --preload streamrl.telemetry.dashboard``): add the page
    when the scheduler starts. On a worker (``dask worker --preload``) it does nothing."""
    from distributed import Scheduler

    if isinstance(server, Scheduler):
        attach(server)
