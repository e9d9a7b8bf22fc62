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

from contextlib import contextmanager
from typing import Iterator

from distributed import span


def step_key(phase: str, step: int, rest: str) -> tuple[str, str]:
    """The key of one of step ``step``'s tasks in ``phase``: ``("<phase>-<step>", rest)``."""
    return (f"{phase}-{step}", rest)


@contextmanager
def phase(step: int, name: str) -> Iterator[None]:
    """Tasks submitted inside belong to span ``("step <step>", name)``."""
    with span(f"step {step}", name):
        yield


def key_text(key) -> str:
    """A task key as users read it in messages: ``load-weights-3/generate-0`` for a tuple key."""
    return "/".join(map(str, key)) if isinstance(key, tuple) else str(key)
