"""Served groups as a checkpoint keeps them: JSON-ready dicts, read back without unpickling."""

from __future__ import annotations

import dataclasses

from streamrl.sample import Group, Prompt, Sample


def as_json(groups: list[Group]) -> list[list[dict]]:
    """``groups`` as JSON-ready lists of dicts (a checkpoint unpickles nothing with full pickle)."""
    return [[dataclasses.asdict(s) for s in g] for g in groups]


def from_json(groups: list[list[dict]]) -> list[Group]:
    """The groups :func:`as_json` wrote, each sharing one prompt as a served request's do."""
    out = []
    for g in groups:
        prompt = Prompt(**g[0]["prompt"])
        out.append([Sample(**{**s, "prompt": prompt}) for s in g])
    return out
