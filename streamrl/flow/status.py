"""``status.json`` in a run folder: is the run going, done, stopped or failed, and how to go on.

Written atomically (temporary file, then rename) at every state change, so a tool (or a person)
looking at ``runs/`` can tell a finished run from a crashed one without reading logs.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

FILE = "status.json"


def resume_command(run_dir: Path) -> str:
    """The command that continues the run in ``run_dir``."""
    return f"streamrl recipe resume {run_dir}"


def write(run_dir: Path, state: str, **fields) -> None:
    """Record ``state`` (running, completed, interrupted, failed) with details."""
    path = run_dir / FILE
    old = read(run_dir) if path.exists() else {}
    record = {**old, **fields, "state": state, "updated": time.strftime("%Y-%m-%dT%H:%M:%S")}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2))
    os.replace(tmp, path)


def read(run_dir: Path) -> dict:
    """The run folder's status record."""
    return json.loads((run_dir / FILE).read_text())
