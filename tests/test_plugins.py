"""The plugin manager: built-ins through hooks, duplicates, disabling, recipe-local modules."""

from __future__ import annotations

import ast
import textwrap

import pytest

from streamrl.errors import UserError
from streamrl.plugins.registry import build_registry
from tests.helpers import ROOT

LOCAL_REWARD = textwrap.dedent('''
    from pydantic import BaseModel, ConfigDict
    import streamrl
    from streamrl.plugins.registry import Component

    class Cfg(BaseModel):
        model_config = ConfigDict(extra="forbid")
        bonus: float = 1.0

    class Always:
        def __init__(self, config):
            self.config = config
        def score(self, prompt, response):
            return self.config.bonus

    @streamrl.hookimpl
    def register_rewards():
        return [Component("reward", "{name}", Cfg, Always)]
''')


def test_builtins_are_registered_through_hooks():
    reg = build_registry()
    for kind, name in [("algorithm", "grpo"), ("engine", "hf"), ("reward", "exact_match"),
                       ("task", "addition"), ("transfer", "dask"), ("trainer", "hf")]:
        assert reg.get(kind, name, f"{kind}.name").plugin == "streamrl.builtins"


def test_recipe_local_module_adds_a_component(tmp_path):
    (tmp_path / "my_reward.py").write_text(LOCAL_REWARD.format(name="always"))
    reg = build_registry(["./my_reward.py"], tmp_path)
    reward = reg.get("reward", "always", "reward.name").build({"bonus": 0.5}, "reward")
    assert reward.score(None, "x") == 0.5
    with pytest.raises(UserError, match=r"reward\.bonus"):
        reg.get("reward", "always", "reward.name").build({"bonus": "lots"}, "reward")


def test_a_duplicate_name_fails_only_where_it_is_used(tmp_path):
    (tmp_path / "dup.py").write_text(LOCAL_REWARD.format(name="exact_match"))
    reg = build_registry(["./dup.py"], tmp_path)  # loading is fine: other components still work
    assert reg.get("reward", "countdown", "reward.name").plugin == "streamrl.builtins"
    assert [c.plugin for c in reg.entries if c.name == "exact_match"] == ["streamrl.builtins", "local:./dup.py"]
    with pytest.raises(UserError, match=r"reward\.name: reward 'exact_match' is registered twice, by "
                                        r"streamrl\.builtins and local:\./dup\.py"):
        reg.get("reward", "exact_match", "reward.name")


def test_disabled_local_plugin_is_skipped(tmp_path, monkeypatch):
    (tmp_path / "dup.py").write_text(LOCAL_REWARD.format(name="exact_match"))
    monkeypatch.setenv("STREAMRL_DISABLE_PLUGINS", "streamrl_local_dup")
    reg = build_registry(["./dup.py"], tmp_path)
    assert reg.get("reward", "exact_match", "reward.name").plugin == "streamrl.builtins"


def test_missing_local_module(tmp_path):
    with pytest.raises(UserError, match="plugins.modules: file './nope.py' not found"):
        build_registry(["./nope.py"], tmp_path)


def test_a_local_module_past_the_size_of_code_is_refused_before_it_is_read(tmp_path, monkeypatch):
    # (a data file named where code was meant: read, compiled, then shipped to every worker)
    from streamrl.plugins import registry

    monkeypatch.setattr(registry, "MAX_SOURCE_BYTES", 1000)
    (tmp_path / "big.py").write_text("# " + "x" * 2000 + "\n")
    with pytest.raises(UserError, match=r"^plugins.modules: 'big.py' has 2003 bytes; a Python file of code is at "
                                        r"most 1000$"):
        build_registry(["big.py"], tmp_path)


def test_a_register_hook_that_raises_is_reported_and_skipped(tmp_path):
    (tmp_path / "bad.py").write_text(textwrap.dedent('''
        from streamrl.api import hookimpl

        @hookimpl
        def register_rewards():
            raise RuntimeError("no rewards today")
    '''))
    from streamrl.errors import PluginWarning

    with pytest.warns(PluginWarning, match="local:./bad.py.*register_rewards failed.*no rewards today"):
        reg = build_registry(["./bad.py"], tmp_path)
    assert reg.get("reward", "exact_match", "reward.name").plugin == "streamrl.builtins"


