"""One pluggy ``PluginManager("streamrl")`` and the registry of components it collects.

Built-ins are registered first, exactly like third-party plugins; then every installed
distribution's ``streamrl`` entry point is imported. A plugin that fails to import is reported by
name with one warning and the others still load. Two components of one kind with one name are
both listed; only a recipe naming that component fails. ``STREAMRL_DISABLE_PLUGINS=a,b`` skips plugins (entry-point names or module names).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import importlib.util
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import pluggy

from streamrl.plugins import hookspecs
from streamrl.api import KINDS, Component
from streamrl.errors import PluginWarning, UserError
from streamrl.recipe.paths import home, resolved
from streamrl.recipe.user_files import MAX_SOURCE_BYTES
from streamrl.telemetry.text import error_line, message_line, one_line

__all__ = ["KINDS", "Component", "Registry", "build_registry", "load_local_module"]

class Registry:
    """The components of every loaded plugin, by kind and name.

    A name registered twice within a kind is kept with both origins: ``streamrl plugins list``
    shows both, and only a recipe that names it fails (:meth:`get`), naming both plugins.
    """

    def __init__(self, pm: pluggy.PluginManager, origins: dict[str, tuple[str, str]] | None = None):
        self.pm = pm
        #: plugin name -> (distribution or file, version) for ``streamrl plugins list``
        self.origins = origins or {}
        #: every registration, in load order (duplicates included)
        self.entries: list[Component] = []
        self.components: dict[str, dict[str, list[Component]]] = {k: {} for k in KINDS}
        for kind, hook_name in KINDS.items():
            for impl in getattr(pm.hook, hook_name).get_hookimpls():
                plugin_name = pm.get_name(impl.plugin) or repr(impl.plugin)
                try:
                    comps = list(impl.function() or [])
                    for comp in comps:
                        _check_component(comp, kind, hook_name)
                except (Exception, SystemExit) as exc:  # one bad plugin must not take the others down
                    warnings.warn(f"plugin {plugin_name!r}: {hook_name} failed and is skipped: "
                                  f"{error_line(exc, 300)}", PluginWarning, stacklevel=2)
                    continue
                for comp in comps:
                    entry = Component(comp.kind, comp.name, comp.config, comp.factory, plugin_name)
                    self.entries.append(entry)
                    self.components[kind].setdefault(comp.name, []).append(entry)

    def get(self, kind: str, name: str, path: str) -> Component:
        """The component ``name`` of ``kind``; ``path`` is the TOML path named in the error."""
        if not isinstance(name, str):
            raise UserError(f"{path}: expected the name of a{'n' * (kind[0] in 'aeiou')} {kind} (a string), "
                            f"got {'nothing' if name is None else type(name).__name__}")
        found = self.components[kind].get(name)
        if not found:
            names = sorted(self.components[kind])
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UserError(f"{path}: unknown {kind} {name!r} (available: {', '.join(names) or 'none'}){hint}")
        if len(found) > 1:
            by = " and ".join(c.plugin for c in found)
            raise UserError(f"{path}: {kind} {name!r} is registered twice, by {by}; uninstall one or skip "
                            f"it with STREAMRL_DISABLE_PLUGINS")
        return found[0]


def _check_component(comp: Any, kind: str, hook_name: str) -> None:
    """A registration is a :class:`Component` of the hook's kind whose name is text, whose
    config is a pydantic model and whose factory can be called: what the recipe's checks and
    ``streamrl plugins list`` rely on (``TypeError`` naming what is wrong)."""
    from pydantic import BaseModel

    if not isinstance(comp, Component) or comp.kind != kind:
        raise TypeError(f"{hook_name} must return Component(kind={kind!r}, ...) entries, got {comp!r}")
    if not isinstance(comp.name, str) or not comp.name:
        raise TypeError(f"{hook_name}: a component's name must be a non-empty string, got {comp.name!r}")
    if not (isinstance(comp.config, type) and issubclass(comp.config, BaseModel)):
        raise TypeError(f"{hook_name}: {kind} {comp.name!r}'s config must be a pydantic model class, "
                        f"got {comp.config!r}")
    if not callable(comp.factory):
        raise TypeError(f"{hook_name}: {kind} {comp.name!r}'s factory must be callable, got {comp.factory!r}")


def _disabled() -> set[str]:
    return {n.strip() for n in os.environ.get("STREAMRL_DISABLE_PLUGINS", "").split(",") if n.strip()}


def _load_entrypoints(pm: pluggy.PluginManager, disabled: set[str], origins: dict) -> None:
    # pluggy's load_setuptools_entrypoints stops at the first broken plugin; we report and go on.
    for ep in importlib.metadata.entry_points(group="streamrl"):
        if ep.name in disabled or pm.get_plugin(ep.name) is not None:
            continue
        dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist else ep.value
        try:
            module = ep.load()
            pm.register(module, name=ep.name)
            origins[ep.name] = (ep.dist.name, ep.dist.version) if ep.dist else (ep.value, "")
        except (Exception, SystemExit) as exc:  # a broken plugin must not take the others down (nor exit)
            warnings.warn(f"plugin {ep.name!r} from {one_line(dist, 120)} failed to load and is skipped: "
                          f"{error_line(exc, 300)}", PluginWarning, stacklevel=2)


def _local_file(path: str | Path, base: Path) -> Path:
    # (relative to the recipe's folder; ~ the user's home)
    try:
        return resolved(base / home(str(path)))
    except ValueError as exc:
        raise UserError(f"plugins.modules: {exc}") from None


def load_local_module(path: str | Path, base: Path) -> Any:
    """Import a plugin module from a file path (relative to ``base``, the recipe's folder)."""
    file = _local_file(path, base)
    if not file.is_file():
        raise UserError(f"plugins.modules: file {str(path)!r} not found (looked at {file})")
    size = file.stat().st_size
    if size > MAX_SOURCE_BYTES:  # (its code travels to every worker by value: a file named by mistake)
        raise UserError(f"plugins.modules: {str(path)!r} has {size} bytes; a Python file of code is at most "
                        f"{MAX_SOURCE_BYTES}")
    spec = importlib.util.spec_from_file_location(f"streamrl_local_{file.stem}", file)
    if spec is None:  # (Python imports a file by its suffix: no loader for "plugin" or "plugin.txt")
        raise UserError(f"plugins.modules: {str(path)!r} is not a Python file; expected a path ending in .py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        # the recipe cannot run without the module it names: one line (file, line, error), as
        # for an installed plugin that fails to load, but an error rather than a warning
        del sys.modules[spec.name]
        line = getattr(exc, "lineno", None) if isinstance(exc, SyntaxError) else _failing_line(exc, file)
        at = f", line {line}" if line else ""
        text = one_line(str(exc.msg), 300) if isinstance(exc, SyntaxError) else message_line(exc)
        raise UserError(f"plugins.modules: {str(path)!r} cannot be loaded ({file}{at}): "
                        f"{type(exc).__name__}: {text}") from None
    # Workers cannot import a file that lives only next to the recipe: ship its code by value.
    import cloudpickle

    cloudpickle.register_pickle_by_value(module)
    return module


def _failing_line(exc: BaseException, file: Path) -> int | None:
    """The line of ``file`` the error was raised from (its innermost frame there), if any."""
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename) == file]
    return frames[-1].lineno if frames else None


