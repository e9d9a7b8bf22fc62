"""Users' dataset files read as rows: a parquet, JSON/JSONL or CSV file, a ``save_to_disk``
folder, a folder of such files or a hub id, through Hugging Face ``datasets`` (the ``dataset``
task's input; ``dataset.py`` makes prompts of the rows)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from streamrl.errors import UserError

#: File suffixes and the ``datasets`` builder that reads them.
BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}


def load_rows(path: str, split: str, field: str) -> list[dict]:
    """The rows of ``split`` of the dataset at ``path`` (see :class:`DatasetConfig`), as dicts;
    ``field`` is the recipe field named in errors."""
    import datasets

    datasets.disable_progress_bars()
    local = Path(path)
    try:
        if local.is_file():
            builder = BUILDERS.get(local.suffix.lower())
            if builder is None:
                raise UserError(f"{field}: {path} is not a dataset file (expected one of "
                                f"{', '.join(BUILDERS)}, or a folder)")
            data = datasets.load_dataset(builder, data_files=str(local), split="train")
        elif local.is_dir() and ((local / "dataset_info.json").exists() or (local / "dataset_dict.json").exists()
                                 or (local / "state.json").exists()):
            data = datasets.load_from_disk(str(local))
            if isinstance(data, datasets.DatasetDict):
                if split not in data:
                    raise UserError(f"{field}: {path} has no split {split!r} (it has {', '.join(data)})")
                data = data[split]
        elif local.is_dir():
            data = datasets.load_dataset(str(local), split=split)
        else:
            data = datasets.load_dataset(path, split=split)
        data = _media_undecoded(data, datasets)
        rows = data.to_list()
    except UserError:
        raise
    except Exception as exc:  # datasets' own errors are long; the first line says what was wrong
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        where = "" if local.exists() else " (no such file or folder next to the recipe, and not found on the hub)"
        raise UserError(f"{field}: cannot read {path}{where}: {first[:300]}") from None
    return rows


def _media_undecoded(data, datasets):
    # An image, audio or video column is kept as its bytes and path: a prompt is text, and
    # decoding every row's media on reading took the memory of all of them at once (and needs
    # the decoder's package, an ImportError on reading otherwise).
    for name, feature in data.features.items():
        if isinstance(feature, tuple(getattr(datasets, kind) for kind in ("Image", "Audio", "Video")
                                     if hasattr(datasets, kind))) and getattr(feature, "decode", False):
            data = data.cast_column(name, type(feature)(decode=False))
    return data


def dig(row: dict, dotted: str) -> Any:
    """``row["a"]["b"]`` for ``"a.b"``; KeyError when a part is missing."""
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(dotted)
        value = value[part]
    return value


def is_chat(value: Any) -> bool:
    """Whether a prompt is a list of chat messages."""
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
