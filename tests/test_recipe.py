"""Recipe errors are one line, name the TOML path, exit 2, and carry no traceback."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from streamrl.cli import main
from streamrl.errors import UserError
from streamrl.recipe.recipe import apply_overrides, load_recipe


def run_cli(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_valid_recipe_validates(capsys, tiny_recipe):
    code, out, err = run_cli(capsys, "recipe", "validate", str(tiny_recipe))
    assert code == 0, err
    assert out.strip().endswith(": ok")


def test_unknown_key_names_its_path(capsys, tiny_recipe):
    code, _, err = run_cli(capsys, "recipe", "validate", str(tiny_recipe), "--set", "trainer.learning_rate=0.1")
    assert code == 2
    assert "trainer.learning_rate: unknown key" in one_line_error(err)


def test_wrong_type_names_its_path(capsys, tiny_recipe):
    code, _, err = run_cli(capsys, "recipe", "validate", str(tiny_recipe), "--set", "trainer.prompts_per_step=many")
    assert code == 2
    line = one_line_error(err)
    assert "trainer.prompts_per_step" in line and "integer" in line and "'many'" in line


def test_out_of_range_value(capsys, tiny_recipe):
    code, _, err = run_cli(capsys, "recipe", "validate", str(tiny_recipe), "--set", "trainer.lr=-1")
    assert code == 2
    assert "trainer.lr" in one_line_error(err)


def test_missing_pool(capsys, tiny_recipe):
    text = tiny_recipe.read_text().replace("[pools.reward]\nthreads = 1\n", "")
    tiny_recipe.write_text(text)
    code, _, err = run_cli(capsys, "recipe", "validate", str(tiny_recipe))
    assert code == 2
    assert "pools.reward: missing" in one_line_error(err)


def test_unknown_plugin_name_suggests_the_closest(capsys, tiny_recipe):
    code, _, err = run_cli(capsys, "recipe", "validate", str(tiny_recipe), "--set", "algorithm.name=grp0")
    assert code == 2
    line = one_line_error(err)
    assert "algorithm.name: unknown algorithm 'grp0'" in line and "did you mean 'grpo'" in line


def test_plugin_section_validated_by_plugin_config(capsys, tiny_recipe):
    code, _, err = run_cli(capsys, "recipe", "validate", str(tiny_recipe), "--set", "engine.max_new_tokens=0")
    assert code == 2
    assert "engine.max_new_tokens" in one_line_error(err)
    code, _, err = run_cli(capsys, "recipe", "validate", str(tiny_recipe), "--set", "task.digitz=3")
    assert code == 2
    assert "task.digitz: unknown key" in one_line_error(err)


def test_missing_file_and_bad_toml(capsys, tmp_path):
    code, _, err = run_cli(capsys, "recipe", "validate", str(tmp_path / "nope.toml"))
    assert code == 2 and "recipe file not found" in one_line_error(err)
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\nname = 1")
    code, _, err = run_cli(capsys, "recipe", "validate", str(bad))
    assert code == 2 and "not valid TOML" in one_line_error(err)


def test_missing_model_folder(capsys, tiny_recipe, tmp_path):
    code, _, err = run_cli(capsys, "recipe", "validate", str(tiny_recipe), "--set", f'model.path="{tmp_path}/none"')
    assert code == 2
    assert "model.path: no transformers model" in one_line_error(err)


def test_overrides_parse_toml_values():
    data = apply_overrides({}, ["trainer.lr=1e-5", "run.name=abc", "run.steps=3", 'pools.generate.env={A="1"}'])
    assert data == {"trainer": {"lr": 1e-5}, "run": {"name": "abc", "steps": 3},
                    "pools": {"generate": {"env": {"A": "1"}}}}
    with pytest.raises(UserError, match="KEY=VALUE"):
        apply_overrides({}, ["trainer.lr"])


def test_show_prints_resolved_recipe(capsys, tiny_recipe):
    code, out, _ = run_cli(capsys, "recipe", "show", str(tiny_recipe), "--set", "trainer.lr=0.5")
    assert code == 0
    assert "lr = 0.5" in out and "[pools.generate]" in out
    # the printed recipe is itself a valid recipe
    again = tiny_recipe.parent / "again.toml"
    again.write_text(out)
    assert load_recipe(again).recipe.trainer.lr == 0.5


def test_a_folder_as_recipe_a_weightless_model_and_a_bad_address_are_one_line(capsys, tiny_recipe, tmp_path):
    code, _, err = run_cli(capsys, "recipe", "validate", str(tmp_path))
    assert code == 2 and "is a folder; expected a recipe .toml file" in one_line_error(err)
    empty = tmp_path / "no-weights"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    code, _, err = run_cli(capsys, "recipe", "validate", str(tiny_recipe), "--set", f'model.path="{empty}"')
    assert code == 2 and "has a config.json but no weights" in one_line_error(err)
    for address in ("nonsense", '"tcp://::1:8786"', '"tcp://h:²"', '"tcp://h:99999"'):
        code, _, err = run_cli(capsys, "recipe", "validate", str(tiny_recipe), "--set", f"cluster.address={address}")
        assert code == 2 and "cluster.address: expected a scheduler address like tcp://host:8786" in one_line_error(err)
    # nested past what the recipe's writers and senders recurse through: one line, not their RecursionError
    deep = "cluster.factory_options." + "a." * 300 + "b=1"
    code, _, err = run_cli(capsys, "recipe", "show", str(tiny_recipe), "--set", "cluster.factory=distributed.LocalCluster",
                           "--set", deep)
    assert code == 2 and "nested 64 tables or arrays deep" in one_line_error(err)
    with pytest.raises(SystemExit) as exited:  # (argparse's own way: usage, one line, exit 2)
        run_cli(capsys, "bench", "serve", str(tiny_recipe), "--seconds", "inf")
    assert exited.value.code == 2 and "expected seconds above 0" in capsys.readouterr().err
    # n past the endpoint's 64 failed every request, counted as "failed" (a slow endpoint, to the eye)
    code, _, err = run_cli(capsys, "bench", "serve", str(tiny_recipe), "--n", "65")
    assert code == 2 and "--n 64 (the endpoint's limit)" in one_line_error(err)
    # a result file is checked before minutes of measuring, not when it is written at the end
    (tmp_path / "a-file").write_text("")
    for out, said in ((str(tmp_path), "is a folder; expected a file to write"),
                      (str(tmp_path / "a-file" / "x.json"), "is not a folder this user can write in")):
        with pytest.raises(SystemExit) as exited:
            run_cli(capsys, "plan", str(tiny_recipe), "--out", out)
        assert exited.value.code == 2 and said in capsys.readouterr().err
    from streamrl.bench.commands import json_out

    assert json_out(str(tmp_path / "new" / "x.json")) == str(tmp_path / "new" / "x.json")  # (its folder made)
    assert (tmp_path / "new").is_dir() and json_out("~/x.json") == str(Path.home() / "x.json")
    # an empty host is every interface to Dask: never by accident
    for host, said in (('""', "expected an interface to listen on"), ('"::1"', "takes no IPv6 address")):
        code, _, err = run_cli(capsys, "recipe", "validate", str(tiny_recipe), "--set", f"cluster.host={host}")
        assert code == 2 and said in one_line_error(err), err
    code, _, err = run_cli(capsys, "recipe", "validate", str(tiny_recipe), "--set", "pools.generate.workers=1000000000")
    assert code == 2 and "pools.generate.workers: expected less than or equal to 512" in one_line_error(err)


def test_a_task_must_give_the_prompts_asked_for_with_uids_new_to_the_run():
    from streamrl.flow.submit import check_prompts
    from streamrl.sample import Prompt

    seen: set[str] = set()
    check_prompts("t", 0, [Prompt(uid="0-0", text="a", answer=""), Prompt(uid="0-1", text="b", answer="")], 2, seen)
    with pytest.raises(UserError, match="returned 0 prompts"):
        check_prompts("t", 1, [], 2, seen)
    with pytest.raises(UserError, match="prompt uid '0-1' repeats in step 1"):  # a uid of an earlier step
        check_prompts("t", 1, [Prompt(uid="1-0", text="a", answer=""), Prompt(uid="0-1", text="b", answer="")], 2, seen)
    with pytest.raises(UserError, match="prompt uid 'x' repeats in step 2"):
        check_prompts("t", 2, [Prompt(uid="x", text="a", answer=""), Prompt(uid="x", text="b", answer="")], 2, seen)
    # what else a task may hand back: one line naming it, not a traceback in the engine
    for wrong, said in [(None, "returned NoneType; expected a list of Prompt"),
                        ((p for p in []), "returned generator"),
                        (["3+4="], "at index 0 that is a str, not a Prompt"),
                        ([Prompt(uid=3, text="a")], "at index 0 that has uid 3; expected non-empty text"),
                        ([Prompt(uid="3-0", text=None)], "has text of type NoneType"),
                        ([Prompt(uid="3-0", text="a", token_ids=[1, "2"])], "token_ids that are not a list of ints")]:
        with pytest.raises(UserError, match=re.escape(said)):
            check_prompts("t", 3, wrong, 1, seen)


def test_what_the_run_asks_of_its_engine_and_cluster_is_checked_before_any_cluster_starts(capsys, tiny_recipe):
    # Each of these once passed validation and failed after the cluster had started.
    serving = tiny_recipe.parent / "serving.toml"
    serving.write_text(tiny_recipe.read_text() + '\n[serve]\nport = 0\n')
    code, _, err = run_cli(capsys, "recipe", "validate", str(serving), "--set", 'engine.batching="continuous"')
    assert code == 2 and '[serve] serves from an endpoint, which needs an engine that streams' in one_line_error(err)
    code, _, err = run_cli(capsys, "recipe", "validate", str(serving), "--set", 'engine.batching="slots"')
    assert code == 0, err
    code, _, err = run_cli(capsys, "recipe", "validate", str(serving), "--set", 'engine.batching="slots"',
                           "--set", 'serve.tool_parser="herms"')
    assert code == 2 and one_line_error(err) == ("streamrl: error: serve.tool_parser: unknown tool_parser 'herms' (available: "
                                                 "hermes, llama3_json, mistral, qwen3); did you mean 'hermes'?")
    # a parser named with options: its config model checks them
    code, _, err = run_cli(capsys, "recipe", "validate", str(serving), "--set", 'engine.batching="slots"',
                           "--set", 'serve.tool_parser={name="mistral"}')
    assert code == 0, err
    code, _, err = run_cli(capsys, "recipe", "validate", str(serving), "--set", 'engine.batching="slots"',
                           "--set", 'serve.tool_parser={name="mistral", strict=true}')
    assert code == 2 and "serve.tool_parser" in one_line_error(err) and "strict" in one_line_error(err), err
    code, _, err = run_cli(capsys, "recipe", "validate", str(serving), "--set", 'engine.batching="slots"',
                           "--set", 'serve.tool_parser={strict=true}')
    assert code == 2 and "serve.tool_parser: a table needs a 'name'" in one_line_error(err), err
    code, _, err = run_cli(capsys, "recipe", "validate", str(tiny_recipe), "--set", 'scheduler.name="longtail"',
                           "--set", "scheduler.migrate=true", "--set", 'engine.batching="static"')
    assert code == 2 and "scheduler: 'longtail' moves running samples between instances" in one_line_error(err)
    code, _, err = run_cli(capsys, "recipe", "validate", str(tiny_recipe), "--set", 'scheduler.name="longtail"',
                           "--set", "scheduler.migrate=true", "--set", 'engine.batching="slots"')
    assert code == 0, err
    code, _, err = run_cli(capsys, "recipe", "validate", str(tiny_recipe), "--set", 'cluster.factory="x.y:make"',
                           "--set", "pools.generate.elastic={min=1, max=2}")
    assert code == 2 and "pools.generate.elastic: grows the embedded cluster only" in one_line_error(err)


def test_an_agent_task_needs_an_engine_that_streams(capsys):
    from tests.helpers import ROOT

    code, _, err = run_cli(capsys, "recipe", "validate", str(ROOT / "recipes" / "agent.toml"),
                           "--set", 'engine.batching="static"')
    assert code == 2 and 'task.name = "agent" serves from an endpoint' in one_line_error(err)


def test_the_reference_loop_names_the_recipe_parts_it_does_not_use(tiny_recipe):
    from streamrl.plugins.resolve import resolve
    from streamrl.reference import not_used

    assert not_used(resolve(load_recipe(tiny_recipe))) == []
    loaded = load_recipe(tiny_recipe, ['scheduler.name="skew"', 'ranker.name="history"', "run.mode=async",
                                       "eval.every=5", 'metrics=[{name="csv"}]'])
    assert not_used(resolve(loaded)) == ['scheduler.name = "skew"', 'ranker.name = "history"',
                                         '[[metrics]] name = "csv"', "[eval]",
                                         'run.mode = "async" (this loop is on-policy, one step after another)']


def test_the_engine_measures_its_decode_profile_only_when_a_scheduler_reads_it(tiny_recipe):
    from streamrl.plugins.resolve import resolve

    def profile(*overrides):
        return resolve(load_recipe(str(tiny_recipe), list(overrides))).engine.config.profile

    assert profile() is False  # nothing in this run reads it: no start-up seconds spent on it
    assert profile('scheduler={name="skew"}') is True
    assert profile("engine.profile=true") is True and profile('scheduler={name="skew"}', "engine.profile=false") is False


def test_a_hostile_recipe_file_is_one_line_before_anything_starts(capsys, tiny_recipe, tmp_path):
    # Each of these passed tomllib or a gt=0 check and then failed inside the run: a timer that
    # cannot be armed, a recipe that cannot be written to the run folder (inf dumps as null),
    # a run folder outside out_dir, a RecursionError, memory filled by /dev/zero.
    cases = {
        "trainer.lr=inf": "trainer.lr: expected a finite number (got inf)",
        "engine.temperature=nan": "engine.temperature: expected a finite number (got nan)",
        "reward.score_timeout_s=1e300": "reward.score_timeout_s: expected less than or equal to 1000000",
        "run.step_timeout_s=inf": "run.step_timeout_s: expected a finite number (got inf)",
        'run.name="../../elsewhere"': "run.name: expected one folder name",
        'run.name="x\\u001b[2J"': "run.name: expected one folder name: 1 to 100 printable characters",
        'run.out_dir="runs\\u0000x"': "run.out_dir: expected a folder path, without NUL",
        # GPU ids CUDA cannot read hide every GPU; one listed twice, or too few, give a worker one twice
        'pools.train.cuda_visible_devices=["gpu0"]': "pools.train.cuda_visible_devices: 'gpu0' is not a GPU id",
        'pools.train.cuda_visible_devices=["0","0"]': "pools.train.cuda_visible_devices: GPU '0' is listed twice",
        "run.seed=-1": "run.seed: expected greater than or equal to 0",
        "reward.limit=1e300": "reward.limit: expected less than or equal to 1e+30",
        # TOML's booleans are not numbers (pydantic alone reads lr = true as a rate of 1.0)
        "trainer.lr=true": "trainer.lr: expected a number, not a boolean",
        "run.steps=false": "run.steps: expected a number, not a boolean",
        "pools.generate.workers=true": "pools.generate.workers: expected a number, not a boolean",
        "learners=[{name=\"side\", trainer={lr=true}}]": "learners[0].trainer.lr: expected a number, not a boolean",
        "run.steps=1" + "0" * 5000: "an integer longer than 4,300 digits",
        "task.x=" + "[" * 3000 + "]" * 3000: "arrays nested too deeply",
    }
    for override, said in cases.items():
        code, _, err = run_cli(capsys, "recipe", "validate", str(tiny_recipe), "--set", override)
        assert code == 2 and said in one_line_error(err), (override, err[-500:])
    # REINFORCE++'s running normaliser is each trainer's: several ranks would each keep their own
    code, _, err = run_cli(capsys, "recipe", "validate", str(tiny_recipe), "--set", 'algorithm.name="reinforce_pp"',
                           "--set", "pools.train.workers=2")
    assert code == 2 and "pools.train.workers: 2 with algorithm.name = \"reinforce_pp\", whose running statistics" in \
        one_line_error(err)
    code, _, err = run_cli(capsys, "recipe", "validate", str(tiny_recipe), "--set", 'pools.train.cuda_visible_devices=["0"]',
                           "--set", "pools.train.gpus_per_worker=2")
    assert code == 2 and "gpus_per_worker (2) is more than cuda_visible_devices lists (1)" in one_line_error(err)
    for name, text in {"deep.toml": "x = " + "[" * 3000 + "]" * 3000, "long.toml": "x = 1" + "0" * 5000,
                       "big.toml": "# " + "x" * (1 << 20)}.items():
        (tmp_path / name).write_text(text)
        code, _, err = run_cli(capsys, "recipe", "validate", str(tmp_path / name))
        assert code == 2 and f"{name}: " in one_line_error(err), err[-500:]
    # files named where others were meant, and values Dask or the registry would have failed on
    (tmp_path / "plugin.txt").write_text("x = 1\n")
    (tmp_path / "rows.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    cases = {
        ('pools.train.memory_limit="80%"',): "pools.train.memory_limit: not a memory size",
        (f'plugins.modules=["{tmp_path / "plugin.txt"}"]',): "is not a Python file; expected a path ending in .py",
        ('reward.name="python"', f'reward.path="{tmp_path / "rows.jsonl"}"'): "expected a Python file ending in .py",
        ("learners=[{name=\"side\", algorithm={name=5}}]",): "learners[0].algorithm.name: expected the name of an algorithm (a string)",
    }
    for overrides, said in cases.items():
        code, _, err = run_cli(capsys, "recipe", "validate", str(tiny_recipe), *[a for o in overrides for a in ("--set", o)])
        assert code == 2 and said in one_line_error(err), (overrides, err[-500:])
    code, _, err = run_cli(capsys, "recipe", "validate", "/dev/zero")  # read up to the bound, not to the end
    assert code == 2 and "/dev/zero: larger than 1024 KB" in one_line_error(err)
    code, out, _ = run_cli(capsys, "recipe", "show", str(tiny_recipe), "--set", "trainer.lr=1e300")
    assert code == 0 and "lr = 1e+300" in out  # huge but finite: the trainer's own checks stop its steps


def test_a_models_config_that_is_hostile_is_one_line_and_read_within_bounds(capsys, tiny_recipe, tmp_path, monkeypatch):
    # config.json is read to check the model's positions: JSON nested without end raised a
    # RecursionError traceback, and one past any size was read whole
    import json

    from streamrl.plugins import model_folder

    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"")
    monkeypatch.setattr(model_folder, "MAX_CONFIG_BYTES", 1 << 16)
    for text, said in (("[" * 30_000 + "]" * 30_000, "cannot be read (RecursionError)"),
                       (json.dumps({"pad": "x" * (1 << 17)}), "a model's config.json is at most 65536")):
        (model / "config.json").write_text(text)
        code, _, err = run_cli(capsys, "recipe", "validate", str(tiny_recipe), "--set", f"model.path={json.dumps(str(model))}")
        assert code == 2 and f"model.path: {model / 'config.json'}" in one_line_error(err) and said in err, err[-300:]


def test_a_tilde_in_a_path_is_the_users_home_everywhere(tmp_path, tiny_model, monkeypatch):
    # RecipePath fields expanded it; model.path looked for recipes/~/..., plugin modules under
    # the recipe's folder, and run.out_dir made a folder named ~ in the current one
    import shutil

    from streamrl.plugins.resolve import resolve
    from streamrl.recipe.recipe import load_recipe
    from tests.helpers import write_tiny_recipe

    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    shutil.copytree(tiny_model, home / "models" / "tiny")
    (home / "plug.py").write_text("")
    monkeypatch.setenv("HOME", str(home))
    (tmp_path / "elsewhere").mkdir()
    recipe = write_tiny_recipe(tmp_path / "elsewhere", tiny_model, more='\n[plugins]\nmodules = ["~/plug.py"]\n')
    loaded = load_recipe(recipe, ['model.path="~/models/tiny"', 'run.out_dir="~/runs"'])
    assert loaded.model_path() == home / "models" / "tiny"
    assert loaded.recipe.run.out_dir == str(home / "runs")
    resolved = resolve(loaded)  # (the plugin module is found in the home folder)
    assert any("plug.py" in name for name, _ in resolved.registry.pm.list_name_plugin())
    # a ~ that names no one: one line naming the field, not pathlib's RuntimeError
    from streamrl.errors import UserError

    for field in ("run.out_dir", "model.path"):
        with pytest.raises(UserError, match=rf"{field}: cannot expand '~no_such_user_here/x'"):
            load_recipe(recipe, [f'{field}="~no_such_user_here/x"']).model_path()
    with pytest.raises(UserError, match=r"plugins.modules: cannot expand '~no_such_user_here/p.py'"):
        resolve(load_recipe(recipe, ['plugins.modules=["~no_such_user_here/p.py"]']))
