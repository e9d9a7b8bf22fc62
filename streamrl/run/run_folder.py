"""A run's folder: ``runs/<name>-<time>/`` with ``recipe.toml``, ``status.json``,
``metrics.jsonl``, ``checkpoints/`` and ``policy/``, and the metric sinks that mirror the metrics.

:class:`RunFolder` is the one object that reads and writes them, so the runner says what
happened (``mark``, ``record``) and never where it goes. ``status.json`` is written atomically
(temporary file, then rename) at every state change, so a tool (or a person) looking at
``runs/`` can tell a finished run from a crashed one without reading logs.

A run folder is its owner's alone (mode 0o700, set when it is made and again when a run resumes
in it), which covers everything below it: checkpoints (which a resume loads), the recipe, the
metrics. ``status.json`` is created 0o600 on top of that, since it is the file tools are pointed
at (and copied around). The process umask is left alone: other files the user writes are theirs.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
import warnings
from pathlib import Path

from streamrl.errors import NonFiniteStep, RunStopped, RunWarning, UserError
from streamrl.checkpoints import folders
from streamrl.recipe.recipe import LoadedRecipe, load_recipe, to_toml
from streamrl.telemetry.metrics import MetricsLog
from streamrl.telemetry.text import message_line

STATUS = "status.json"
LOCK = ".lock"
OWNER_ONLY = 0o700
"""A run folder's mode: its owner reads, writes and enters it; nobody else."""


