"""Paths in a recipe: relative to the recipe's folder whatever the working directory, ``~`` the
user's home, and a Hugging Face Hub id told from a local path."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, ValidationInfo


def is_hub_id(text: str) -> bool:
    """``org/name``: what a Hub model or dataset id looks like (a relative path may too; callers
    look for a local folder first)."""
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", text) is not None and not text.startswith(".")


def _recipe_dir(info: ValidationInfo) -> Path | None:
    return (info.context or {}).get("recipe_dir")


def home(value: str) -> Path:
    """``value`` as a path, a leading ``~`` the user's home (``ValueError`` where there is none to
    say: ``~someone`` of no such user, ``~`` without ``HOME``)."""
    try:
        return Path(value).expanduser()
    except RuntimeError as exc:  # (pathlib's way of saying it: a validator's ValueError is one line)
        raise ValueError(f"cannot expand {value!r}: {exc}") from None


def resolved(path: Path) -> Path:
    """``path`` made absolute with its links followed (``ValueError`` naming it where it cannot
    be: a symlink loop, a name the system refuses; pathlib raises ``RuntimeError`` or
    ``OSError`` for those, a traceback for a user's typo)."""
    try:
        return path.resolve()
    except (RuntimeError, OSError) as exc:
        raise ValueError(f"cannot resolve {str(path)!r}: {exc}") from None


def _against_recipe(value: str, info: ValidationInfo) -> str:
    base = _recipe_dir(info)
    path = home(value)
    return str(path if path.is_absolute() or base is None else resolved(base / path))


def _local_if_there(value: str, info: ValidationInfo) -> str:
    base = _recipe_dir(info)
    path = home(value)
    if path.is_absolute() or base is None:
        return str(path)
    if (base / path).exists() or not _hub_like(value) or (base / path.parts[0]).is_dir():
        # (a file name that is not next to the recipe stays the recipe's: read from the working
        # directory instead, a run would depend on where it was started, and train on the wrong
        # file without a word; the reader names the missing path)
        return str(resolved(base / path))
    return value


#: What a data or model file's name ends with: a value ending so is a path, never a hub id.
FILE_SUFFIXES = (".parquet", ".jsonl", ".json", ".csv", ".arrow", ".txt", ".gguf", ".safetensors", ".py", ".toml")


def _hub_like(value: str) -> bool:
    # ``org/name``, or a bare name of the hub's canonical sets and models (``gsm8k``, ``gpt2``);
    # ``data.jsonl``, ``./x``, ``data/train.parquet``, ``../data/train.parquet`` are paths
    if value.lower().endswith(FILE_SUFFIXES):
        return False
    return is_hub_id(value) or re.fullmatch(r"[A-Za-z0-9][\w-]*", value) is not None


RecipePath = Annotated[str, AfterValidator(_against_recipe)]
"""A config field holding a path to a local file or folder: relative paths are resolved against
the recipe's folder (like ``model.path``), whatever the working directory."""

PathOrHubId = Annotated[str, AfterValidator(_local_if_there)]
"""A config field holding a local path or a Hugging Face Hub id: a relative path that exists
next to the recipe becomes absolute, as does one that does not look like a hub id (``org/name``
or a bare name); a hub id not found next to the recipe is kept as written."""
