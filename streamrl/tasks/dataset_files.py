"""Users' dataset files read as rows: a parquet, JSON/JSONL or CSV file, a ``save_to_disk``
folder, a folder of such files or a hub id, through Hugging Face ``datasets`` (the ``dataset``
task's input; ``dataset.py`` makes prompts of the rows).

The rows stay in ``datasets``' Arrow table, which it keeps memory-mapped from its cache, and
are read when asked for (:class:`Rows`): a dataset of millions of rows costs the run's process
the positions of the rows it uses, not millions of Python dicts (several times the file's size).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from streamrl.errors import UserError

#: File suffixes and the ``datasets`` builder that reads them.
BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}


#: Rows read from the table at once when going through them all (one at a time, ``datasets``
#: formats each row on its own, about ten times as slow).
BATCH_ROWS = 1024


class Rows(Sequence):
    """A dataset's rows as dicts, read from its table when asked for: ``rows[i]``, ``len``, a
    slice or :meth:`take` (another :class:`Rows` over the same table), and iteration in
    batches. ``positions``: which of the table's rows, in this order (None: all of them)."""

    def __init__(self, table, positions: list[int] | None = None):
        self.table, self.positions = table, positions

    def __len__(self) -> int:
        return self.table.num_rows if self.positions is None else len(self.positions)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.take(range(len(self))[i])
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} of {n}")
        i %= n
        return self.table[i if self.positions is None else self.positions[i]]

    def __iter__(self) -> Iterator[dict]:
        n = len(self)
        for start in range(0, n, BATCH_ROWS):
            stop = min(n, start + BATCH_ROWS)
            # (a batch of rows comes as its columns: {name: [value of each row]})
            columns = self.table[start:stop] if self.positions is None else self.table[self.positions[start:stop]]
            names = list(columns)
            for values in zip(*(columns[c] for c in names)):
                yield dict(zip(names, values))

    def take(self, kept) -> "Rows":
        """The rows at positions ``kept`` of these (in that order)."""
        kept = list(kept)
        return Rows(self.table, kept if self.positions is None else [self.positions[k] for k in kept])


def one_split(path: str | None) -> str | None:
    """What ``path`` is when it holds one split alone, as errors say it ("one file", "one saved
    Dataset": ``Dataset.save_to_disk`` rather than a ``DatasetDict``'s), else None: a split or an
    evaluation split cannot be chosen from it (it would be the same rows)."""
    if path is None:
        return None
    local = Path(path)
    try:
        if local.is_file():
            return "one file"
        if local.is_dir() and (local / "state.json").is_file() and not (local / "dataset_dict.json").exists():
            return "one saved Dataset"
    except (OSError, ValueError):  # (a name the system refuses: load_rows says so, naming the field)
        return None
    return None


def load_rows(path: str, split: str, field: str) -> Rows:
    """The rows of ``split`` of the dataset at ``path`` (see :class:`DatasetConfig`), read as
    dicts when asked for (:class:`Rows`); ``field`` is the recipe field named in errors."""
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
        rows = Rows(_media_undecoded(data, datasets))
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
