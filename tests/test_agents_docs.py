"""docs/agents.md's examples, run as written: its data row, its rollout function and its
gym-style environment against a real endpoint through the real ``openai`` client (the tiny
calculator model), and its recipe tables, in the shipped ``recipes/agent.toml``, through
what ``streamrl recipe validate`` runs."""

from __future__ import annotations

import asyncio
import json
import re

import openai
import pytest

from streamrl.agents.environment import environment_rollout
from streamrl.chat.tool_calls import HermesToolParser
from streamrl.engines.base import HFEngineConfig
from streamrl.engines.slots import SlotEngine
from streamrl.recipe.serve import ServeConfig
from streamrl.serve.openai_api import Endpoint
from streamrl.serve.traffic import Traffic
from streamrl.recipe.recipe import load_recipe
from streamrl.run.runner import validate
from tests.helpers import ROOT, endpoint_in_process

DOC = (ROOT / "docs" / "agents.md").read_text()
CALC_MODEL = ROOT / "models" / "tiny-calculator"


def blocks(language: str) -> list[str]:
    """The doc's fenced blocks of ``language``, in order, their list indentation taken off."""
    found = re.findall(rf"^( *)```{language}\n(.*?)^\1```", DOC, re.S | re.M)
    return ["\n".join(line[len(indent):] for line in body.splitlines()) for indent, body in found]


AGENT, ENVIRONMENT = blocks("python")[:2]
ROW = json.loads(blocks("json")[0])


@pytest.fixture(scope="module")
def url():
    """The calculator model behind a real endpoint on a free loopback port."""
    engine = SlotEngine(HFEngineConfig(batching="slots", slots=8, max_prompt_tokens=128, max_new_tokens=64,
                                       temperature=1.0, profile=False))
    engine.load(str(CALC_MODEL))
    try:
        with endpoint_in_process(Endpoint(engine, ServeConfig(port=0), Traffic(60.0), "policy",
                                          HermesToolParser())) as address:
            yield address
    finally:
        engine.close()


def run(coroutine_of):
    """The result of ``coroutine_of(client)``, a fresh ``AsyncOpenAI`` client on ``url``."""
    async def main(address):
        client = openai.AsyncOpenAI(base_url=address, api_key="x", max_retries=0)
        try:
            return await coroutine_of(client)
        finally:
            await client.close()
    return main


def test_the_docs_rollout_function_runs_against_the_endpoint_and_returns_its_reward(url):
    module: dict = {}
    exec(AGENT, module)
    assert module["my_calculator"]("47*83") == "3901" and module["my_calculator"]("x") == "error"
    # the tiny model calls the tool at times (a third of its replies, unseeded here): rollouts until
    # one did, its result went back and the model answered after it; 16 at most
    results = []
    while len(results) < 16 and not any(r["used_tool"] == 1.0 for r in results):
        results.append(asyncio.run(run(lambda client: module["rollout"](client, dict(ROW)))(url)))
        assert set(results[-1]) == {"score", "used_tool"} and results[-1]["score"] in (0.0, 1.0), results[-1]
    assert any(r["used_tool"] == 1.0 for r in results), results


def test_the_docs_environment_runs_through_streamrls_rollout_of_it(url):
    module: dict = {}
    exec(AGENT, module)  # (its TOOLS and my_calculator, "as in my_agent.py above")
    exec(ENVIRONMENT, module)
    env_class = module["Calculator"]
    rewards = [asyncio.run(run(lambda client: environment_rollout(client, dict(ROW), env_class, 3, 64))(url))
               for _ in range(4)]
    assert all(r in (0.0, 1.0) for r in rewards), rewards
    env = env_class()
    assert env.reset(ROW) == [{"role": "user", "content": ROW["prompt"]}]
    call = {"id": "c1", "function": {"name": "calc", "arguments": json.dumps({"x": "47*83"})}}
    assert env.step({"role": "assistant", "tool_calls": [call]}) == (
        [{"role": "tool", "tool_call_id": "c1", "content": "3901"}], 0.0, False)
    assert env.step({"role": "assistant", "content": " 3901 "}) == ([], 1.0, True)


def test_an_environment_whose_step_gives_text_as_its_reward_fails_that_rollout(url):
    # float() read "0.5" as a reward: text is not one (a user's function returning it is refused too)
    class Texty:
        tools = None

        def reset(self, row):
            return [{"role": "user", "content": "1+1="}]

        def step(self, message):
            return [], "0.5", True

        def close(self):
            pass

    with pytest.raises(TypeError, match=r"step\(\) gave a reward of type str; expected a number"):
        asyncio.run(run(lambda client: environment_rollout(client, dict(ROW), Texty, 2, 4))(url))


def test_an_episode_that_outgrows_the_engines_prompt_ends_there_with_the_rewards_it_earned(url):
    # each step hands back a long observation: the conversation passes engine.max_prompt_tokens
    # (128) within a few turns, and the endpoint's 400 ended the rollout, its rewards lost
    class Chatty:
        tools = None
        turns = 0

        def reset(self, row):
            return [{"role": "user", "content": "1+1="}]

        def step(self, message):
            Chatty.turns += 1
            return [{"role": "user", "content": "more " * 20}], 0.25, False

        def close(self):
            pass

    total = asyncio.run(run(lambda client: environment_rollout(client, dict(ROW), Chatty, 50, 4))(url))
    assert 1 <= Chatty.turns < 50 and total == 0.25 * Chatty.turns


def replace_tables(recipe: str, tables: str) -> str:
    """``recipe`` with each table that ``tables`` has taken out, and ``tables`` appended."""
    names = set(re.findall(r"^\[([^\]]+)\]", tables, re.M))
    kept, keep = [], True
    for line in recipe.splitlines():
        header = re.match(r"^\[([^\]]+)\]", line)
        if header:
            keep = header.group(1) not in names
        if keep:
            kept.append(line)
    return "\n".join(kept) + "\n\n" + tables


@pytest.mark.parametrize("shape", ["function", "environment"])
def test_the_docs_recipe_tables_validate_in_the_shipped_agent_recipe(tmp_path, shape):
    recipe_toml, env_toml = blocks("toml")[:2]
    (tmp_path / "train.jsonl").write_text(json.dumps(ROW) + "\n")
    (tmp_path / "my_agent.py").write_text(AGENT)
    (tmp_path / "my_env.py").write_text(AGENT + "\n\n" + ENVIRONMENT)
    recipe = (ROOT / "recipes" / "agent.toml").read_text().replace("../models/tiny-calculator", str(CALC_MODEL))
    recipe = replace_tables(recipe, recipe_toml)
    if shape == "environment":  # its [task] over the function's ([task.data] stays)
        recipe = replace_tables(recipe, env_toml)
    (tmp_path / "my_recipe.toml").write_text(recipe)
    resolved = validate(load_recipe(tmp_path / "my_recipe.toml"))  # (what `streamrl recipe validate` runs)
    task = resolved.task.config  # (the agent task's validated config: its file found and imported)
    assert str(task.path).endswith("my_env.py" if shape == "environment" else "my_agent.py")
    assert (task.environment, task.function) == (("Calculator", None) if shape == "environment" else (None, "rollout"))