def test_a_register_hook_that_exits_or_returns_malformed_components_is_skipped_naming_why(tmp_path):
    from streamrl.errors import PluginWarning

    (tmp_path / "exits.py").write_text(textwrap.dedent('''
        import sys
        from streamrl.api import hookimpl

        @hookimpl
        def register_rewards():
            sys.exit("needs CUDA")
    '''))
    (tmp_path / "malformed.py").write_text(textwrap.dedent('''
        from streamrl.api import hookimpl
        from streamrl.plugins.registry import Component

        @hookimpl
        def register_rewards():
            return [Component("reward", 7, dict, print)]

        @hookimpl
        def register_tasks():
            return [Component("task", "t", dict, print)]

        @hookimpl
        def register_rankers():
            from pydantic import BaseModel
            return [Component("ranker", "r", BaseModel, "not callable")]
    '''))
    with pytest.warns(PluginWarning) as caught:
        reg = build_registry(["./exits.py", "./malformed.py"], tmp_path)
    said = "\n".join(str(w.message) for w in caught)
    assert "local:./exits.py" in said and "SystemExit: needs CUDA" in said
    assert "name must be a non-empty string, got 7" in said
    assert "config must be a pydantic model class" in said and "factory must be callable" in said
    assert all(c.plugin == "streamrl.builtins" for c in reg.entries)  # none of theirs got in


def test_a_local_module_with_a_wrong_hook_or_named_twice_is_one_line(tmp_path):
    (tmp_path / "my_reward.py").write_text(LOCAL_REWARD.format(name="always"))
    reg = build_registry(["./my_reward.py", "my_reward.py"], tmp_path)  # (two spellings of one file)
    assert [c.plugin for c in reg.entries if c.name == "always"] == ["local:./my_reward.py"]
    (tmp_path / "wrong.py").write_text(textwrap.dedent('''
        from streamrl.api import hookimpl

        @hookimpl
        def on_step_end(step, metrics, run):
            pass
    '''))
    with pytest.raises(UserError, match=r"plugins.modules: './wrong.py' cannot be registered .*on_step_end"):
        build_registry(["./wrong.py"], tmp_path)


def test_a_plugin_config_whose_validator_raises_any_error_is_one_line():
    from pydantic import BaseModel, model_validator

    from streamrl.recipe.recipe import validate_section

    class Reads(BaseModel):
        path: str = ""

        @model_validator(mode="after")
        def read(self):
            open(self.path)  # (FileNotFoundError: pydantic does not wrap it)
            return self

    with pytest.raises(UserError, match=r"^reward: Reads could not validate it: FileNotFoundError: .*no/such/file"):
        validate_section(Reads, {"path": "no/such/file"}, "reward")


