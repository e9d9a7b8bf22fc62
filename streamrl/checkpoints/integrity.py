"""Whether a checkpoint folder is whole and holds what streamrl writes there.

A checkpoint's ``manifest.json``, written last, lists every file with its size and SHA-256: a
file missing, cut short or changed since is found before a resume reads it. What a resume reads
is also checked for what it means: the JSON files for the fields and types a checkpoint writes,
every torch file for loading without running code (``weights_only``), the DCP metadata with a
restricted reader, and the byte ranges it names inside their files. A damaged checkpoint is one
phrase naming the file, never a traceback or an unpickled object.
"""

from __future__ import annotations

import hashlib
import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

MANIFEST = "manifest.json"
"""The checkpoint's table of contents (``{"files": {path: {"bytes": n, "sha256": hex}}}``), written last."""

#: The largest manifest read: a checkpoint lists tens of files (a few KB); one of megabytes was
#: not written by streamrl.
MAX_MANIFEST_BYTES = 16 * 2**20

#: The largest JSON file of a checkpoint read (the served traffic waiting to be trained is the
#: biggest, megabytes at most).
MAX_JSON_BYTES = 256 * 2**20

_VERIFIED: dict[str, tuple] = {}
"""Checkpoint folder -> the sizes and times of its files when they last verified: the run
checks the one it resumes from more than once, and need not hash it again."""


def _signature(ckpt: Path, names) -> tuple:
    stats = [(name, (ckpt / name).stat()) for name in sorted(names)]
    return tuple((name, st.st_size, st.st_mtime_ns) for name, st in stats)


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _hashes(paths: list[Path]) -> list[str]:
    # (hashlib lets go of the GIL while it hashes: the files of a sharded trainer in parallel)
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(paths)))) as pool:
        return list(pool.map(_sha256, paths))


def verify(ckpt: Path) -> str | None:
    """What is wrong with checkpoint folder ``ckpt`` (one phrase), or None when it is whole:
    every file its manifest lists is there with the size and SHA-256 it was written with; a
    checkpoint without a manifest (written by an older streamrl) is checked by reading it."""
    manifest = ckpt / MANIFEST
    if not manifest.exists():
        return _verify_legacy(ckpt)
    try:
        if manifest.stat().st_size > MAX_MANIFEST_BYTES:
            raise ValueError("too large")
        files = json.loads(manifest.read_text())["files"]
        wanted = {str(name): (int(f["bytes"]), str(f["sha256"])) for name, f in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError) as exc:
        return f"{MANIFEST} cannot be read ({type(exc).__name__})"
    # a name the manifest lists is a file of the checkpoint's own: never a path out of it (a
    # manifest edited to name /dev/zero or ../../a-large-file would have it read and hashed)
    outside = next((n for n in sorted(wanted) if PurePosixPath(n).is_absolute() or ".." in PurePosixPath(n).parts
                    or "\\" in n), None)
    if outside is not None:
        return f"{MANIFEST} names {outside!r}, not a file inside the checkpoint"
    # what a resume reads and the manifest does not list was put there after it was written (a
    # learners.json copied in from another run would be acted on): not this checkpoint's
    extra = next((n for n in JSON_FILES if n not in wanted and ((ckpt / n).exists() or (ckpt / n).is_symlink())), None)
    if extra is not None:
        return f"{extra} is not among the files its {MANIFEST} lists (it was added after the checkpoint was written)"
    for name, (size, _) in sorted(wanted.items()):
        path = ckpt / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} is {path.stat().st_size} bytes, {size} were written"
    try:
        signature = _signature(ckpt, [*wanted, MANIFEST])
    except OSError as exc:
        return f"its files cannot be read ({exc.strerror})"
    if _VERIFIED.get(str(ckpt)) == signature:
        return None
    names = sorted(wanted)
    try:
        digests = _hashes([ckpt / n for n in names])
    except OSError as exc:
        return f"its files cannot be read ({exc.strerror})"
    for name, digest in zip(names, digests):
        if digest != wanted[name][1]:
            return f"{name} does not hold what was written (its SHA-256 differs)"
    problem = refused(ckpt) or json_problem(ckpt)
    if problem:
        return problem
    _VERIFIED[str(ckpt)] = signature
    return None


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _controller_problem(d) -> str | None:
    if not isinstance(d, dict):
        return f"a {type(d).__name__}, not an object"
    for key in ("next_step", "policy_version", "records"):
        if (key in d or key != "records") and not _count(d.get(key)):
            return f"{key} is {d.get(key)!r}, not a count"
    return None


