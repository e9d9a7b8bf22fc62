"""Admission control for ``async`` mode: how far generation may run ahead of training.

Kept as pure functions of a few counters so the staleness bound can be checked by a
property-based test over random timings (``tests/test_admission.py``) without a cluster.

The rule (AsyncFlow's staleness threshold, StreamRL's bounded asynchrony): the samples trained
into policy version ``g + 1`` belong to step ``g``; generation for step ``g`` may start only
once every generate worker holds policy version ``g - k`` or newer. Weights only move forward,
so each of those samples was made by a version ``>= g - k``: staleness ``<= k``. Generation is
*paced* (it waits); nothing is ever dropped, which would bias training toward short outputs.
"""

from __future__ import annotations

from dataclasses import dataclass


def required_version(step: int, max_staleness: int) -> int:
    """Policy version every generate worker must hold before generation of ``step`` starts."""
    return max(0, step - max_staleness)


@dataclass(frozen=True)
class Plan:
    """What the controller must do at the start of a training step."""

    wait_for_version: int
    """Block until every generate worker has loaded this version (no wait if already loaded)."""
    admit: tuple[int, ...]
    """Steps whose generation to submit now, in order."""


def plan(step: int, max_staleness: int, last_step: int, next_to_admit: int, loaded_version: int) -> Plan:
    """Admission at the start of training ``step``: fill the window ``step .. step + k``.

    ``next_to_admit`` is the first step not yet submitted; ``loaded_version`` the newest version
    known to be on every generate worker. The trainer publishes version ``step`` before step
    ``step`` starts, so the wait never deadlocks: it needs at most version ``step``.
    """
    window = range(max(step, next_to_admit), min(step + max_staleness, last_step) + 1)
    admit = tuple(window)
    need = max([loaded_version] + [required_version(g, max_staleness) for g in admit])
    return Plan(wait_for_version=need, admit=admit)
