"""Checkpoint folders of a run: the trainer's state and the controller's, together, at a step boundary.

``<run folder>/checkpoints/step-000040/`` holds ``trainer/`` (written by the trainer on its
worker), ``controller.json`` (the next step, the policy version, the metrics records so far),
the ranker's and the scheduler's state, and last ``manifest.json`` (each file's size and
SHA-256). It is built in a ``.tmp-`` folder and renamed once complete, so a crash mid-write
leaves the previous one newest. A resume checks the newest against its manifest and passes over
a damaged one for the one before (:func:`latest`); nothing in a checkpoint is unpickled with full
pickle. docs/architecture.md ("Failure containment, checkpoints and resume") says what is saved,
what is not, and why.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Callable

from distributed import Client, Future, wait

from streamrl.checkpoints import integrity
from streamrl.checkpoints.integrity import verify, write_manifest
from streamrl.errors import CheckpointFailed, RunFailed, RunWarning, UserError
from streamrl.on_worker import task_functions
from streamrl.on_worker.resident import ComponentError, ResidentLost

PREFIX = "step-"
DAMAGED = "damaged-"
"""Prefix a damaged checkpoint is set aside under once a run resumes from an older one
(:func:`set_aside`): kept for a look, no longer counted among the checkpoints."""


PASSED_OVER = "passed-over-"
"""Prefix a whole checkpoint newer than the one a run was resumed from (``--from``) is set aside
under: the resumed run writes those steps again."""


def folder(run_dir: Path) -> Path:
    """Where a run keeps its checkpoints."""
    return run_dir / "checkpoints"


def _all(run_dir: Path) -> list[Path]:
    # (``.tmp-`` folders are writes that never finished; ``damaged-`` ones were set aside; a
    # ``step-`` folder not named by its step is not one streamrl wrote)
    # (by the step's number: by name, step-1000000 came before step-999999)
    return sorted((p for p in folder(run_dir).glob(f"{PREFIX}*") if p.is_dir() and _step_of(p) is not None),
                  key=_step_of)


def _step_of(ckpt: Path) -> int | None:
    digits = ckpt.name.removeprefix(PREFIX)
    return int(digits) if digits.isascii() and digits.isdigit() else None  # ("²" is a digit to str, not to int)


def latest(run_dir: Path) -> Path | None:
    """The newest checkpoint of a run that verifies (:func:`verify`), or None. Each newer one
    that does not is passed over with a one-line warning (:class:`~streamrl.errors.RunWarning`)."""
    best, problems = usable(run_dir)
    for problem in problems:
        then = f"using {best.name}, the newest one that is" if best else "no older one is usable either"
        text = f"checkpoint {problem}; {then}"
        # once per run folder: a resume asks more than once, and the warnings module's memory
        # is wiped whenever an import changes its filters (keyed by the folder too: another
        # run's resume in the same process has its own checkpoints to warn about)
        key = (str(Path(run_dir).resolve()), text)
        if key not in _WARNED:
            _WARNED.add(key)
            warnings.warn(text, RunWarning, stacklevel=2)
    return best


_WARNED: set[tuple[str, str]] = set()


def usable(run_dir: Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint that verifies (or None), and what is wrong with each newer one
    (``"step-000040 is not usable: trainer/trainer.pt is 812 bytes, 5303 were written"``)."""
    problems = []
    for ckpt in reversed(_all(run_dir)):
        problem = verify(ckpt)
        if problem is None:
            return ckpt, problems
        problems.append(f"{ckpt.name} is not usable: {problem}")
    return None, problems


def named(run_dir: Path, name: str) -> Path:
    """The checkpoint ``name`` of a run (``step-000010``, ``step-10`` or ``10``), which must
    verify; a one-line :class:`UserError` names the checkpoints there are otherwise."""
    digits = name.removeprefix(PREFIX)
    ok = digits.isascii() and digits.isdigit() and len(digits) <= 12  # ("²" is a digit to str, not to int)
    found = next((c for c in _all(run_dir) if ok and int(c.name.removeprefix(PREFIX)) == int(digits)), None)
    if found is None:
        there = ", ".join(c.name for c in _all(run_dir)) or "none"
        raise UserError(f"--from {name}: no such checkpoint in {folder(run_dir)} (there are: {there})")
    problem = verify(found)
    if problem is not None:
        raise UserError(f"--from {name}: checkpoint {found.name} is not usable: {problem}")
    return found


def usable_all(run_dir: Path) -> list[Path]:
    """Every checkpoint of a run that verifies, oldest first."""
    return [c for c in _all(run_dir) if verify(c) is None]