def _dispatch_problem(d) -> str | None:
    if not isinstance(d, dict):
        return f"a {type(d).__name__}, not an object"
    lengths = d.get("observed_lengths")
    if not isinstance(lengths, list) or not all(_count(x) for x in lengths):
        return "observed_lengths is not a list of counts"
    if not isinstance(d.get("prompt_tokens"), (int, float)):
        return f"prompt_tokens is {d.get('prompt_tokens')!r}, not a number"
    if "scheduler" in d and not isinstance(d["scheduler"], dict):
        return "scheduler is not an object"
    return None


#: A side learner's name, as the recipe's ``[[learners]]`` allow it (it becomes a folder's name).
_LEARNER_NAME = re.compile(r"[a-z0-9][a-z0-9_]{0,31}")
_LEARNER_START = re.compile(r"learners/start-[a-z0-9][a-z0-9_]{0,31}-[0-9]{1,12}")


def _learners_problem(d) -> str | None:
    learners = d.get("learners") if isinstance(d, dict) else None
    if not isinstance(learners, dict):
        return "learners is not an object"
    for name, entry in learners.items():
        if not _LEARNER_NAME.fullmatch(name):
            return f"{name[:40]!r} is not a learner's name"
        if not (isinstance(entry, dict) and isinstance(entry.get("table"), dict)
                and isinstance(entry.get("summary"), dict) and isinstance(entry.get("has_state"), bool)):
            return f"learner {name!r} is not a table, a summary and has_state"
        for key in ("steps_trained", "skipped_steps", "samples_trained"):
            if key in entry["summary"] and not _count(entry["summary"][key]):
                return f"learner {name!r}'s {key} is not a count"
        # the folder it was built from, in the run's folder (a path elsewhere would build the
        # learner, and its reference policy, from any model of the worker's disk)
        start = entry.get("start")
        if start is not None and not (isinstance(start, str) and _LEARNER_START.fullmatch(start)):
            return f"learner {name!r}'s start is not a folder of the run's learners/ ({str(start)[:80]!r})"
    return None


def _traffic_problem(d) -> str | None:
    groups = d.get("groups") if isinstance(d, dict) else None
    if not isinstance(groups, list):
        return "groups is not a list"
    for g in groups:
        if not (isinstance(g, list) and g and all(isinstance(s, dict) and isinstance(s.get("prompt"), dict) for s in g)):
            return "a group is not a list of samples, each with its prompt"
    return None


def _eval_problem(d) -> str | None:
    pending = d.get("pending") if isinstance(d, dict) else None
    if not isinstance(pending, list) or not all(_count(v) for v in pending):
        return "pending is not a list of policy versions"
    return None


#: What a resume reads from each JSON file of a checkpoint: what is wrong with the parsed value, or None.
JSON_FILES = {"controller.json": _controller_problem, "dispatch.json": _dispatch_problem,
              "learners.json": _learners_problem, "serve_traffic.json": _traffic_problem,
              "eval.json": _eval_problem}


def json_problem(ckpt: Path) -> str | None:
    """What is wrong with the JSON files of checkpoint ``ckpt`` that a resume reads (one phrase),
    or None. A manifest says the bytes are the ones listed; this says they are what streamrl
    writes there -- a file damaged before its manifest was written, or rewritten together with
    it, is refused in one line like any damaged checkpoint, not read into a traceback."""
    for name, fits in JSON_FILES.items():
        path = ckpt / name
        if not path.exists() and not path.is_symlink():
            if name == "controller.json":
                return "controller.json is missing"
            continue
        # (a file, and bounded before it is parsed: a FIFO waits for ever, a link to /dev/zero never ends)
        if path.is_symlink() or not path.is_file():
            return f"{name} is not a file"
        if path.stat().st_size > MAX_JSON_BYTES:
            return f"{name} is {path.stat().st_size} bytes; a checkpoint writes at most {MAX_JSON_BYTES}"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError) as exc:  # (JSON nested past the parser's reach)
            return f"{name} cannot be read ({type(exc).__name__})"
        wrong = fits(data)
        if wrong:
            return f"{name} does not hold what a checkpoint writes there ({wrong})"
    return None


