"""``csv`` metric sink: the step records as ``metrics.csv`` (for spreadsheets and pandas)."""

from __future__ import annotations

import csv
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from streamrl.api import MetricSink
from streamrl.telemetry.metrics import read


class CSVSinkConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    file: str = Field("metrics.csv", pattern=r"^\w[\w.-]{0,123}\.csv$")
    """File name inside the run folder: a bare name ending in ``.csv`` (a path could write outside
    the folder, and a name of the folder's own files -- ``metrics.jsonl`` -- would empty them as
    the sink opens)."""


class CSVSink(MetricSink):
    """Writes one row per step; the columns are the first record's keys."""

    def __init__(self, config: CSVSinkConfig):
        self.config = config
        self._file = None
        self._writer = None

    def open(self, run_dir: Path) -> None:
        """Create the file in ``run_dir``, with the rows of the steps the run already has: a
        resumed run's ``metrics.jsonl`` holds the steps up to its checkpoint (those after it
        are run again), and the file is written anew from them, not emptied."""
        # (a plugin's text may hold a lone surrogate: written escaped, not a failed sink; a new
        # file, so a link left where it goes is replaced, not written through)
        path = Path(run_dir) / self.config.file
        path.unlink(missing_ok=True)
        self._file = path.open("x", newline="", encoding="utf-8", errors="backslashreplace")
        kept = Path(run_dir) / "metrics.jsonl"
        if kept.exists():
            for record in read(kept):
                self.write(record)

    def write(self, record: dict) -> None:
        """Append one step's record (keys unseen in the first record are ignored)."""
        if self._writer is None:
            # (the per-sample log is no column: a Python repr of every sample, model text included,
            # past a spreadsheet's cell limit)
            self._writer = csv.DictWriter(self._file, fieldnames=[k for k in record if k != "sample_log"],
                                          extrasaction="ignore")
            self._writer.writeheader()
        self._writer.writerow(record)
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        if self._file is not None:
            self._file.close()
