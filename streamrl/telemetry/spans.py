"""Dask spans and task keys by step and phase, so the dashboard breaks a run's time down.

Every task of a step runs inside ``distributed.span("step N", phase)`` (phases: generate,
reward, train, publish, eval; a checkpoint has its own span). The dashboard's "Spans" and
"Fine Performance Metrics" views then show where each step's time went, and
``performance_report`` (``run.profile``) keeps them in its HTML.

Dask attaches a span to a *task group*, and groups by key prefix: with string keys such as
``generate-<uid>`` every generate task of the run falls in one group, which would carry the
first step's span for ever. So a step's tasks get tuple keys, ``("generate-3", "<uid>")``: the
group is the phase of one step, and the task stream still colours by phase (``generate``).
"""

from __future__ import annotations

import uuid
from contextlib import contextmanager
from typing import Iterator

import dask


def step_key(phase: str, step: int, rest: str) -> tuple[str, str]:
    """The key of one of step ``step``'s tasks in ``phase``: ``("<phase>-<step>", rest)``."""
    return (f"{phase}-{step}", rest)


#: Span ids of recent (step, phase) pairs. ``distributed.span`` makes new ids at every ``with``,
#: and the scheduler keeps every span: a step submits its tasks in many calls (a generate and a
#: reward task per prompt bundle, a train task per micro-batch), which made ~150 spans a W1 step
#: and thousands of scheduler objects a minute. One id per step and per (step, phase) makes one
#: span each; only the last steps' ids are kept (async submits at most a few steps ahead).
_IDS: dict[tuple, str] = {}
_KEEP = 512


def _id(key: tuple) -> str:
    if key not in _IDS:
        if len(_IDS) >= _KEEP:
            del _IDS[next(iter(_IDS))]  # the oldest
        _IDS[key] = str(uuid.uuid4())
    return _IDS[key]


@contextmanager
def phase(step: int, name: str) -> Iterator[None]:
    """Tasks submitted inside belong to span ``("step <step>", name)``, the same span however many
    times it is entered (the annotation ``distributed.span`` sets, with ids kept per step)."""
    with dask.annotate(span={"name": (f"step {step}", name), "ids": (_id((step,)), _id((step, name)))}):
        yield


def key_text(key) -> str:
    """A task key as users read it in messages: ``load-weights-3/generate-0`` for a tuple key."""
    return "/".join(map(str, key)) if isinstance(key, tuple) else str(key)