def refused(ckpt: Path) -> str | None:
    """The first file of checkpoint ``ckpt`` that cannot be read without running code (one phrase
    naming it, relative to ``ckpt``), or None: every ``*.pt`` must load with
    ``weights_only=True`` and every DCP ``.metadata`` with the restricted reader."""
    from streamrl.training.trainer_state import RefusedGlobal, read_metadata, unsafe_torch_file

    for path in sorted(ckpt.rglob("*.pt")):
        problem = unsafe_torch_file(path)
        if problem:
            return f"{path.parent.relative_to(ckpt).as_posix()}/{problem}".removeprefix("./")
    for path in sorted(ckpt.rglob(".metadata")):
        name = path.relative_to(ckpt).as_posix()
        try:
            metadata = read_metadata(path.parent)
        except RefusedGlobal as exc:
            return (f"{name} names something DCP's metadata never holds; it was refused, since loading it "
                    f"could run code ({str(exc)[:200]})")
        except Exception as exc:
            return f"{name} cannot be read ({type(exc).__name__})"
        problem = _ranges_problem(metadata, path.parent, ckpt)
        if problem:
            return problem
    return None


def _ranges_problem(metadata, folder: Path, ckpt: Path) -> str | None:
    """Every file DCP's ``metadata`` of ``folder`` names is a file of that folder (DCP reads
    ``folder / relative_path``: an absolute path or a ``..`` would have any file of the worker
    read into the weights, and served), and every byte range it names lies inside it."""
    where = folder.relative_to(ckpt).as_posix()
    ends: dict[str, int] = {}
    try:
        items = list((metadata.storage_data or {}).values())
    except (AttributeError, TypeError):
        return f"{where}/.metadata has no table of the files it was written to"
    for info in items:
        name, offset, length = (getattr(info, k, None) for k in ("relative_path", "offset", "length"))
        if not isinstance(name, str) or not _count(offset) or not _count(length):
            return f"{where}/.metadata names a file or a byte range that is not one ({str(name)[:80]!r})"
        parts = PurePosixPath(name).parts
        if not name or PurePosixPath(name).is_absolute() or ".." in parts or "\\" in name or len(parts) != 1:
            return f"{where}/.metadata names {name[:120]!r}, not a file inside its folder"
        ends[name] = max(ends.get(name, 0), offset + length)
    for name, end in sorted(ends.items()):
        path = folder / name
        if path.is_symlink() or not path.is_file():
            return f"{where}/{name} is missing" if not path.is_symlink() else f"{where}/{name} is a link, not a file"
        if path.stat().st_size < end:
            return f"{where}/{name} is {path.stat().st_size} bytes, its metadata needs {end}"
    return None


def _verify_legacy(ckpt: Path) -> str | None:
    """A checkpoint without a manifest: everything in it that can be read is read (never
    with Python's full pickle: :func:`refused`)."""
    problem = json_problem(ckpt)
    if problem:
        return problem
    if json.loads((ckpt / "controller.json").read_text()).get("manifest") is True:
        return f"{MANIFEST} is missing (the checkpoint was written with one: a copy cut short?)"
    trainer = ckpt / "trainer"
    if not trainer.is_dir() or not any(trainer.iterdir()):
        # (an interrupted copy: without it a resume would blame the trainer's set-up rather than
        # pass over to the checkpoint before)
        return "trainer/ is missing or empty"
    if (trainer / "trainer.pt").exists() or (trainer / "dcp").exists():
        if not (trainer / "trainer.pt").exists():
            return "trainer/trainer.pt is missing"
        problem = refused(ckpt) or _dcp_problem(trainer / "dcp")
        if problem:
            return problem
    return None


def _dcp_problem(dcp: Path) -> str | None:
    """The DCP metadata of folder ``dcp`` is there and readable (what it names: :func:`refused`)."""
    from streamrl.training.trainer_state import read_metadata

    try:
        read_metadata(dcp)
    except Exception as exc:
        return f"trainer/dcp/.metadata cannot be read ({type(exc).__name__})"
    return None


def write_manifest(tmp: Path) -> list[str]:
    """List every file under ``tmp`` with its size and SHA-256 in ``manifest.json``, last;
    returns the names listed."""
    paths = sorted(p for p in tmp.rglob("*") if p.is_file() and p.name != MANIFEST)
    names = [p.relative_to(tmp).as_posix() for p in paths]
    files = {n: {"bytes": p.stat().st_size, "sha256": h} for n, p, h in zip(names, paths, _hashes(paths))}
    (tmp / MANIFEST).write_text(json.dumps({"files": files}, indent=1))
    return names


def verified(ckpt: Path, names: list[str]) -> None:
    """Remember checkpoint ``ckpt`` as whole, its files ``names`` (and the manifest) as they are
    now: it was just written and hashed, so :func:`verify` need not hash it again."""
    _VERIFIED[str(ckpt)] = _signature(ckpt, [*names, MANIFEST])
