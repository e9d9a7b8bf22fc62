"""``streamrl report``: plots and ``report.md`` for one or several run folders. Being written."""

from __future__ import annotations

from pathlib import Path


def write_report(run_dirs: list[Path], out: Path | None = None) -> Path | None:
    """Write the plots and ``report.md`` (into ``out``, default the first run folder); returns
    the report's path."""
    return None
