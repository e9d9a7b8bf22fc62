"""Responses ended early: the reward's ``stop_early`` asked by the slot engine as a task's
responses decode, in this process on CPU; the countdown reward's rule; the setting's checks."""

from __future__ import annotations

import pytest
import torch

from streamrl.engines.base import HFEngineConfig
from streamrl.engines.slots import SlotEngine
from streamrl.errors import RunWarning, UserError
from streamrl.recipe.recipe import validate_section
from streamrl.sample import Prompt
from streamrl.tasks.countdown import CountdownReward, CountdownRewardConfig
from tests.helpers import endpoint_in_process


class StopAtThree:
    """Stops a response once it has three characters; counts what it was asked."""

    def __init__(self):
        self.asked = []

    def stop_early(self, prompt, text):
        self.asked.append((prompt.uid, text))
        return len(text) >= 3


def test_the_slot_engine_ends_a_response_the_reward_calls_hopeless(tiny_model):
    engine = SlotEngine(HFEngineConfig(batching="slots", slots=8, max_prompt_tokens=16, max_new_tokens=12,
                                       temperature=1.0, profile=False, stop_early_every=2))
    engine.load(str(tiny_model))
    engine.decoder.stop_ids.fill_(-1)  # no response ends by itself: only the limit or the watch
    watch = StopAtThree()
    # (the engine samples from torch's global generator: seeded, the draws do not depend on the
    # tests this process ran before -- unseeded, a response that kept sampling the end-of-sequence
    # token, which decodes to no text, at times never reached three characters)
    torch.manual_seed(0)
    engine.stop_early_with(watch)
    try:
        (group,) = engine.generate_groups([Prompt(uid="p", text="12+34=")], 4, [0.0])
        (again,) = engine.generate_groups([Prompt(uid="q", text="1+2=")], 2, [0.0])  # the loop goes on
        assert engine.loop_error is None and len(again) == 2
    finally:
        engine.close()
    assert len(group) == 4 and {p for p, _ in watch.asked} == {"p", "q"}
    for s in group:
        # asked every 2 tokens: stopped at the first check with 3 characters or more, not at 12
        assert s.times.get("stopped_early") == 1.0
        assert len(s.response_ids) < 12 and len(s.response_ids) % 2 == 0 and len(s.response_text) >= 3
        before = engine.tokenizer.decode(s.response_ids[:-2], skip_special_tokens=True)
        assert len(before) < 3  # the check before did not stop it
        assert len(s.logprobs) == len(s.response_ids)


def test_a_served_response_the_reward_calls_hopeless_ends_there_and_is_counted(tiny_model):
    import openai

    from streamrl.recipe.serve import ServeConfig
    from streamrl.serve.openai_api import Endpoint
    from streamrl.serve.traffic import Traffic

    engine = SlotEngine(HFEngineConfig(batching="slots", slots=8, max_prompt_tokens=16, max_new_tokens=12,
                                       temperature=1.0, profile=False, stop_early_every=2))
    engine.load(str(tiny_model))
    engine.decoder.stop_ids.fill_(-1)  # no response ends by itself: only the limit or the watch
    watch = StopAtThree()
    # (the engine samples from torch's global generator: seeded, the draws do not depend on the
    # tests this process ran before -- unseeded, a response that kept sampling the end-of-sequence
    # token, which decodes to no text, at times never reached three characters)
    torch.manual_seed(0)
    engine.stop_early_with(watch)
    api = Endpoint(engine, ServeConfig(port=0, reward="recipe"), Traffic(60.0), "policy")
    try:
        with endpoint_in_process(api) as url:
            client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
            out = client.completions.create(model="policy", prompt="12+34=", n=3, max_tokens=12,
                                            extra_body={"answer": "46"})
            chunks = list(client.completions.create(model="policy", prompt="1+2=", n=1, max_tokens=12, stream=True))
            groups = api.traffic.take(0, 4, 0, 5.0)
    finally:
        engine.close()
    for choice, extra in zip(out.choices, out.model_extra["streamrl"]["choices"]):
        assert choice.finish_reason == "stop" and extra["stopped_early"] is True
        assert len(extra["token_ids"]) < 12 and len(choice.text) >= 3  # ended at the watch, not the limit
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == ["stop"]
    assert {uid for uid, _ in watch.asked} >= {out.id}  # asked about the served request, its answer with it
    assert api.traffic.snapshot()["stopped_early"] == 4
    samples = [s for g in groups for s in g]
    assert len(samples) == 4 and all(s.times.get("stopped_early") == 1.0 for s in samples)  # the step counts them
    assert {s.prompt.answer for s in samples} == {"46", None}