class RunFolder:
    """The files of one run; see the module docstring."""

    def __init__(self, path: Path):
        """An existing folder at ``path`` (:meth:`create` makes a new one)."""
        self.path = Path(path).resolve()
        self.metrics = MetricsLog(self.path / "metrics.jsonl")
        """``metrics.jsonl``; :meth:`open` loads the records a resumed run keeps."""
        self.sinks: list = []
        self._lock_fd: int | None = None

    def lock(self) -> None:
        """Hold the folder for this process (an exclusive ``flock`` on ``.lock``, let go by
        :meth:`unlock` or the process's end, a kill -9 included): a second run or resume of it
        meanwhile is one line, not two writers renaming and rotating each other's checkpoints."""
        try:
            fd = os.open(self.path / LOCK, os.O_WRONLY | os.O_CREAT, 0o600)
        except OSError as exc:
            raise UserError(f"{self.path}: cannot be written ({exc.strerror}); a run needs its folder writable") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            try:
                state = self.status()
            except UserError:  # (not written yet, or damaged: the line says less)
                state = {}
            who = f" (pid {state['pid']} on {state.get('host', 'this machine')})" if "pid" in state else ""
            raise UserError(f"{self.path}: another streamrl command is running this run{who}; one at a time -- "
                            "wait for it, or stop it (Ctrl-C)") from None
        self._lock_fd = fd

    def unlock(self) -> None:
        """Let go of :meth:`lock`."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # (closing the descriptor releases the flock)
            self._lock_fd = None

    @classmethod
    def create(cls, loaded: LoadedRecipe) -> "RunFolder":
        """``<run.out_dir>/<run.name>-<timestamp>`` with the resolved recipe in it."""
        r = loaded.recipe
        stamp = time.strftime("%Y%m%d-%H%M%S")
        out = Path(r.run.out_dir)
        path, n = out / f"{r.run.name}-{stamp}", 1
        try:
            out.mkdir(parents=True, exist_ok=True)
            while True:  # (made, not looked for: two runs of one name started in the same second)
                try:
                    path.mkdir()
                    break
                except FileExistsError:
                    if n >= 1000:  # (not a race: something there refuses every name)
                        raise
                    n += 1
                    path = out / f"{r.run.name}-{stamp}-{n}"
            os.chmod(path, OWNER_ONLY)  # (mkdir's mode is cut by the umask; chmod's is not)
            (path / "recipe.toml").write_text(to_toml(r))
        except OSError as exc:
            raise UserError(f"run.out_dir: cannot create a run folder in {r.run.out_dir!r} ({exc.strerror})") from None
        return cls(path)

    @classmethod
    def for_resume(cls, path: str | Path, overrides: list[str] = ()) -> tuple[LoadedRecipe, "RunFolder"]:
        """The folder of a stopped run and the recipe it was started with (``--set`` overrides
        on top); relative paths keep resolving against the original recipe's folder."""
        folder = cls(path)
        where = folder.path
        if not cls.is_run(where):
            raise UserError(f"{where}: not a run folder (expected status.json and recipe.toml in it)")
        if folder.latest_checkpoint() is None:
            _, problems = folders.usable(where)
            if problems:  # (each was warned about just now, too)
                raise UserError(f"{where}: no usable checkpoint to resume from ({'; '.join(problems)})")
            raise UserError(f"{where}: no checkpoint to resume from (the run stopped before its first one)")
        state = folder.status()
        # (a pid means something only on the host that wrote it: resumed elsewhere, say a
        # cluster's other node, an unrelated process there may have that number)
        here = state.get("host") in (None, socket.gethostname())
        if state["state"] in ("starting", "running") and here and _alive(state.get("pid")):
            raise UserError(f"{where}: the run is still going (pid {state['pid']}); stop it first (Ctrl-C)")
        return folder.recipe(overrides), folder

    @staticmethod
    def is_run(path: str | Path) -> bool:
        """Whether ``path`` is a run folder (it has status.json and recipe.toml)."""
        return (Path(path) / STATUS).is_file() and (Path(path) / "recipe.toml").is_file()

    def recipe(self, overrides: list[str] = ()) -> LoadedRecipe:
        """The recipe the run was started with (``--set`` overrides on top); relative paths keep
        resolving against the original recipe's folder."""
        loaded = load_recipe(self.path / "recipe.toml", overrides)
        original = self.status().get("recipe_file", str(self.path / "recipe.toml"))
        return LoadedRecipe(loaded.recipe, Path(original))

    # -- status.json --------------------------------------------------------------------------
    def status(self) -> dict:
        """The status record (``state``: starting, running, completed, interrupted, failed); a
        file that is not one (emptied, edited, damaged) is a one-line :class:`UserError`."""
        try:
            data = json.loads((self.path / STATUS).read_text())
        except (OSError, ValueError, RecursionError) as exc:
            raise UserError(f"{self.path / STATUS}: cannot be read ({type(exc).__name__}); expected the run's "
                            "status record") from None
        if not isinstance(data, dict) or not isinstance(data.get("state"), str):
            raise UserError(f"{self.path / STATUS}: expected a JSON object with a 'state' (the run's status record)")
        return data

    def mark(self, state: str, **fields) -> None:
        """Record ``state`` with details, keeping the fields written before -- but an earlier
        attempt's ``error`` and ``resume`` once the run goes on or ends well (a resumed run that
        completes is not a failed one)."""
        path = self.path / STATUS
        old = self.status() if path.exists() else {}
        if state in ("starting", "running", "completed"):
            old = {k: v for k, v in old.items() if k not in ("error", "resume")}
        record = {**old, **fields, "state": state, "updated": time.strftime("%Y-%m-%dT%H:%M:%S")}
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            os.fchmod(fd, 0o600)  # (a .tmp left by an older streamrl keeps its mode through O_CREAT)
            f.write(json.dumps(record, indent=2))
        os.replace(tmp, path)

    def resume_command(self) -> str:
        """The command that continues this run."""
        return f"streamrl recipe resume {self.path}"

    def go_on(self) -> str:
        """How to go on after the run stopped: the newest checkpoint and the command that resumes
        from it, or that there is none yet."""
        ckpt = self.latest_checkpoint()
        return (f"resume from {ckpt.name} with: {self.resume_command()}" if ckpt is not None
                else "it had no checkpoint yet (run.checkpoint_every)")

    def failed(self, exc: BaseException) -> None:
        """Mark the run failed (interrupted for Ctrl-C), with the error and, if there is a
        checkpoint, how to go on. A :class:`~streamrl.errors.RunStopped` (raised where the run
        folder is not known) gets the last checkpoint and the resume command added to its message."""
        ckpt = self.latest_checkpoint()
        if isinstance(exc, RunStopped):
            where = (f"the last checkpoint is {ckpt.name} (resume with: {self.resume_command()}, "
                     "--set to change the recipe)" if ckpt is not None
                     else "no checkpoint was written yet (run.checkpoint_every)")
            # (only for a refused update: it verifies, hashes included, every older checkpoint)
            earlier = ([c for c in folders.usable_all(self.path) if c.name < ckpt.name]
                       if isinstance(exc, NonFiniteStep) and ckpt is not None else [])
            if earlier:
                # the newest checkpoint's weights made this step: if an earlier update went bad
                # without a sign, so do they, and every resume from them fails the same way
                where += (f"; if a resume from it fails the same way, its weights are already bad: resume from an "
                          f"earlier one, {earlier[-1].name} ({self.resume_command()} --from {earlier[-1].name})")
            exc.resume_from(where)
        fields = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        if ckpt is not None:
            fields["resume"] = self.resume_command()
        self.mark("interrupted" if isinstance(exc, KeyboardInterrupt) else "failed", **fields)

    # -- checkpoints ----------------------------------------------------------------------------
    def latest_checkpoint(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        return folders.latest(self.path)

    # -- metrics and sinks ------------------------------------------------------------------------
    def open(self, loaded: LoadedRecipe, sinks: list, resumed: dict | None, checkpoint: Path | None = None) -> None:
        """Start (or go on with) the run: the recipe as run, ``status.json`` starting, the
        metrics a resumed run keeps (``resumed``: the state of ``checkpoint``, default the newest
        usable one; the steps after it are run again), and the metric ``sinks`` opened on this folder."""
        if resumed is not None:  # the recipe as resumed (e.g. more steps) is the one to resume from next time
            _owner_only(self.path)  # (a folder an older streamrl made, readable by others)
            (self.path / "recipe.toml").write_text(to_toml(loaded.recipe))
            # (a checkpoint of an older streamrl says nothing of its records: all are kept)
            self.metrics.keep_first(resumed.get("records"))
            ckpt = checkpoint or self.latest_checkpoint()
            if ckpt is not None:  # newer ones (damaged, or passed over): out of the way of the steps run again
                for name in folders.set_aside(self.path, ckpt):
                    old = name.removeprefix(folders.DAMAGED).removeprefix(folders.PASSED_OVER)
                    warnings.warn(f"checkpoints/{old} is kept as {name} (the resumed run writes that step again)",
                                  RunWarning, stacklevel=2)
        # (the host beside the pid: a command on the same machine can tell a killed run from a live one)
        self.mark("starting", recipe_file=str(loaded.file.resolve()), steps=loaded.recipe.run.steps, pid=os.getpid(),
                  host=socket.gethostname())
        self.sinks = []
        for sink in sinks:  # (a plugin's: one that cannot start is one line, and closes those before it)
            try:
                sink.open(self.path)
            except UserError:  # (the sink's own one line: a tracker without an account)
                self.close()
                raise
            except (Exception, SystemExit) as exc:  # (a plugin's sys.exit() is its failure, not the command's end)
                self.close()
                raise UserError(f"metrics: the {type(sink).__name__} sink could not start: {type(exc).__name__}: "
                                f"{message_line(exc)}") from None
            self.sinks.append(sink)

    @property
    def records(self) -> list[dict]:
        """Every step's record of the run so far."""
        return self.metrics.records

    def record(self, m: dict) -> None:
        """Append a step's record to ``metrics.jsonl`` (the sinks are observers of it:
        ``run/observers.py``)."""
        self.metrics.write(m)

    def close(self) -> None:
        """Close the sinks that opened. One that fails to close is a warning: the run's own
        outcome (and the cleanup after this) is what the user must see."""
        for sink in self.sinks:
            try:
                sink.close()
            except (Exception, SystemExit) as exc:
                warnings.warn(f"metrics: the {type(sink).__name__} sink failed to close: {type(exc).__name__}: "
                              f"{message_line(exc)}", RunWarning, stacklevel=2)
        self.sinks = []


def _owner_only(path: Path) -> None:
    """Make ``path`` the owner's alone (:data:`OWNER_ONLY`), when this user may (a folder of
    someone else's is left as it is: the resume then reads what its owner lets it read)."""
    try:
        os.chmod(path, OWNER_ONLY)
    except PermissionError:
        pass


def _alive(pid: int | None) -> bool:
    """Is process ``pid`` running on this machine (a run killed with -9 leaves ``running``)?"""
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < 2**31:  # (an edited status.json)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