def streamrl_imports(path) -> list[tuple[int, str]]:
    """``(line, module)`` for every import of a ``streamrl`` module in the file, at any depth
    (``from streamrl import x`` counts as ``streamrl.x``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "streamrl":
            found += [(node.lineno, f"streamrl.{a.name}") for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.append((node.lineno, node.module))
    return [(line, m) for line, m in found if m == "streamrl" or m.startswith("streamrl.")]


def test_shipped_plugins_import_nothing_from_streamrl_but_its_api():
    # streamrl.api is the plugin surface: what a shipped plugin's package needs must be there
    packages = [d for d in (ROOT / "plugins").glob("*/*") if (d / "__init__.py").is_file()]
    assert {d.name for d in packages} >= {"streamrl_example", "streamrl_vllm"}
    files = [f for d in packages for f in d.rglob("*.py")]
    imports = {f"{f.relative_to(ROOT)}:{line}": m for f in files for line, m in streamrl_imports(f)}
    assert "streamrl.api" in imports.values()  # the check sees the imports it is about
    assert {k: m for k, m in imports.items() if m != "streamrl.api"} == {}


EXTENSION_PLUGIN = '''
from streamrl.api import StepExtension, hookimpl


class GroupsSoFar(StepExtension):
    order = 35  # between held-out evaluation (30) and the side learners (40)

    def __init__(self, context):
        self.context = context
        self.groups = 0
        self.seen = []

    def placed(self, context):
        self.seen.append(("placed", context.version))

    def trained(self, step, scored):
        self.groups += len(scored)

    def record(self, step, record):
        record.extra["groups_so_far"] = self.groups
        record.extra["context_version"] = self.context.version
        record.extra["extension_order"] = [type(e).__name__ for e in self.context.extensions]

    def close(self):  # (the run's end, however it ended: said in a file next to this one)
        from pathlib import Path

        Path(__file__).with_name("closed.txt").write_text(f"closed after {self.groups} groups")


@hookimpl
def add_step_extensions(context):
    return [GroupsSoFar(context)] if context.recipe.run.name != "without" else None
'''


def test_a_plugin_adds_a_step_extension_in_its_declared_order_and_a_wrong_one_is_one_line(tmp_path, tiny_recipe):
    from streamrl.contracts.step_extension import RunContext
    from streamrl.plugins.resolve import resolve
    from streamrl.recipe.recipe import load_recipe
    from streamrl.run import extensions

    (tmp_path / "ext.py").write_text(EXTENSION_PLUGIN)
    tiny_recipe.write_text(tiny_recipe.read_text() + '\n[plugins]\nmodules = ["ext.py"]\n')

    def context(*overrides):
        resolved = resolve(load_recipe(tiny_recipe, list(overrides)))
        return RunContext(None, resolved, resolved.task.build_here(), None, repeatable=False, feeds_ahead=False)

    added = extensions.from_plugins(context())
    assert [type(e).__name__ for e in added] == ["GroupsSoFar"]
    assert extensions.from_plugins(context('run.name="without"')) == []  # None: none added
    (tmp_path / "ext.py").write_text(EXTENSION_PLUGIN.replace("[GroupsSoFar(context)]", "[object()]"))
    with pytest.raises(UserError, match=r"^plugin 'local:ext.py': add_step_extensions returned object, not a "
                                        r"StepExtension"):
        extensions.from_plugins(context())
    (tmp_path / "ext.py").write_text(EXTENSION_PLUGIN.replace("return [GroupsSoFar", "return 1 / 0 or [GroupsSoFar"))
    with pytest.raises(UserError, match=r"^plugin 'local:ext.py': add_step_extensions failed: ZeroDivisionError"):
        extensions.from_plugins(context())
    (tmp_path / "ext.py").write_text(EXTENSION_PLUGIN.replace("order = 35 ", 'order = "35" '))
    with pytest.raises(UserError, match=r"^plugin 'local:ext.py': step extension GroupsSoFar has order '35'; "
                                        r"expected a number"):
        extensions.from_plugins(context())


@pytest.mark.slow
def test_a_plugins_step_extension_takes_part_in_a_run(tmp_path, tiny_recipe, shared_cluster):
    from tests.helpers import only_run, read_records, sets, streamrl

    (tmp_path / "ext.py").write_text(EXTENSION_PLUGIN)
    tiny_recipe.write_text(tiny_recipe.read_text() + '\n[plugins]\nmodules = ["ext.py"]\n')
    proc = streamrl("recipe", "run", str(tiny_recipe), "--plain", "--no-report",
                    *sets("run.steps=2", "eval.every=1", *shared_cluster.sets))
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = read_records(only_run(tmp_path / "runs"))
    # the tiny recipe trains 4 groups a step; the extension saw each step's training and the
    # version the context held when the record was taken
    assert [r["groups_so_far"] for r in recs] == [4, 8]
    assert [r["context_version"] for r in recs] == [1, 2]
    assert recs[0]["extension_order"] == ["HeldOutEvaluation", "GroupsSoFar", "SideLearners", "SampleMoves"]
    assert (tmp_path / "closed.txt").read_text() == "closed after 8 groups"  # its close() ran at the end


def test_every_import_line_in_the_docs_imports_as_written():
    # a name the docs recommend must import exactly as they write it
    import re

    statements = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        for m in re.finditer(r"^(?:from streamrl[\w.]* import (?:\([^)]*\)|[^\n]+)|import streamrl[\w.]*)", text, re.M):
            statements.append((doc.name, re.sub(r"#[^\n]*", "", m.group(0))))
    assert len(statements) >= 6, statements  # the docs are really read
    for doc, statement in statements:
        try:
            exec(statement, {})
        except ImportError as exc:
            pytest.fail(f"{doc}: {statement.splitlines()[0]} ... fails: {exc}")


def test_the_run_context_keeps_no_finished_run_alive_and_extensions_go_in_their_declared_order():
    import gc
    import weakref

    from streamrl.contracts.step_extension import RunContext, StepExtension

    class Late(StepExtension):
        def __init__(self, context):
            self.context = context  # an extension keeps the context, as the built-ins do

    class Early(Late):
        order = 5

    class Resolved:
        recipe = None

    context = RunContext(None, Resolved(), None, None, repeatable=False, feeds_ahead=False)
    made = [Late(context), Early(context)]
    context.extensions = sorted(made, key=lambda e: e.order)
    assert [type(e).__name__ for e in context.extensions] == ["Early", "Late"]
    assert context.extension(Early) is made[1]
    gone = weakref.ref(made[0])
    gc.disable()  # only reference counts free it: no cycle through the context
    try:
        del made
        assert gone() is None and [type(e).__name__ for e in context.extensions] == []
    finally:
        gc.enable()


def test_a_plugins_on_run_start_that_raises_stops_the_run_in_one_line_naming_it(tmp_path):
    import pluggy

    from streamrl.api import hookimpl
    from streamrl.errors import RunFailed
    from streamrl.plugins import hookspecs
    from streamrl.run.observers import run_start

    seen = []

    class Fine:
        @hookimpl
        def on_run_start(self, recipe, run_dir):
            seen.append((recipe, run_dir))

    class Broken:
        @hookimpl
        def on_run_start(self, run_dir):  # (a hook names only the arguments it wants)
            raise KeyError("token")

    pm = pluggy.PluginManager("streamrl")
    pm.add_hookspecs(hookspecs)
    pm.register(Fine(), name="fine")
    run_start(pm.hook.on_run_start, "the recipe", tmp_path)
    assert seen == [("the recipe", tmp_path)]
    pm.register(Broken(), name="broken")  # (registered last: pluggy calls it first)
    with pytest.raises(RunFailed, match=r"^plugin 'broken': on_run_start raised KeyError: 'token'; the run stopped "
                                        r"before its first step$"):
        run_start(pm.hook.on_run_start, "the recipe", tmp_path)
    assert len(seen) == 1


def test_an_error_raised_in_a_plugins_code_is_told_from_a_bug_of_streamrl_by_where_it_was_raised(tmp_path):
    import importlib.util

    from streamrl.checkpoints import folders
    from streamrl.rewards.exact_match import ExactMatch, ExactMatchConfig
    from streamrl.run.runner import _plugin_frame

    (tmp_path / "my_engine.py").write_text("import json\n\n\ndef decode(text):\n    return json.loads(text)\n\n\n"
                                           "def call(fn, *args):\n    return fn(*args)\n")
    spec = importlib.util.spec_from_file_location("my_engine", tmp_path / "my_engine.py")
    mine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mine)

    def raised(fn, *args) -> Exception:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001
            return exc
        raise AssertionError("it did not raise")

    # the standard library raised for the plugin that called it: the plugin's line
    assert _plugin_frame(raised(mine.decode, "{")) == "my_engine.py:5, in decode"
    # streamrl's own code raised (here, called by a plugin): a bug of streamrl, shown as it was raised
    assert _plugin_frame(raised(mine.call, ExactMatch(ExactMatchConfig()).score, None, "7")) is None
    (tmp_path / "controller.json").write_text("{")
    assert _plugin_frame(raised(folders.read, tmp_path)) is None  # the standard library raised for streamrl
    local = {}
    exec(compile("def boom():\n    raise ValueError('x')\n", "<dynamic-code>", "exec"), local)
    assert _plugin_frame(raised(local["boom"])) == "a recipe-local module, line 2, in boom"


@pytest.mark.slow
def test_a_plugin_that_changes_the_recipe_it_is_shown_changes_nothing_of_the_run(tiny_recipe, tmp_path, shared_cluster):
    # on_run_start is shown the recipe as run: a plugin that writes to it (a tracker "fixing" a
    # setting it logs) must not change the steps, the learning rate or anything else the run does
    from tests.helpers import only_run, read_records, sets, streamrl, with_plugin

    recipe = with_plugin(tiny_recipe, "meddler", textwrap.dedent('''
        from streamrl.api import hookimpl

        @hookimpl
        def on_run_start(recipe, run_dir):
            recipe.run.steps = 50
            recipe.trainer.lr = 1e9
            (run_dir / "seen.txt").write_text(f"{recipe.run.steps} {recipe.trainer.lr}")
    '''))
    proc = streamrl("recipe", "run", str(recipe), "--plain", "--no-report", *sets(*shared_cluster.sets))
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = only_run(tmp_path / "runs")
    assert (run / "seen.txt").read_text() == "50 1000000000.0"  # (the hook ran, on its copy)
    # two steps, as the recipe says, and no ruinous update (a learning rate of 1e9 stops the run:
    # trainer.max_weight_change)
    assert [r["step"] for r in read_records(run)] == [0, 1]


CAPABLE_PLUGIN = textwrap.dedent('''
    from pydantic import BaseModel

    import streamrl
    from streamrl.api import Component, ToolParser
    from streamrl.engines.hf import HFEngine
    from streamrl.engines.hf_config import HFEngineConfig

    class Broken(HFEngine):
        @classmethod
        def capabilities(cls, config):
            return {CAPABILITIES}

    class Parser(ToolParser):
        def __init__(self, config):
            raise RuntimeError("no grammar for it")

    @streamrl.hookimpl
    def register_engines():
        return [Component("engine", "broken", HFEngineConfig, Broken)]

    @streamrl.hookimpl
    def register_tool_parsers():
        return [Component("tool_parser", "nogrammar", type("NoOptions", (BaseModel,), {}), Parser)]
''')


@pytest.mark.parametrize("capabilities, said", [
    ("1 / 0", "engine 'broken', from plugin local:caps.py: capabilities() raised ZeroDivisionError: division by zero"),
    ("{'max_new_tokens': 6}", "engine 'broken', from plugin local:caps.py: capabilities() returned dict; expected "
                              "EngineCapabilities"),
])
def test_a_plugins_capabilities_or_tool_parser_that_fails_at_validation_is_one_line(tmp_path, tiny_recipe,
                                                                                     capabilities, said):
    # the recipe's validation asked them outside any containment: a traceback from `recipe validate`
    from streamrl.plugins.resolve import resolve
    from streamrl.recipe.recipe import load_recipe

    (tmp_path / "caps.py").write_text(CAPABLE_PLUGIN.replace("{CAPABILITIES}", capabilities))
    tiny_recipe.write_text(tiny_recipe.read_text().replace('name = "hf"', 'name = "broken"', 1)
                           + '\n[plugins]\nmodules = ["caps.py"]\n')
    with pytest.raises(UserError) as err:
        resolve(load_recipe(tiny_recipe))
    assert str(err.value).startswith(said)
    tiny_recipe.write_text(tiny_recipe.read_text().replace('name = "broken"', 'name = "hf"', 1)
                           + '\n[serve]\ntool_parser = "nogrammar"\n')
    with pytest.raises(UserError, match=r"^serve.tool_parser: 'nogrammar' could not be built, from plugin "
                                        r"local:caps.py: RuntimeError: no grammar for it$"):
        resolve(load_recipe(tiny_recipe, ['engine.batching="slots"']))


def test_a_plugins_message_and_an_error_quoting_a_users_text_reach_the_terminal_as_one_printable_line(
        tmp_path, tiny_recipe, capsys):
    from streamrl.cli import main
    from streamrl.errors import PluginWarning

    (tmp_path / "loud.py").write_text(textwrap.dedent('''
        from streamrl.api import hookimpl

        class Unprintable(Exception):
            def __str__(self):
                raise RuntimeError("no message either")

        @hookimpl
        def register_rewards():
            raise ValueError("line one\\nline two\\x1b[2J")

        @hookimpl
        def register_rankers():
            raise Unprintable()
    '''))
    with pytest.warns(PluginWarning) as caught:
        build_registry(["./loud.py"], tmp_path)  # (an exception whose str() raises: said, not raised again)
    said = [str(w.message) for w in caught]
    assert any("register_rewards failed and is skipped: ValueError: line one\\nline two\\x1b[2J" in s for s in said)
    assert any("register_rankers failed and is skipped: Unprintable" in s for s in said)
    assert not any("\n" in s or "\x1b" in s for s in said)
    # an error that quotes what the user wrote: printable on its one line, escapes shown as escapes
    code = main(["recipe", "validate", str(tiny_recipe), "--set", 'run.name="x\\u001b[2J\\ny"'])
    err = capsys.readouterr().err
    assert code == 2 and "\x1b" not in err and len(err.strip().splitlines()) == 1, err
