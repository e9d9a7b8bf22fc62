"""The base of every recipe table's model, and the one check pydantic's lax mode does not make."""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """Base for recipe tables: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


def _walk(t: Any) -> tuple[bool, bool, list]:
    """(takes a number, takes a bool, the models and containers of models it takes) of a type."""
    if t is bool or t is Any:
        return False, True, []
    if t in (int, float):
        return True, False, []
    if isinstance(t, type) and issubclass(t, BaseModel):
        return False, False, [t]
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is typing.Annotated:
        return _walk(args[0])
    if origin is typing.Literal:
        return False, any(isinstance(a, bool) for a in args), []
    if origin in (typing.Union, types.UnionType):
        found = [_walk(a) for a in args]
        return any(f[0] for f in found), any(f[1] for f in found), [m for f in found for m in f[2]]
    if origin in (list, tuple, set, frozenset, dict) and args:
        return False, False, [(origin, args[-1] if origin is not tuple else args[0])]
    return False, False, []


def boolean_for_a_number(model: type[BaseModel], data: Any, path: str = "") -> str | None:
    """The dotted path of the first ``true``/``false`` in ``data`` where ``model`` takes a number
    and no bool, reaching into nested tables and lists of tables; None when there is none.
    Pydantic's lax mode, which the recipe's tables and plugins' configs use, reads ``true`` as 1:
    ``lr = true`` would train at a rate of 1.0 without a word."""
    if not isinstance(data, dict):
        return None
    for key, value in data.items():
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if field is None:
            continue
        where = f"{path}.{key}" if path else key
        found = _within(field.annotation, value, where)
        if found:
            return found
    return None


def _within(annotation: Any, value: Any, where: str) -> str | None:
    number, boolean, nested = _walk(annotation)
    if isinstance(value, bool):
        return where if number and not boolean else None
    for inner in nested:
        if isinstance(inner, type) and isinstance(value, dict):
            found = boolean_for_a_number(inner, value, where)
        elif isinstance(inner, tuple) and inner[0] is dict and isinstance(value, dict):
            found = next((f for k, v in value.items() if (f := _within(inner[1], v, f"{where}.{k}"))), None)
        elif isinstance(inner, tuple) and inner[0] is not dict and isinstance(value, list):
            found = next((f for i, v in enumerate(value) if (f := _within(inner[1], v, f"{where}[{i}]"))), None)
        else:
            found = None
        if found:
            return found
    return None
