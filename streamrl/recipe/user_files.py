"""Users' own Python files (a reward's functions, an agent's rollout): read and imported
where ``streamrl`` runs when the recipe is validated -- so a missing file, a syntax error or a
missing function is one line before any worker starts -- and their text shipped to the workers,
which import it again: the file only has to exist where ``streamrl`` runs."""

from __future__ import annotations

import importlib.util
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType


@dataclass
class _Loaded:
    """A user file: its text and the module it imports as."""

    source: str
    module: ModuleType


#: The largest user file of code read (16 MiB): a program is kilobytes; a file of gigabytes named
#: where code was meant would be read whole and compiled before anything said no.
MAX_SOURCE_BYTES = 16 * 2**20

# Validators of one recipe run separately for each field naming the same file; importing a file
# runs its top-level code, so do it once per version of the file.
_LOADED: dict[tuple[str, int, int], _Loaded] = {}


def _module_name(path: str) -> str:
    return f"streamrl_user_{Path(path).stem}_{zlib.crc32(path.encode()):08x}"


def exec_user_source(path: str, source: str) -> ModuleType:
    """Import ``source`` as the module of file ``path`` (registered in ``sys.modules``, as an
    import would, so dataclasses and pickling inside it work)."""
    name = _module_name(path)
    spec = importlib.util.spec_from_loader(name, loader=None, origin=path)
    module = importlib.util.module_from_spec(spec)
    module.__file__ = path
    sys.modules[name] = module
    try:
        exec(compile(source, path, "exec"), module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def load_user_file(path: str) -> _Loaded:
    """The file at ``path``, read and imported (``ValueError``: a one-line reason it cannot be)."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{'no such file' if not file.exists() else 'not a file'}: {file}")
    if file.suffix != ".py":  # (a dataset named where its code was meant: read whole, then run as code)
        raise ValueError(f"expected a Python file ending in .py, got {file.name}")
    stat = file.stat()
    if stat.st_size > MAX_SOURCE_BYTES:
        raise ValueError(f"it has {stat.st_size} bytes; a Python file of code is at most {MAX_SOURCE_BYTES}")
    key = (str(file), stat.st_mtime_ns, stat.st_size)
    if key not in _LOADED:
        try:  # (as Python reads a source file: UTF-8, or the encoding its coding line names)
            source = importlib.util.decode_source(file.read_bytes())
        except (OSError, UnicodeDecodeError, SyntaxError, LookupError) as exc:
            raise ValueError(f"cannot read it ({type(exc).__name__}: {exc})") from None
        try:
            module = exec_user_source(str(file), source)
        except SyntaxError as exc:
            raise ValueError(f"cannot import it: SyntaxError: {exc.msg} (line {exc.lineno})") from None
        except (Exception, SystemExit) as exc:  # (a script's own sys.exit() or argparse at its top level)
            raise ValueError(f"cannot import it: {type(exc).__name__}: {exc}") from None
        _LOADED[key] = _Loaded(source, module)
    return _LOADED[key]
