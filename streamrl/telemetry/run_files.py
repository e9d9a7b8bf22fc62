"""A run folder's files read as what they may be: written by hand, cut short, or not files at
all, and written without following what is there. Each read is bounded before anything is
parsed: a FIFO where a file goes would wait for ever, a link to /dev/zero never end, and a line
of gigabytes would be held whole. A file written over one that is a link replaces the link: a
run folder from elsewhere with ``report.md`` linked to ``~/.bashrc`` must not have it overwritten."""

from __future__ import annotations

import contextlib
import math
import os
import stat
import tempfile
from pathlib import Path


def finite_number(value) -> bool:
    """Whether a field read back from a run folder (a record of ``metrics.jsonl``, edited by hand
    or another program's) is a number that can be added and printed: not a bool, not NaN or
    infinite, not an integer of hundreds of digits (valid JSON, past any float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


#: The longest line of a ``metrics.jsonl`` read (a step's record with its sample log: megabytes
#: at most); a longer one is passed over as one not read.
MAX_LINE_CHARS = 64 << 20


def lines_of(path: str | Path, max_chars: int | None = None):
    """The non-blank lines of file ``path``, one at a time, each at most ``max_chars`` (default
    :data:`MAX_LINE_CHARS`); a longer one (a file of gigabytes without a newline) is passed over
    and yields None in its place, so a reader counts it as unreadable without holding it.
    OSError when it cannot be opened."""
    max_chars = max_chars or MAX_LINE_CHARS
    with open(path, errors="replace") as f:
        while line := f.readline(max_chars):
            if len(line) == max_chars and not line.endswith("\n"):
                while (rest := f.readline(max_chars)) and not rest.endswith("\n"):
                    pass
                yield None
            elif line.strip():
                yield line


#: The largest of a run folder's small files read (its recipe, status, learners): a few KB each.
SMALL_FILE_BYTES = 1 << 20


def small_text(path: Path, limit: int = SMALL_FILE_BYTES) -> str:
    """The text of a run folder's small file ``path``; OSError where it is not a regular file or
    is larger than ``limit`` (a FIFO there would wait for ever, a link to /dev/zero never end)."""
    if not path.is_file():
        raise OSError(f"{path.name} is not a file")
    with path.open("rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(f"{path.name} is larger than {limit} bytes")
    return data.decode(errors="replace")


def write_replacing(path: Path, data: bytes) -> None:
    """Write ``data`` as the file ``path``: into a new file beside it (created, never opened
    through a link), then renamed over it, so a link at ``path`` is replaced, not written
    through, and a reader never sees half of it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        # (mkstemp's file is the owner's alone: the mode the file had, else the umask's, as
        # open() would have made it -- a report others read stays readable)
        os.fchmod(fd, _mode_of(path))
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _mode_of(path: Path) -> int:
    """The permission bits of ``path`` where it is a regular file (not through a link), else
    those a new file gets under this process's umask."""
    try:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode):
            return stat.S_IMODE(st.st_mode)
    except OSError:
        pass
    return 0o666 & ~_umask()


def _umask() -> int:
    # (read, not set and set back: os.umask changes it for every thread meanwhile)
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022
