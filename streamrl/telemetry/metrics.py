"""``metrics.jsonl``: one JSON record per optimizer step, flushed as it is written (a crash
keeps every finished step)."""

from __future__ import annotations

import json
from pathlib import Path


class MetricsLog:
    """Append-only JSON-lines log."""

    def __init__(self, path: Path):
        self.path = path
        self.records: list[dict] = []

    def keep_first(self, n: int) -> None:
        """A resumed run: load the file's first ``n`` records and drop the rest (the steps after
        the checkpoint are run again)."""
        self.records = read(self.path)[:n] if self.path.exists() else []
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(rec) + "\n" for rec in self.records))
        tmp.replace(self.path)

    def write(self, record: dict) -> None:
        """Append one record and flush it to disk."""
        self.records.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def read(path: str | Path) -> list[dict]:
    """All records of a ``metrics.jsonl`` file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