def test_countdown_stops_at_its_first_wrong_number_and_the_score_is_the_same():
    reward = CountdownReward(CountdownRewardConfig())
    prompt = Prompt(uid="c", text="", answer={"target": "5 4 3 2 1"})
    assert not reward.stop_early(prompt, "5 4 3")  # right so far (3 may still become 30: unfinished)
    assert not reward.stop_early(prompt, "5 4 3 ")
    assert reward.stop_early(prompt, "5 4 7 ")  # a wrong number: nothing after it counts
    assert reward.stop_early(prompt, "5 4 3 2 1 0 ")  # past the target: no longer exact
    # a response stopped there scores what it would have scored in full
    assert reward.score(prompt, "5 4 7 ") == reward.score(prompt, "5 4 7 6 5 4 3 2 1")


def test_stop_early_needs_the_slot_engine():
    with pytest.raises(UserError, match='stop_early_every needs batching = "slots"'):
        validate_section(HFEngineConfig, {"stop_early_every": 4}, "engine")
    # the seeded decoder has no loop to stop in: every generate worker failed at its start
    with pytest.raises(UserError, match="stop_early_every needs reproducible = false"):
        validate_section(HFEngineConfig, {"stop_early_every": 4, "batching": "slots", "reproducible": True}, "engine")


STOPPING_REWARD = '''
from pydantic import BaseModel

from streamrl.api import Component, Reward, hookimpl


class Empty(BaseModel):
    pass


class ShortOnly(Reward):
    """Scores the response's length in characters, up to 2; stops any response past 2."""

    def __init__(self, config):
        pass

    def stop_early(self, prompt, text):
        return len(text) > 2

    def score(self, prompt, response):
        return float(min(len(response), 2))


@hookimpl
def register_rewards():
    return [Component("reward", "short_only", Empty, ShortOnly)]
'''


@pytest.mark.slow
def test_a_run_ends_responses_early_counts_them_and_trains_each_once(tiny_recipe, shared_cluster):
    from tests.helpers import read_records, streamrl, with_plugin

    recipe = with_plugin(tiny_recipe, "short_only", STOPPING_REWARD, replace=('name = "exact_match"', 'name = "short_only"'))
    proc = streamrl("recipe", "run", str(recipe), "--plain", "--no-report", "--set", 'engine.batching="slots"',
                    "--set", "engine.stop_early_every=1", "--set", "engine.max_new_tokens=12",
                    "--set", *shared_cluster.sets)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (tiny_recipe.parent / "runs").iterdir()
    records = read_records(run_dir)
    assert [r["step"] for r in records] == [0, 1]
    assert all(0 < r["stopped_early"] <= 1 for r in records)  # the share of each step's 16 samples
    for r in records:
        uids = [x["uid"] for x in r["sample_log"]]
        assert sorted(uids) == sorted(f"{r['step']}-{i:03d}-{k}" for i in range(4) for k in range(4))
        ended = [x for x in r["sample_log"] if x.get("stopped_early")]
        assert ended and all(x["response_len"] < 12 for x in ended)


class ExitsWhenAsked:
    """A grader script's reward: its stop_early calls sys.exit()."""

    def stop_early(self, prompt, text):
        raise SystemExit(3)


def test_a_stop_early_that_calls_sys_exit_stops_nothing_and_the_decode_loop_goes_on(tiny_model):
    engine = SlotEngine(HFEngineConfig(batching="slots", slots=8, max_prompt_tokens=16, max_new_tokens=6,
                                       temperature=1.0, profile=False, stop_early_every=2))
    engine.load(str(tiny_model))
    engine.decoder.stop_ids.fill_(-1)  # no response ends by itself: only the limit or the watch
    engine.stop_early_with(ExitsWhenAsked())
    try:
        with pytest.warns(RunWarning, match="stop_early raised SystemExit"):
            (group,) = engine.generate_groups([Prompt(uid="p", text="12+34=")], 2, [0.0])
        (again,) = engine.generate_groups([Prompt(uid="q", text="1+2=")], 2, [0.0])
        assert engine.loop_error is None and len(again) == 2
    finally:
        engine.close()
    assert all(len(s.response_ids) == 6 and "stopped_early" not in s.times for s in group)


class AlwaysHopeless:
    def stop_early(self, prompt, text):
        return True


def test_a_response_that_ends_at_its_limit_when_its_watch_comes_due_is_not_stopped_early(tiny_model):
    # max_new_tokens 4, asked every 4 tokens: the watch comes due in the step the limit ends it
    # (with every 2 it is asked before, and stops it: the watch works)
    for every, early in ((4, False), (2, True)):
        engine = SlotEngine(HFEngineConfig(batching="slots", slots=4, max_prompt_tokens=16, max_new_tokens=4,
                                           temperature=1.0, profile=False, stop_early_every=every))
        engine.load(str(tiny_model))
        engine.decoder.stop_ids.fill_(-1)  # no response ends by its EOS: only the limit or the watch
        engine.stop_early_with(AlwaysHopeless())
        try:
            (group,) = engine.generate_groups([Prompt(uid="p", text="12+34=")], 2, [0.0])
        finally:
            engine.close()
        assert all(("stopped_early" in s.times) is early for s in group), every
        assert all(len(s.response_ids) == (2 if early else 4) for s in group), every
