"""Observing a run: the ``metric_sink`` contract.

Plugins import these from ``streamrl.api``."""

from __future__ import annotations

from pathlib import Path


class MetricSink:
    """Receives every step's metrics record in the ``streamrl`` process (``metrics.jsonl`` is
    always written besides). A sink that raises is reported and dropped; the run goes on."""

    def open(self, run_dir: Path) -> None:
        """Called once before the first step with the run folder."""

    def write(self, record: dict) -> None:
        """One step's record (the same dict as a ``metrics.jsonl`` line)."""
        raise NotImplementedError

    def close(self) -> None:
        """Called once at the end of the run, also after a failure."""