def set_aside(run_dir: Path, resumed_from: Path) -> list[str]:
    """Rename every checkpoint newer than ``resumed_from`` out of the way: a resumed run writes
    those steps again, and they must neither stand in for them nor take the place of a good one
    among ``run.keep_checkpoints``. One that fails :func:`verify` becomes ``damaged-step-...``,
    a whole one (the run was resumed from an older one on purpose, ``--from``)
    ``passed-over-step-...``. Returns the new names."""
    moved = []
    for ckpt in _all(run_dir):
        if _step_of(ckpt) > _step_of(resumed_from):
            prefix = PASSED_OVER if verify(ckpt) is None else DAMAGED
            target, n = ckpt.with_name(prefix + ckpt.name), 1
            while target.exists():
                n += 1
                target = ckpt.with_name(f"{prefix}{ckpt.name}-{n}")
            os.replace(ckpt, target)
            moved.append(target.name)
    return moved


# -- writing -------------------------------------------------------------------------------------
def _no_space(exc: BaseException) -> bool:
    """A full disk somewhere in ``exc``'s chain (``ENOSPC``, or its text, which is what arrives
    from a worker when the error was re-raised there)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(exc) or "Disk quota exceeded" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _a_write_error(exc: BaseException) -> bool:
    """An error of the file system (rather than a bug): an ``OSError``, or torch's zip writer,
    which reports a failed write (a full disk among others) as a ``RuntimeError``."""
    text = str(exc)
    return (isinstance(exc, OSError) or _no_space(exc)
            or (isinstance(exc, RuntimeError) and ("PytorchStreamWriter" in text or "inline_container" in text)))


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def _failed_write(exc: Exception, final: Path, run_dir: Path) -> CheckpointFailed:
    """The one line a checkpoint that could not be written ends the run with."""
    where = folder(run_dir)
    try:
        left = shutil.disk_usage(where).free
        free = f"; {_gib(left)} free there now"
    except OSError:
        left, free = None, ""
    said = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
    older = _all(run_dir)
    # torch's zip writer reports a short write as "unexpected pos ...", not as ENOSPC: a disk with
    # less room than the last checkpoint took is the likelier news
    took = sum(f.stat().st_size for f in older[-1].rglob("*") if f.is_file()) if older else 0
    if _no_space(exc):
        cause = "no space left on device"
    elif left is not None and took > left:
        cause = f"the disk is full, or nearly (the last checkpoint took {_gib(took)}; {said})"
    else:
        cause = said
    older = ", the older checkpoints are kept" if older else ""
    return CheckpointFailed(f"checkpoint {final.name} could not be written to {where}: {cause}{free}; "
                            f"its partial folder was removed{older}")


def write(client: Client, train_pins: list[dict], after: Future | None, run_dir: Path, next_step: int,
          version: int, records: int, keep: int, trainer_id: str | dict | None = None,
          files: dict[str, bytes] | None = None, also: Callable[[Path], None] | None = None,
          prompt_order: dict | None = None) -> Path:
    """Write the checkpoint taken after step ``next_step - 1``; returns its folder. The trainer's
    part is written by the ranks in ``train_pins`` together (rank 0 alone unless sharded);
    ``files`` (name: bytes) go beside it (the dispatcher's and ranker's state); ``also(folder)``
    writes more into it (the other learners' states); ``prompt_order``: the recipe's settings
    that decide which prompts each step gets (a resume with others says so); ``manifest.json`` last. A write that fails on the file system (a full disk) raises
    :class:`~streamrl.errors.CheckpointFailed` once the partial folder is removed."""
    final = folder(run_dir) / f"{PREFIX}{next_step:06d}"
    tmp = folder(run_dir) / f".tmp-{PREFIX}{next_step:06d}"
    # every unfinished write, this step's and any a killed run left (each as big as a checkpoint)
    for stale in folder(run_dir).glob(f".tmp-{PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)
    saves: list[Future] = []
    try:
        tmp.mkdir(parents=True)
        stamp = time.time_ns()
        # (a fresh key: the same step written again -- a resumed run -- must not be answered with
        # the first write's finished task, which wrote into a folder that is gone)
        saves = [client.submit(task_functions.save_trainer_checkpoint, str(tmp / "trainer"), after=after,
                               trainer_id=trainer_id, key=f"checkpoint-{next_step}-{stamp}-{i}", pure=False, **pin)
                 for i, pin in enumerate(train_pins)]
        wait(saves)  # every rank done (or failed) before anything is removed under its feet
        client.gather(saves)
        for name, blob in (files or {}).items():
            (tmp / name).write_bytes(blob)
        if also is not None:
            also(tmp)
        (tmp / "controller.json").write_text(json.dumps(
            # ("manifest": a checkpoint found without its manifest was cut short, not written by
            # a streamrl from before manifests, which is read and checked without one)
            {"next_step": next_step, "policy_version": version, "records": records, "manifest": True,
             **({"prompt_order": prompt_order} if prompt_order is not None else {})}, indent=2))
        listed = write_manifest(tmp)
        sync_tree(tmp)
    except BaseException as exc:
        try:  # (a second Ctrl-C mid-write: no rank goes on writing into what is removed)
            client.cancel(saves)
        except Exception:
            pass
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, Exception) and not isinstance(exc, (ResidentLost, RunFailed)) and _a_write_error(exc):
            raise _failed_write(exc, final, run_dir) from None
        raise
    shutil.rmtree(final, ignore_errors=True)  # a resumed run writing the same step again
    os.replace(tmp, final)
    integrity.verified(final, listed)  # just hashed: no need to again
    try:
        _sync(final.parent)  # (the rename itself on disk before an older checkpoint goes)
    except OSError as exc:
        warnings.warn(RunWarning(f"checkpoint {final.name}: the checkpoints folder could not be synced to disk "
                                 f"({exc.strerror or type(exc).__name__}); the checkpoint before it is kept too"),
                      stacklevel=2)
        keep += 1  # (one more than asked, not every one: a folder that never syncs would fill the disk)
    for old in _all(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def sync_tree(root: Path) -> None:
    """Every file and folder under ``root`` (and ``root``) on disk, not only in the page cache:
    retention removes the older checkpoints right after the new one is renamed into place, and
    a power cut then found the new one's files empty with nothing older left to resume from."""
    for here, _, names in os.walk(root):
        for name in names:
            _sync(Path(here) / name)
        _sync(Path(here))


def _sync(path: Path) -> None:
    # (a read-only descriptor: fsync flushes a file's or a folder's data whoever wrote it)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):  # (a file system that cannot sync)
            raise
    finally:
        os.close(fd)


def read(checkpoint: Path) -> dict:
    """The controller's part of a checkpoint."""
    return json.loads((checkpoint / "controller.json").read_text())


def restore_trainer(client: Client, train_pins: list[dict], checkpoint: Path) -> None:
    """Load the trainer's part into the (freshly placed) trainer of every rank, all at once
    (sharded ranks read their shards together). A checkpoint that verified but cannot be
    loaded (made by another trainer set-up) stops the resume in one line."""
    stamp = time.time_ns()
    loads = [client.submit(task_functions.load_trainer_checkpoint, str(checkpoint / "trainer"),
                           key=f"restore-{checkpoint.name}-{stamp}-{i}", pure=False, **pin)
             for i, pin in enumerate(train_pins)]
    try:
        client.gather(loads)
    except (ResidentLost, ComponentError, RunFailed):
        raise
    except Exception as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise RunFailed(f"checkpoint {checkpoint.name}: the trainer could not load it ({type(exc).__name__}: "
                        f"{text[:300]}); was the run resumed with another trainer set-up (trainer.strategy, "
                        f"pools.train.workers, the algorithm)? Resume with the run's own, or move "
                        f"{checkpoint} aside to resume from the checkpoint before it") from None


def prompt_order(recipe) -> dict:
    """The recipe's settings that decide which prompts each step gets: the task's table, the
    prompts a step takes, the run's seed (a task's stream is drawn from them by step)."""
    return {"task": json.loads(json.dumps(recipe.task.model_dump(), default=str)),
            "prompts_per_step": recipe.trainer.prompts_per_step, "seed": recipe.run.seed}


def order_changes(saved: dict | None, now: dict) -> list[str]:
    """What differs between the prompt order a checkpoint was written under (``saved``; None: a
    checkpoint of an older streamrl, nothing to compare) and the resumed recipe's (``now``), as
    ``field: was -> is``."""
    if not saved:
        return []
    out = []
    for key in ("prompts_per_step", "seed"):
        if saved.get(key) != now.get(key):
            out.append(f"{'trainer.' if key == 'prompts_per_step' else 'run.'}{key}: {saved.get(key)} -> {now.get(key)}")
    was, is_ = saved.get("task") or {}, now.get("task") or {}
    for key in sorted(set(was) | set(is_)):
        if was.get(key) != is_.get(key):
            out.append(f"task.{key}: {str(was.get(key))[:60]} -> {str(is_.get(key))[:60]}")
    return out
