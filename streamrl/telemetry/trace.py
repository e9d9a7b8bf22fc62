"""``trace.json``: the run as a Chrome trace (Perfetto opens it). Being written; see TraceRecorder."""

from __future__ import annotations

from pathlib import Path


class TraceRecorder:
    """Collects the timeline of a run step by step and writes ``trace.json`` at the end."""

    def __init__(self, client, run_dir: Path):
        self.client, self.run_dir = client, Path(run_dir)

    def step(self, record: dict) -> None:
        """Called after each step's record is written."""

    def close(self) -> Path | None:
        """Write ``trace.json``; returns its path (None if nothing was recorded)."""
        return None
