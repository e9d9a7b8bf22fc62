"""A recipe's TOML read as untrusted input: bounded before it is parsed, and every number finite.

A recipe file may come from anywhere (a colleague, a generated sweep, a path typed wrong), and
``tomllib`` alone reads whatever it is given: ``/dev/zero`` until memory runs out, a 5,000-deep
``[[[...`` into a RecursionError, an integer of more than 4,300 digits into a ValueError (Python's
limit on converting digits). And TOML has ``inf`` and ``nan``: a plugin's ``lr = inf`` or a
timeout of ``inf`` passes a ``gt=0`` check and fails deep inside the run (a timer that cannot be
armed, a recipe that cannot be written back to the run folder). Here each of those is one line
naming the file or the key, before anything starts.
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Any

from streamrl.errors import UserError

#: The largest recipe file read, in bytes. Recipes are a few KB; a file this size is not one.
MAX_RECIPE_BYTES = 1 << 20


def read_toml(file: Path) -> dict[str, Any]:
    """The TOML table in ``file``: at most :data:`MAX_RECIPE_BYTES` read (a device or a pipe too),
    and every way it cannot be read or parsed one :class:`UserError` naming the file."""
    try:
        with open(file, "rb") as f:
            raw = f.read(MAX_RECIPE_BYTES + 1)
    except FileNotFoundError:
        raise UserError(f"{file}: recipe file not found") from None
    except IsADirectoryError:
        raise UserError(f"{file}: is a folder; expected a recipe .toml file") from None
    except OSError as exc:
        raise UserError(f"{file}: cannot read the recipe ({exc})") from None
    if len(raw) > MAX_RECIPE_BYTES:
        raise UserError(f"{file}: larger than {MAX_RECIPE_BYTES // 1024} KB; expected a recipe .toml file")
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise UserError(f"{file}: cannot read the recipe ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{file}: not valid TOML: {exc}") from None
    except (RecursionError, ValueError):  # (TOMLDecodeError is a ValueError: caught above)
        raise UserError(f"{file}: not a recipe this can read: arrays or tables nested too deeply, or an "
                        "integer longer than 4,300 digits") from None


def read_value(raw: str) -> Any:
    """A ``--set`` value read as TOML (``1e-5``, ``true``, ``"x"``, ``[1, 2]``); None when it is not
    TOML (the caller then keeps the text). Nested too deeply or too long a number: a UserError."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return None
    except (RecursionError, ValueError):
        raise UserError(f"--set value {raw[:40]!r}...: arrays nested too deeply, or an integer longer than "
                        "4,300 digits") from None


#: The deepest a recipe's tables and arrays may nest: a recipe is read, written back into its run
#: folder and sent to workers by code that recurses, and a few hundred levels (``--set a.a.a...=1``)
#: end it with Python's recursion limit.
MAX_NESTING = 64


def first_not_finite(data: Any) -> tuple[str, float] | None:
    """``(dotted key, value)`` of the first ``inf`` or ``nan`` in ``data`` (tables and arrays
    walked without recursion), or None. No recipe value means anything as infinity (a field
    whose limit can be off says how: 0, most often). Raises :class:`UserError` past
    :data:`MAX_NESTING` levels."""
    stack: list[tuple[str, Any, int]] = [("", data, 0)]
    while stack:
        key, value, depth = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return key, value
        if isinstance(value, (dict, list)) and depth >= MAX_NESTING:
            raise UserError(f"{key}: nested {MAX_NESTING} tables or arrays deep; a recipe nests far less")
        if isinstance(value, dict):
            stack.extend((f"{key}.{k}" if key else str(k), v, depth + 1) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((f"{key}.{i}" if key else str(i), v, depth + 1) for i, v in reversed(list(enumerate(value))))
    return None


def check_finite(data: dict[str, Any]) -> None:
    """A :class:`UserError` naming the first ``inf`` or ``nan`` value in the recipe ``data``, or
    a nesting past :data:`MAX_NESTING`."""
    found = first_not_finite(data)
    if found is not None:
        key, value = found
        raise UserError(f"{key}: expected a finite number (got {value})")
