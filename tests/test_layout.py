"""The package's shape: no import circle among streamrl's modules (data flows down; a module that
needs something from one that imports it gets it passed in). Imports inside functions count too:
a circle hidden in a function is still a circle."""

from __future__ import annotations

import ast
import subprocess
import sys

from tests.helpers import ROOT


def module_name(path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """``{module: {streamrl modules it imports}}`` over every import statement in the file."""
    files = {module_name(p): p for p in (ROOT / "streamrl").rglob("*.py")}

    def known(name: str) -> str | None:  # the longest module prefix of an imported name
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                target = known(name)
                # a package's __init__ is only the namespace here: importing streamrl.x.y
                # imports streamrl.x too, which is not an arrow back
                if target and target != mod and target != package and not mod.startswith(target + "."):
                    graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_in_the_package():
    graph = import_graph()
    assert "streamrl.flow.submit" in graph["streamrl.run.controller"]  # the graph is really read
    assert cycles(graph) == []


def folder_of(module: str) -> str:
    """The folder (a package right under ``streamrl``) or top-level module ``module`` stands in."""
    return ".".join(module.split(".")[:2])


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``{folder: {folders it imports}}``: the module graph seen a floor at a time."""
    out: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        out.setdefault(folder_of(mod), set()).update(folder_of(d) for d in deps if folder_of(d) != folder_of(mod))
    return out


def test_the_folder_view_finds_folders_that_import_each_other():
    graph = {"streamrl.a.x": {"streamrl.b.y"}, "streamrl.b.y": {"streamrl.c"}, "streamrl.c": {"streamrl.a.z"},
             "streamrl.a.z": set(), "streamrl.d.w": {"streamrl.a.x"}}
    assert cycles(folder_graph(graph)) == [["streamrl.a", "streamrl.b", "streamrl.c"]]


def test_every_folder_stands_on_a_floor_of_its_own():
    # Every folder (and top-level module) imports only folders below it: the folder graph has no
    # circle, so the folders stack into floors and no import runs back up. A module placed in the
    # wrong folder (a run concern under training/, a recipe concern under plugins/) shows here as
    # two folders importing each other, whatever its name.
    folders = folder_graph(import_graph())
    assert "streamrl.flow" in folders["streamrl.run"]  # the graph is really read
    assert cycles(folders) == []


#: The loop's folders as layers, lowest first: a module imports from its own layer or below.
LAYERS = ["streamrl.flow", "streamrl.extensions", "streamrl.serve", "streamrl.agents", "streamrl.learners", "streamrl.run"]
#: What stands above them: the commands that drive a run (benchmarks and the planner included).
ABOVE = ("streamrl.cli", "streamrl.__main__", "streamrl.bench", "streamrl.planning", "streamrl.reference")


def layer(module: str) -> int | None:
    """The index in :data:`LAYERS` of the layer ``module`` is in, or None."""
    return next((i for i, p in enumerate(LAYERS) if module == p or module.startswith(p + ".")), None)


def arrows_up(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a higher layer from a lower one, and of any layer from below them all (the
    cluster, the checkpoints, what runs on workers, the components, telemetry)."""
    out = []
    for mod, deps in sorted(graph.items()):
        if mod.startswith(ABOVE):
            continue
        for dep in sorted(deps):
            if layer(dep) is not None and (layer(mod) is None or layer(dep) > layer(mod)):
                out.append(f"{mod} -> {dep}")
    return out


def test_the_checker_finds_an_arrow_up():
    graph = {"streamrl.flow.a": {"streamrl.run.b"}, "streamrl.engines.c": {"streamrl.flow.a"},
             "streamrl.run.b": {"streamrl.learners.d"}, "streamrl.cli": {"streamrl.run.b"}}
    assert arrows_up(graph) == ["streamrl.engines.c -> streamrl.flow.a", "streamrl.flow.a -> streamrl.run.b"]


def test_the_loops_folders_are_layers_and_nothing_below_them_imports_them():
    graph = import_graph()
    assert "streamrl.flow.submit" in graph["streamrl.learners.fanout"]  # the graph is really read
    assert arrows_up(graph) == []


def recipe_branches(source: str) -> list[str]:
    """The ``if`` tests (and conditional expressions) of ``source`` that read the recipe or its
    resolved components: a feature the recipe turns on, decided where the test stands."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.If, ast.IfExp)):
            names = {n.attr for n in ast.walk(node.test) if isinstance(n, ast.Attribute)}
            names |= {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
            if names & {"recipe", "resolved", "r"}:
                out.append(ast.unparse(node.test))
    return out


def controller_assignments(source: str) -> list[str]:
    """Assignments to an attribute of something named ``controller`` or ``ctl``."""
    return [ast.unparse(t) for node in ast.walk(ast.parse(source)) if isinstance(node, (ast.Assign, ast.AugAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in ("controller", "ctl")]


def test_the_checkers_find_a_branch_on_the_recipe_and_an_assignment_from_outside():
    assert recipe_branches("if self.resolved.serves_initial:\n    pass\nx = 1 if r.serve else 2\nif self.version:\n"
                           "    pass") == ["self.resolved.serves_initial", "r.serve"]
    assert controller_assignments("controller.fanout = 3\nctl.version += 1\nside.fanout = 1") == [
        "controller.fanout", "ctl.version"]


def test_the_controllers_step_has_no_branch_on_the_recipe_and_no_module_sets_its_attributes():
    # features are step extensions (contracts/step_extension.py), chosen from the recipe in
    # run/extensions.py: the controller calls them and never tests the recipe for one
    assert recipe_branches((ROOT / "streamrl" / "run" / "controller.py").read_text()) == []
    for path in (ROOT / "streamrl").rglob("*.py"):
        assert controller_assignments(path.read_text()) == [], path


def test_no_step_extension_imports_or_receives_the_controller():
    # an extension sees the run through its RunContext; only the run's own modules know the controller
    graph = import_graph()
    importers = sorted(m for m, deps in graph.items() if "streamrl.run.controller" in deps)
    assert importers and all(m.startswith(("streamrl.run.", "streamrl.bench.", "streamrl.cli")) for m in importers), importers
    for path in (ROOT / "streamrl").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            if not any(ast.unparse(b) == "StepExtension" for b in cls.bases):
                continue
            params = [a.arg for f in cls.body if isinstance(f, ast.FunctionDef) for a in f.args.args]
            assert not {"ctl", "controller"} & set(params), f"{path}: {cls.name} takes the controller"


#: The modules at the top of ``streamrl/`` besides packages: the public surface and the entry points
#: (``api``, ``cli``, ``__main__``), what every layer shares (``errors``, ``sample``, ``devices``) and the
#: one-process reference loop; everything else sits in a package named for what it holds.
MAX_TOP_MODULES = 8


def test_at_most_eight_modules_sit_at_the_top_of_the_package():
    top = sorted(p.name for p in (ROOT / "streamrl").glob("*.py"))
    assert "api.py" in top  # the folder is really read
    assert len(top) <= MAX_TOP_MODULES, top


def test_the_streamrl_process_validates_recipes_without_importing_torch():
    # The `streamrl` process validates, submits and records; only workers build models. Importing
    # torch there cost every command about 2 s of CPU and a second of teardown. (A dataset of
    # chat prompts is the exception: it loads the model's tokenizer, and transformers with it.)
    recipes = ["addition", "ppo", "grpo", "agent", "learners", "serve", "paper-7b-20k"]
    code = ("import sys\nfrom streamrl.cli import main\n"
            "status = [main(['recipe', 'validate', f'recipes/{name}.toml']) for name in sys.argv[1:]]\n"
            "print(status, sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, *recipes], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines()[-1] == f"{[0] * len(recipes)} []", done.stdout + done.stderr