def build_registry(local_modules: list[str] = (), base: Path = Path(".")) -> Registry:
    """Build the plugin manager (built-ins, installed plugins, recipe-local modules) and collect."""
    from streamrl.plugins import builtins

    pm = pluggy.PluginManager("streamrl")
    pm.add_hookspecs(hookspecs)
    disabled = _disabled()
    # (the built-ins' plugin name, as `streamrl plugins` lists it: a name, not the module's path)
    pm.register(builtins, name="streamrl.builtins")
    origins = {"streamrl.builtins": ("streamrl", _version("streamrl"))}
    _load_entrypoints(pm, disabled, origins)
    seen: set[Path] = set()
    for path in local_modules:
        file = _local_file(path, base)
        if file in seen:  # (named twice, perhaps by two spellings of its path: loaded once)
            continue
        seen.add(file)
        module = load_local_module(path, base)
        if module.__name__ not in disabled:
            try:
                pm.register(module, name=f"local:{path}")
            except (pluggy.PluginValidationError, ValueError) as exc:  # (a hook with arguments its spec lacks)
                raise UserError(f"plugins.modules: {str(path)!r} cannot be registered ({file}): "
                                f"{message_line(exc, 300)}") from None
            origins[f"local:{path}"] = (str(file), "")
    return Registry(pm, origins)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:  # running from a source tree
        return ""
