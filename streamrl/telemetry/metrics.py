"""``metrics.jsonl``: one JSON record per optimizer step, flushed as it is written (a crash
keeps every finished step).

A crash in the middle of writing a record leaves its line cut off: :func:`read` drops such a
last line with a one-line warning. A line that cannot be read anywhere else was not torn by a
crash, and reading stops with a one-line error naming the file and the line.
"""

from __future__ import annotations

import json
import os
import math
import re
import warnings
from pathlib import Path

from streamrl.errors import RunWarning, UserError
from streamrl.telemetry.run_files import write_replacing


class MetricsLog:
    """Append-only JSON-lines log."""

    def __init__(self, path: Path):
        self.path = path
        self.records: list[dict] = []

    def keep_first(self, n: int | None) -> None:
        """A resumed run: load the file's first ``n`` records (None: all) and drop the rest (the
        steps after the checkpoint are run again). Fewer than ``n`` there (the file lost its end
        to a crash of the machine, or was edited) is said: the records of those steps are gone."""
        self.records = read(self.path)[:n] if self.path.exists() else []
        if n is not None and len(self.records) < n:
            warnings.warn(f"metrics.jsonl holds {len(self.records)} records, the checkpoint resumed from was written "
                          f"after {n}: the records of the steps between are lost", RunWarning, stacklevel=2)
        write_replacing(self.path, "".join(json_line(rec) for rec in self.records).encode())

    def write(self, record: dict) -> None:
        """Append one record and flush it to disk."""
        self.records.append(record)
        with self.path.open("a") as f:
            f.write(json_line(record))

    def sync(self) -> None:
        """Have the records written so far reach the disk itself (``fsync``), as a checkpoint's
        files do: a checkpoint says how many records go with it, and a machine that crashes
        after writing it must not come back with fewer (each record is not synced: a step of
        a few milliseconds would wait on the disk)."""
        if self.path.exists():
            with self.path.open("a") as f:
                os.fsync(f.fileno())


def json_line(record: dict) -> str:
    """``record`` as one line of strict JSON: a float that is not finite (a skipped step's NaN
    loss, an infinite log-ratio) is ``null``. Python writes ``NaN`` and ``Infinity``, which no
    strict reader takes (``JSON.parse``, Go's, serde's, jq): one such value made the whole file
    unreadable to them."""
    try:
        line = json.dumps(record, allow_nan=False)
    except ValueError:  # (rare: the walk below only for a record that holds one)
        return json.dumps(strict(record), allow_nan=False) + "\n"
    if strict_needed(line):
        # (a lone surrogate -- a tool's or a model's broken text -- is written as an escape that
        # strict readers refuse, serde's among them: as U+FFFD instead)
        return json.dumps(strict(record), allow_nan=False) + "\n"
    return line + "\n"


def strict_needed(line: str) -> bool:
    """Whether JSON text ``line`` (written ASCII) holds an escaped lone surrogate: then its value
    is written again through :func:`strict`."""
    return _LONE_SURROGATE.search(line) is not None


# an escaped surrogate without its other half (a pair is how JSON writes a character past U+FFFF)
_LONE_SURROGATE = re.compile(r"\\ud[89ab][0-9a-f]{2}(?!\\ud[c-f][0-9a-f]{2})|(?<!\\ud[89ab][0-9a-f]{2})\\ud[c-f][0-9a-f]{2}")


def strict(value):
    """``value`` with every float that is not finite as None and every lone surrogate in its
    text as U+FFFD: what strict JSON readers take."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, dict):
        return {strict(k) if isinstance(k, str) else k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def read(path: str | Path) -> list[dict]:
    """All records of a ``metrics.jsonl`` file. A last line cut off by a crash mid-write is
    dropped (warned about, :class:`~streamrl.errors.RunWarning`); a line that is not a JSON
    object anywhere else raises :class:`~streamrl.errors.UserError` naming it."""
    lines = Path(path).read_text(errors="replace").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError(f"a JSON {type(record).__name__}, not an object")
        except (ValueError, RecursionError) as exc:  # (RecursionError: JSON nested past the parser's reach)
            if number == len(lines):  # the record being written when the run stopped
                warnings.warn(f"{path}: its last line (line {number}) was cut off, as a crash in the middle of "
                              "writing it leaves it, and is dropped", RunWarning, stacklevel=2)
                break
            raise UserError(f"{path}: line {number} of {len(lines)} is not a JSON record ({exc}); only a last line "
                            "is ever cut off by a crash: mend or remove that line") from None
        records.append(record)
    return records
