"""The component contracts end to end: a recipe-local module with one component of every kind
(tests/data/every_kind.py, written against ``streamrl.api``) runs through the real CLI, and a
component that cannot be built on a worker ends the run with one line, not a hang; what engines
and trainers declare (their capabilities)."""

from __future__ import annotations

import json
import shutil

import pytest
from pydantic import BaseModel

from streamrl.algorithms.grpo import GRPO, GRPOConfig
from streamrl.api import Component, Engine, EngineCapabilities, TrainerCapabilities, TrainerContext
from streamrl.plugins.registry import build_registry
from streamrl.sim.capabilities import SimEngineCapabilities
from streamrl.sim.trainer import SimTrainer, SimTrainerConfig
from tests.helpers import ROOT, read_records, streamrl

EVERY_KIND = """
[run]
name = "every-kind"
steps = 2
out_dir = "{out}"

[cluster]
dashboard_port = 0

[pools.generate]
workers = 2
threads = 2
[pools.train]
[pools.reward]

[model]
path = "{model}"

[plugins]
modules = ["./every_kind.py"]

[task]
name = "sums"

[engine]
name = "plain"

[reward]
name = "last_digit"

[algorithm]
name = "reinforce"

[trainer]
name = "sgd"
prompts_per_step = 4
samples_per_prompt = 4

[transfer]
name = "numpy"

[ranker]
name = "text_length"

[scheduler]
name = "reverse"

[[metrics]]
name = "rewards_file"
"""


def write_recipe(tmp_path, text: str):
    shutil.copy(ROOT / "tests" / "data" / "every_kind.py", tmp_path / "every_kind.py")
    path = tmp_path / "recipe.toml"
    path.write_text(text.format(out=tmp_path / "runs", model=ROOT / "models" / "tiny-addition"))
    return path


def test_every_kind_validates_from_a_recipe_local_module(tmp_path, capsys):
    from streamrl.api import KINDS
    from streamrl.cli import main
    from streamrl.plugins.registry import build_registry

    proc = streamrl("recipe", "validate", str(write_recipe(tmp_path, EVERY_KIND)))
    assert proc.returncode == 0, proc.stderr
    # the module has one of every kind (this recipe uses all but the tool parser, which needs an
    # endpoint: below, and tests/test_agents_run.py runs one from a recipe-local file)
    local = {c.kind for c in build_registry(["./every_kind.py"], tmp_path).entries if c.plugin.startswith("local:")}
    assert local == set(KINDS)
    serving = EVERY_KIND.replace('[engine]\nname = "plain"', '[engine]\nname = "hf"\nbatching = "slots"')
    # (braces doubled: write_recipe formats the text; in this process, as the CLI runs it)
    for parser, problem in [('"call_line"', ""), ('{{ name = "call_line", prefix = ">> " }}', ""),
                            ('{{ name = "call_line", prefx = ">> " }}', "serve.tool_parser.prefx"),
                            ('"call_lin"', "did you mean 'call_line'")]:
        recipe = write_recipe(tmp_path, serving + f"\n[serve]\nport = 0\ntool_parser = {parser}\n")
        code = main(["recipe", "validate", str(recipe)])
        err = capsys.readouterr().err
        if not problem:
            assert code == 0, err
        else:
            assert code == 2 and len(err.strip().splitlines()) == 1 and problem in err, err


@pytest.mark.slow
@pytest.mark.smoke
def test_a_component_of_every_kind_runs_a_recipe(tmp_path):
    proc = streamrl("recipe", "run", str(write_recipe(tmp_path, EVERY_KIND)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    records = read_records(run_dir)
    assert [r["policy_version"] for r in records] == [1, 2] and all(r["samples"] == 16 for r in records)
    assert all(r["reward_errors"] == 0 for r in records)
    # the algorithm's own statistic is reported; the scheduler's metric too; the ranker was used
    assert all(0.0 < r["mean_ratio"] < 10.0 for r in records)
    assert all(r["placed"] == 4 and 0.0 <= r["ranker_recall"] <= 1.0 for r in records)
    # the scheduler's placement was followed: prompt i on the reversed worker list
    for x in records[0]["sample_log"]:
        i = int(x["uid"].split("-")[1])
        assert x["worker"] == ["generate-1", "generate-0"][i % 2], x
    sink = [json.loads(line) for line in (run_dir / "rewards.txt").read_text().splitlines()]
    assert [s["step"] for s in sink] == [0, 1]
    assert (run_dir / "policy" / "config.json").is_file()


@pytest.mark.slow
def test_a_component_that_cannot_be_built_on_a_worker_ends_the_run_in_one_line(tmp_path):
    text = EVERY_KIND.replace('[reward]\nname = "last_digit"', '[reward]\nname = "exact_match"')
    path = write_recipe(tmp_path, text)
    # a trainer whose build fails on the worker (as when a package is missing there)
    module = (tmp_path / "every_kind.py").read_text()
    module = module.replace('        super().__init__(HFTrainerConfig(lr=config.lr), context)',
                            '        raise ModuleNotFoundError("No module named \'sgd_extras\'")')
    (tmp_path / "every_kind.py").write_text(module)
    proc = streamrl("recipe", "run", str(path), timeout=240)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("streamrl: error: trainer 'sgd' could not be built on worker train-0"), last
    assert "sgd_extras" in last and "Traceback" not in proc.stderr


class HotConfig(BaseModel):
    temperature: float = 0.5


class HotEngine(Engine):
    @classmethod
    def capabilities(cls, config: HotConfig) -> EngineCapabilities:
        return EngineCapabilities(temperature=config.temperature, needs_model=False)


def test_capabilities_come_from_the_class_and_a_plain_function_factory_gets_the_defaults():
    assert Component("engine", "hot", HotConfig, HotEngine).capabilities(HotConfig(temperature=0.7)) == \
        EngineCapabilities(temperature=0.7, needs_model=False)
    # a function building the same engine declares nothing: streamrl cannot see the class
    assert Component("engine", "hot", HotConfig, lambda c: HotEngine()).capabilities(HotConfig()) == EngineCapabilities()
    assert Component("trainer", "t", HotConfig, lambda c, ctx: None).capabilities(HotConfig()) == TrainerCapabilities()
    with pytest.raises(TypeError, match="reward components declare no capabilities"):
        Component("reward", "r", HotConfig, lambda c: None).capabilities(HotConfig())
    reg = build_registry()
    hf = reg.get("trainer", "hf", "trainer.name")
    assert hf.capabilities(hf.config()) == TrainerCapabilities(data_parallel=True, shardable=True)
    engine = reg.get("engine", "hf", "engine.name")
    assert engine.capabilities(engine.config(temperature=0.3)).temperature == 0.3


def test_the_sim_trainer_takes_its_cost_model_from_the_sim_engines_capabilities():
    reg = build_registry()
    sim = reg.get("engine", "sim", "engine.name")
    caps = sim.capabilities(sim.config(time_scale=0.5))
    assert isinstance(caps, SimEngineCapabilities) and not caps.needs_model and caps.time_scale == 0.5
    assert SimTrainer(SimTrainerConfig(), TrainerContext(None, GRPO(GRPOConfig()), caps)).time_scale == 0.5
    with pytest.raises(ValueError, match='needs engine.name = "sim"'):
        SimTrainer(SimTrainerConfig(), TrainerContext(None, GRPO(GRPOConfig()), EngineCapabilities()))
