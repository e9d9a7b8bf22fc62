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


def _against_recipe(value: str, info: ValidationInfo) -> str:
    base = _recipe_dir(info)
    path = home(value)
    return str(path if path.is_absolute() or base is None else (base / path).resolve())


def _local_if_there(value: str, info: ValidationInfo) -> str:
    base = _recipe_dir(info)
    path = home(value)
    if path.is_absolute() or base is None:
        return str(path)
    return str((base / path).resolve()) if (base / path).exists() else value


RecipePath = Annotated[str, AfterValidator(_against_recipe)]
"""A config field holding a path to a local file or folder: relative paths are resolved against
the recipe's folder (like ``model.path``), whatever the working directory."""

PathOrHubId = Annotated[str, AfterValidator(_local_if_there)]
"""A config field holding a local path or a Hugging Face Hub id: a relative path that exists
next to the recipe becomes absolute; anything else is kept as written (a hub id)."""
