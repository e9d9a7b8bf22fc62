"""Agents' calls through the endpoint, in this process on CPU (a real uvicorn server and the
real ``openai`` client, no cluster): tool calls parsed into OpenAI's form, a rollout's calls
joined into one trajectory whose tokens and log-probs are the engine's, a rewritten history
split, the loss mask in the trainer's batch, and the agent task's one-line errors."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import openai
import pytest
import torch

from streamrl.engines.base import HFEngineConfig
from streamrl.engines.slots import SlotEngine
from streamrl.errors import UserError
from streamrl.recipe.recipe import validate_section
from streamrl.recipe.serve import ServeConfig
from streamrl.sample import Prompt, Sample
from streamrl.serve.openai_api import Endpoint
from streamrl.chat.tool_calls import HermesToolParser
from streamrl.serve.traffic import Traffic
from streamrl.training.logprobs import naive_token_logprobs, pad_batch
from tests.helpers import ROOT, endpoint_in_process

CALC_MODEL = ROOT / "models" / "tiny-calculator"
KEY = "the-runs-rollout-key"
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]


@pytest.fixture
def learning(served):
    """``served`` as a serving run's endpoint: it learns from outside traffic (an agent run's
    learns from its rollouts only)."""
    api, url = served
    api.learns_from_traffic = True
    try:
        yield api, url
    finally:
        api.learns_from_traffic = False


@pytest.fixture(scope="module")
def served():
    """The calculator model behind a real endpoint on a free loopback port."""
    engine = SlotEngine(HFEngineConfig(batching="slots", slots=8, max_prompt_tokens=128, max_new_tokens=64,
                                       temperature=1.0, profile=False))
    engine.load(str(CALC_MODEL))
    api = Endpoint(engine, ServeConfig(port=0), Traffic(60.0), "policy", HermesToolParser(), rollout_key=KEY)
    try:
        with endpoint_in_process(api) as url:
            yield api, url
    finally:
        engine.close()


def rollout_client(url: str, rid: str, key: str = KEY) -> openai.OpenAI:
    headers = {"X-Streamrl-Rollout": rid, **({"X-Streamrl-Rollout-Key": key} if key else {})}
    return openai.OpenAI(base_url=url, api_key="x", default_headers=headers, max_retries=0)


def finish(url: str, rid: str, key: str = KEY) -> dict:
    import httpx

    return httpx.post(f"{url}/streamrl/rollouts/{rid}/finish", headers={"X-Streamrl-Rollout-Key": key},
                      timeout=30).json()


def test_a_client_without_the_runs_rollout_key_cannot_join_or_finish_a_rollout(served):
    import httpx

    api, url = served
    before = len(api.trajectories._rollouts)
    for key in ("", "wrong"):
        with pytest.raises(openai.PermissionDeniedError) as err:
            rollout_client(url, "intruder", key).chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "6*7"}], max_tokens=2)
        assert err.value.status_code == 403 and "run's own agent rollouts" in str(err.value)
        r = httpx.post(f"{url}/streamrl/rollouts/intruder/finish", headers={"X-Streamrl-Rollout-Key": key}, timeout=30)
        assert r.status_code == 403 and r.json()["error"]["code"] == "rollout_forbidden"
    assert len(api.trajectories._rollouts) == before  # nothing of it was kept
    # the same request without the header is an ordinary one: answered, but never kept for a
    # step (an agent run's steps take none: it would wait for the run's whole life), and
    # feedback naming it is refused at once
    outside = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    waiting, ready = api.traffic.waiting(), len(api.traffic._ready)
    ok = outside.chat.completions.create(model="policy", messages=[{"role": "user", "content": "6*7"}], max_tokens=2)
    assert ok.choices[0].message is not None
    assert (api.traffic.waiting(), len(api.traffic._ready)) == (waiting, ready)
    r = httpx.post(f"{url}/feedback", json={"id": ok.id, "reward": 1.0}, timeout=30)
    assert r.status_code == 400 and "learns from its own rollouts only" in r.json()["error"]["message"], r.text


def test_the_hermes_parser_turns_blocks_into_calls_and_leaves_broken_ones_as_text():
    p = HermesToolParser()
    assert p.parse('ok <tool_call>{"name": "calc", "arguments": {"x": "2*3"}}</tool_call>') == (
        "ok", [{"name": "calc", "arguments": '{"x": "2*3"}'}])
    assert p.parse('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b"}</tool_call>')[1] == [
        {"name": "a", "arguments": "{}"}, {"name": "b", "arguments": "{}"}]
    assert p.parse("<tool_call>{not json</tool_call>") == ("<tool_call>{not json</tool_call>", [])
    assert p.parse("plain") == ("plain", [])


def two_turns(url: str, rid: str, greedy_first: bool = False):
    """An agent's two calls: the model's first reply, a tool result, the second reply."""
    client = rollout_client(url, rid)
    messages = [{"role": "user", "content": "What is 12*34?"}]
    first = client.chat.completions.create(model="anything", messages=messages, tools=TOOLS, max_tokens=64)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": "c", "content": "408"})
    second = client.chat.completions.create(model="anything", messages=messages, tools=TOOLS, max_tokens=64)
    return first, second, messages


def test_a_rollouts_calls_join_one_trajectory_with_the_engines_tokens_and_logprobs(served):
    api, url = served
    first, second, _ = two_turns(url, "r-join")
    traj = finish(url, "r-join")
    assert traj["calls"] == 2 and traj["splits"] == 0 and len(traj["segments"]) == 1
    seg = traj["segments"][0]
    a = first.model_extra["streamrl"]
    b = second.model_extra["streamrl"]
    gen1, gen2 = a["choices"][0]["token_ids"], b["choices"][0]["token_ids"]
    # the second prompt is the first prompt, the first reply's own tokens, then the template's
    # text for the tool turn and the next header -- never the reply re-tokenised
    assert b["prompt_token_ids"][:len(a["prompt_token_ids"]) + len(gen1)] == a["prompt_token_ids"] + gen1
    gap = b["prompt_token_ids"][len(a["prompt_token_ids"]) + len(gen1):]
    tok = api.tokenizer
    assert tok.decode(gap, skip_special_tokens=False) == "<|tool|>408<|end|><|assistant|>"
    assert seg["prompt_ids"] == a["prompt_token_ids"]
    assert seg["response_ids"] == gen1 + gap + gen2
    assert seg["loss_mask"] == [1] * len(gen1) + [0] * len(gap) + [1] * len(gen2)
    assert seg["logprobs"][:len(gen1)] == a["choices"][0]["logprobs"]
    assert seg["logprobs"][-len(gen2):] == b["choices"][0]["logprobs"]
    # the behaviour log-probs are what the trainer computes for the same tokens (same weights)
    ids = torch.tensor([seg["prompt_ids"] + seg["response_ids"]])
    with torch.no_grad():
        lp = naive_token_logprobs(api.engine.model, ids, torch.ones_like(ids))[0, len(seg["prompt_ids"]) - 1:]
    for k, m in enumerate(seg["loss_mask"]):
        if m:
            assert abs(lp[k].item() - seg["logprobs"][k]) < 1e-4, k
    # asked again (its first answer timed out on the way back): the same trajectory, not an empty
    # one that lost the rollout; a call of it after the hand-over is still refused
    assert finish(url, "r-join") == traj
    with pytest.raises(openai.ConflictError):
        rollout_client(url, "r-join").chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "6*7"}], max_tokens=2)
    # a call's reward is its rollout's: feedback naming the call is refused, and the call is ended
    # in the traffic's tables (not kept as running for the whole run)
    import httpx

    r = httpx.post(f"{url}/feedback", json={"id": first.id, "reward": 1.0}, timeout=30)
    assert r.status_code == 400 and "is a call of an agent's rollout" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "id"


def test_a_reply_with_a_tool_call_comes_back_as_openai_tool_calls(served):
    api, url = served
    client = rollout_client(url, "r-tools")
    # the warm-started model calls the tool on some questions: ask until one does
    for k in range(30):
        r = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": f"What is {10 + k}*47?"}],
                                           tools=TOOLS, max_tokens=64)
        if r.choices[0].message.tool_calls:
            break
    msg = r.choices[0].message
    assert msg.tool_calls, "the model never called the tool in 30 tries"
    assert r.choices[0].finish_reason == "tool_calls"
    call = msg.tool_calls[0]
    assert call.type == "function" and call.function.name == "calc" and call.id.startswith("call_")
    assert "x" in json.loads(call.function.arguments)
    finish(url, "r-tools")


def test_a_rewritten_history_starts_a_new_segment_and_counts_the_split(served):
    api, url = served
    client = rollout_client(url, "r-split")
    messages = [{"role": "user", "content": "What is 21*43?"}]
    first = client.chat.completions.create(model="p", messages=messages, tools=TOOLS, max_tokens=64)
    # the agent rewrites the model's reply before going on: the trajectory cannot continue
    messages += [{"role": "assistant", "content": "something else"}, {"role": "user", "content": "again?"}]
    second = client.chat.completions.create(model="p", messages=messages, tools=TOOLS, max_tokens=64)
    traj = finish(url, "r-split")
    assert traj["splits"] == 1 and len(traj["segments"]) == 2
    assert traj["segments"][1]["prompt_ids"] == second.model_extra["streamrl"]["prompt_token_ids"]
    assert traj["segments"][0]["response_ids"] == first.model_extra["streamrl"]["choices"][0]["token_ids"]
    assert all(m == 1 for s in traj["segments"] for m in s["loss_mask"])


def test_a_rollouts_call_asks_for_one_reply(served):
    api, url = served
    with pytest.raises(openai.BadRequestError, match="n = 1"):
        rollout_client(url, "r-n").chat.completions.create(model="p", messages=[{"role": "user", "content": "1"}], n=2)


def test_the_loss_mask_leaves_tool_tokens_out_of_the_trainers_batch():
    prompt = Prompt(uid="p", text="")
    s = Sample(uid="s", prompt=prompt, prompt_ids=[1, 5, 6], response_ids=[7, 8, 9, 10], logprobs=[-1, 0, 0, -2],
               loss_mask=[1, 0, 0, 1])
    plain = Sample(uid="t", prompt=prompt, prompt_ids=[1, 5], response_ids=[7, 8], logprobs=[-1, -1])
    _, _, resp, old = pad_batch([s, plain], 0)
    assert resp[0].tolist() == [0, 0, 1, 0, 0, 1]
    assert resp[1].tolist()[:3] == [0, 1, 1]


def agent_section(tmp_path: Path, code: str, **more) -> dict:
    f = tmp_path / "agent.py"
    f.write_text(code)
    return {"path": str(f), "data": {"path": str(ROOT / "data" / "calculator" / "train.jsonl")}, **more}


@pytest.mark.parametrize("code, more, says", [
    ("async def rollout(client, row):\n    return 1.0\n", {}, "set exactly one of function"),
    ("def rollout(client, row):\n    return 1.0\n", {"function": "rollout"}, "no async function 'rollout'"),
    ("x = 1\n", {"environment": "Env"}, "no class 'Env' subclassing"),
    ("import nowhere_to_be_found\n", {"function": "rollout"}, "ModuleNotFoundError"),
])
def test_a_wrong_agent_file_is_one_line(tmp_path, code, more, says):
    from streamrl.tasks.agent import AgentConfig

    with pytest.raises(UserError) as e:
        validate_section(AgentConfig, agent_section(tmp_path, code, **more), "task")
    assert says in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith("task.")


def test_an_agents_data_mistake_names_the_task_data_table(tmp_path):
    # the rows come from [task.data]: its mistakes were said as task.prompt_key, task.path (which
    # is the agent's .py file there)
    from streamrl.tasks.agent import AgentConfig, AgentTask

    section = agent_section(tmp_path, "async def rollout(client, row):\n    return 1.0\n", function="rollout")
    section["data"]["prompt_key"] = "question"
    with pytest.raises(UserError) as e:
        AgentTask(validate_section(AgentConfig, section, "task"))
    assert str(e.value).startswith("task.data.prompt_key: the rows of ") and "no field 'question'" in str(e.value)


def test_new_weights_between_two_calls_keep_the_trajectory_and_mark_each_tokens_version(served):
    api, url = served
    engine = api.engine
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    client = rollout_client(url, "r-versions")
    messages = [{"role": "user", "content": "What is 33*44?"}]
    first = client.chat.completions.create(model="p", messages=messages, tools=TOOLS, max_tokens=64)
    v0 = engine.version
    engine.load_weights({n: p + 0.01 * torch.randn_like(p) for n, p in before.items()}, v0 + 1)
    try:
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "sure?"}]
        second = client.chat.completions.create(model="p", messages=messages, tools=TOOLS, max_tokens=64)
    finally:
        engine.load_weights(before, v0 + 2)
    (seg,) = finish(url, "r-versions")["segments"]
    n1 = len(first.model_extra["streamrl"]["choices"][0]["token_ids"])
    n2 = len(second.model_extra["streamrl"]["choices"][0]["token_ids"])
    versions, mask = seg["policy_versions"], seg["loss_mask"]
    assert len(versions) == len(seg["response_ids"]) == len(mask)
    assert versions[:n1] == [v0] * n1 and versions[-n2:] == [v0 + 1] * n2  # each call's own policy
    assert all(v == v0 for v, m in zip(versions[n1:-n2], mask[n1:-n2]))  # the gap: context, the earlier version
    assert seg["logprobs"][:n1] == first.model_extra["streamrl"]["choices"][0]["logprobs"]  # the behaviour kept


def test_feedback_by_session_rewards_every_waiting_completion_of_it(learning):
    import httpx

    api, url = learning
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    before = api.traffic.snapshot()["rewarded"]
    for q in ("What is 11*11?", "And 12*12?"):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": q}], max_tokens=8,
                                       extra_body={"session": "conversation-7"})
    r = httpx.post(f"{url}/feedback", json={"session": "conversation-7", "reward": 1.0})
    assert r.status_code == 200 and r.json()["completions"] == 2
    assert api.traffic.snapshot()["rewarded"] == before + 2  # both, ready for a training step
    again = httpx.post(f"{url}/feedback", json={"session": "conversation-7", "reward": 1.0})
    assert again.status_code == 400 and "already rewarded" in again.json()["error"]["message"]
    unknown = httpx.post(f"{url}/feedback", json={"session": "nobody", "reward": 1.0})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "session"
    both = httpx.post(f"{url}/feedback", json={"session": "s", "id": "cmpl-1", "reward": 1.0})
    assert both.status_code == 400 and both.json()["error"]["message"] == \
        "give exactly one of 'id' (a completion) and 'session'."


def test_a_reward_that_is_not_a_finite_bounded_number_is_refused_and_never_trained(learning):
    # One such value among a batch's once overflowed the step's loss and ended the run.
    import httpx

    api, url = learning
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    cid = client.completions.create(model="policy", prompt="12*12=", max_tokens=4).id
    before = api.traffic.snapshot()["rewarded"]
    for bad in ("1e308", "-1e7", "Infinity", "-Infinity", "NaN", '"NaN"', '"3"', "true", "null"):
        body = '{"id": "%s", "reward": %s}' % (cid, bad)
        r = httpx.post(f"{url}/feedback", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == "reward", (bad, r.json())
    assert api.traffic.snapshot()["rewarded"] == before  # nothing of them reached training
    assert httpx.post(f"{url}/feedback", json={"id": cid, "reward": -1e6}).status_code == 200  # the bound itself
    # the run's reward.limit is the endpoint's bound
    api.reward_limit = 10.0
    try:
        cid = client.completions.create(model="policy", prompt="12*12=", max_tokens=4).id
        r = httpx.post(f"{url}/feedback", json={"id": cid, "reward": 10.5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "reward" and "reward.limit" in r.text, r.text
        assert httpx.post(f"{url}/feedback", json={"id": cid, "reward": -10.0}).status_code == 200
    finally:
        api.reward_limit = 1e6


def test_a_reward_past_the_limit_is_a_counted_error_wherever_it_comes_from():
    from streamrl.rewards.scoring import REWARD_LIMIT, reward_value

    assert reward_value(REWARD_LIMIT) == (REWARD_LIMIT, {}) and reward_value({"score": -2.5}) == (-2.5, {})
    for bad in (1e308, -1e7, {"score": 2e6}, float("nan"), 10**400):
        with pytest.raises(ValueError, match="reward is"):
            reward_value(bad)
    assert reward_value({"score": 1.0, "n": 10**400, "m": 2}) == (1.0, {"m": 2.0})  # a value past range: left out
    # reward.limit: the run's own bound, for a reward function's scores as for an agent's
    from streamrl.agents.rollout import RolloutThread, _outcome, as_reward
    from streamrl.recipe.recipe import RewardSection
    from streamrl.rewards.scoring import score_group

    def sample() -> Sample:
        return Sample(uid="0-0", prompt=Prompt(uid="0", text="1+1="), prompt_ids=[1], response_ids=[2],
                      logprobs=[0.0], response_text="2")

    assert reward_value(5e6, limit=1e7) == (5e6, {})
    with pytest.raises(ValueError, match=r"reward.limit"):
        reward_value(5.0, limit=4.0)

    class Fives:
        def score(self, prompt, response):
            return 5.0

    group = score_group(Fives(), [sample(), sample()], limit=4.0)
    assert [(s.reward, "reward.limit" in s.reward_error) for s in group] == [(0.0, True), (0.0, True)]
    assert [s.reward for s in score_group(Fives(), [sample()], limit=5.0)] == [5.0]

    async def five():
        return 5.0

    for limit, says in ((4.0, "reward.limit"), (5.0, "")):
        thread = RolloutThread(as_reward(five, limit))
        thread.start(), thread.join(10)
        outcome = _outcome(thread, time.time(), 60)
        assert says in outcome.error and outcome.reward == (0.0 if says else 5.0)
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            RewardSection(name="exact_match", limit=bad)


def test_a_streamed_tool_call_comes_as_openai_streams_it_and_the_trajectory_continues(served):
    api, url = served
    for k in range(40):
        rid = f"r-stream-{k}"
        client = rollout_client(url, rid)
        messages = [{"role": "user", "content": f"What is {20 + k}*31?"}]
        content, calls, reason = "", {}, None
        for chunk in client.chat.completions.create(model="p", messages=messages, tools=TOOLS, max_tokens=64,
                                                    stream=True):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for c in choice.delta.tool_calls or []:
                    calls[c.index] = c
                reason = choice.finish_reason or reason
        if calls:
            break
    assert calls, "the model never called the tool in 40 tries"
    assert "<tool_call>" not in content and reason == "tool_calls"  # no call markup streamed as content
    call = calls[0]
    assert call.function.name == "calc" and "x" in json.loads(call.function.arguments)
    # the message the agent rebuilt from the stream continues the trajectory (no split)
    messages += [{"role": "assistant", "content": content or None,
                  "tool_calls": [{"id": call.id, "type": "function",
                                  "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": "620"}]
    client.chat.completions.create(model="p", messages=messages, tools=TOOLS, max_tokens=64)
    traj = finish(url, rid)
    assert traj["splits"] == 0 and traj["calls"] == 2 and len(traj["segments"]) == 1
    with pytest.raises(openai.APIStatusError) as late:  # the rollout is over: a late call is refused
        client.chat.completions.create(model="p", messages=messages, tools=TOOLS, max_tokens=8)
    assert late.value.status_code == 409 and late.value.code == "rollout_finished"
    # a template or tokenizer that refuses a rollout's messages is a 400, not "finished"
    api, _ = served
    real = api.trajectories.prompt
    api.trajectories.prompt = lambda *a, **k: (_ for _ in ()).throw(ValueError("the template says no"))
    try:
        with pytest.raises(openai.BadRequestError) as refused:
            rollout_client(url, rid + "-new").chat.completions.create(model="p", messages=messages, max_tokens=8)
    finally:
        api.trajectories.prompt = real
    assert refused.value.param == "messages" and "the template says no" in refused.value.message


def test_a_steps_quoted_failure_is_a_raised_error_before_a_timeout_before_a_rollout_without_calls():
    from streamrl.agents.rollout import NO_CALLS, first_error

    timeout = "RolloutTimeout: the rollout ran past task.rollout_timeout_s (12 s)"
    raised = "ValueError: the tool exploded"
    kept = ""
    for error in (NO_CALLS, timeout, raised, "KeyError: 'x'", timeout):
        kept = first_error(kept, error)
    assert kept == raised  # (the earlier of two raised errors)
    assert first_error(first_error("", NO_CALLS), timeout) == timeout
    assert first_error(timeout, NO_CALLS) == timeout


@pytest.mark.parametrize("kind, arg", [(SystemExit, 3), (KeyboardInterrupt, ""), (BaseException, "odd"), (ValueError, "v")])
def test_an_agent_that_exits_or_raises_anything_is_that_rollouts_error_named_without_a_traceback(kind, arg, caplog):
    import gc

    from streamrl.agents.rollout import RolloutThread, _outcome

    async def agent():
        raise kind(arg) if arg != "" else kind()

    thread = RolloutThread(agent)
    with caplog.at_level("ERROR", logger="asyncio"):
        thread.start()
        thread.join(10)
        error = _outcome(thread, time.time(), 60).error
        del thread
        gc.collect()  # (where asyncio would say "Task exception was never retrieved", with a traceback)
    assert caplog.records == []
    assert error == f"{kind.__name__}: {arg}"


def test_an_agent_failure_is_transient_only_when_its_endpoint_timed_out_was_unreachable_or_overloaded():
    """A step whose every failure is transient trains on (``optimizer_step``); a raised bug does not."""
    import httpx

    from streamrl.agents.rollout import RolloutThread, _outcome, transient_failure

    request = httpx.Request("POST", "http://127.0.0.1:1/v1/chat/completions")

    def status(code: int) -> openai.APIStatusError:
        return openai.APIStatusError("x", response=httpx.Response(code, request=request), body=None)

    assert transient_failure(openai.APITimeoutError(request=request))
    assert transient_failure(openai.APIConnectionError(request=request))
    assert transient_failure(httpx.ConnectError("refused", request=request))
    assert transient_failure(status(503)) and transient_failure(status(429))
    assert not transient_failure(status(400)) and not transient_failure(status(401))
    assert not transient_failure(ValueError("the tool exploded")) and not transient_failure(SystemExit(3))
    # the recipe's tool parser failing on the reply: its bug, the same at every step
    parser = openai.InternalServerError("x", response=httpx.Response(500, request=request),
                                        body={"message": "serve.tool_parser P failed", "code": "tool_parser_failed"})
    assert parser.code == "tool_parser_failed" and not transient_failure(parser)

    async def overloaded():
        raise openai.APITimeoutError(request=request)

    async def hangs():
        import asyncio

        await asyncio.sleep(30)

    done, hung = RolloutThread(overloaded), RolloutThread(hangs)
    done.start(), hung.start()
    done.join(10)
    assert _outcome(done, time.time(), 60).transient
    timed_out = _outcome(hung, time.time(), 0.1)
    assert timed_out.transient and timed_out.error.startswith("RolloutTimeout")


def test_a_groups_rollouts_each_get_a_row_of_their_own_and_a_huge_returned_int_is_that_rollouts_error(served):
    from distributed import Client, LocalCluster

    from streamrl.agents.rollout import run_group

    api, url = served
    source = '''
async def rollout(client, row):
    row["prompt"].append({"role": "user", "content": "and again?"})  # as an agent that extends its conversation
    turns = len(row["prompt"])
    await client.chat.completions.create(model="policy", messages=row["prompt"], max_tokens=2)
    row.pop("answer")
    return 10 ** 5000 if row["huge"] else float(turns)
'''
    spec = {"path": "agent.py", "source": source, "function": "rollout", "timeout_s": 60.0}
    # a real Dask worker (in this process: it reaches the endpoint on loopback), as the run's
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, protocol="tcp://", host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster) as client:
        for huge in (False, True):
            prompt = Prompt(uid=f"p{huge:d}", text="", columns={
                "prompt": [{"role": "user", "content": "What is 2+3?"}], "answer": "5", "huge": huge})
            (group,) = client.submit(run_group, prompt, 4, [url], spec, "", 0, rollout_key=KEY, pure=False).result(120)
            assert len(group) == 4
            if not huge:  # each saw its own two turns, none its siblings' (nor lost the answer to one)
                assert [s.reward for s in group] == [2.0] * 4 and not any(s.reward_error for s in group)
            else:
                assert all(s.reward == 0.0 and "past a float's range" in s.reward_error for s in group), group[0].reward_error
            assert prompt.columns["prompt"] == [{"role": "user", "content": "What is 2+3?"}]  # the task's row


def test_an_agents_error_is_one_printable_bounded_line():
    from streamrl.agents.rollout import RolloutThread, _outcome, as_reward

    async def agent():
        raise ValueError("the model said:\n\x1b[31mred\x1b[0m" + "x" * 5000)

    class Odd:  # (no number: the rollout's result is quoted in its error, by its repr)
        def __repr__(self):
            return "\x1b[2J\n" * 50

    async def odd():
        return Odd()

    for fn, start in [(agent, "ValueError: the model said:\\n\\x1b[31mred"), (odd, "TypeError: the rollout returned")]:
        thread = RolloutThread(as_reward(fn))
        thread.start(), thread.join(10)
        error = _outcome(thread, time.time(), 60).error
        assert error.startswith(start) and error.isprintable() and len(error) <= 500, error


def test_a_result_whose_number_exits_or_never_comes_ends_its_rollout_alone():
    # the rollout's result was read into a reward on the group's own thread, past the rollout's
    # timeout: a __float__ that called sys.exit() ended the group's task, one that looped hung it
    import sys

    from streamrl.agents.rollout import RolloutThread, _outcome, as_reward

    class Exits:
        def __float__(self):
            sys.exit(3)

    released = threading.Event()

    class Loops:
        def __float__(self):
            while not released.is_set():  # (for ever, as far as the rollout can tell; let go at the test's end)
                time.sleep(0.01)
            return 0.0

    async def exits():
        return Exits()

    async def loops():
        return Loops()

    thread = RolloutThread(as_reward(exits))
    thread.start(), thread.join(10)
    outcome = _outcome(thread, time.time(), 60)
    assert outcome.reward == 0.0 and "SystemExit" in outcome.error and not outcome.transient
    hung, started = RolloutThread(as_reward(loops)), time.time()
    hung.start(), hung.join(0.5)
    outcome = _outcome(hung, started, 0.5)
    released.set()
    assert outcome.error.startswith("RolloutTimeout") and time.time() - started < 5


@pytest.mark.parametrize("example", ["calculator_env.py", "calculator_agent.py"])
def test_the_shipped_calculator_tool_answers_error_to_whatever_the_model_writes(example):
    # (users copy it: arguments the model wrote that int() or str() refuse were the rollout's error)
    import importlib.util

    spec = importlib.util.spec_from_file_location("calc_example", ROOT / "examples" / "agent" / example)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.calc("12*3") == "36" and module.calc(" 9 - 4 ") == "5"
    for hostile in ["2*²", "1" * 5000 + "*2", "9" * 3000 + "*" + "9" * 3000, 5, ["1"], None, "9**9**9"]:
        assert module.calc(hostile) == "error", repr(hostile)[:40]


def test_a_rollout_stuck_past_its_timeout_is_counted_and_past_the_bound_the_worker_runs_no_more(monkeypatch):
    # (Python cannot stop a thread: an agent that never awaits keeps its own until it returns)
    import threading
    from types import SimpleNamespace

    from streamrl.agents import rollout
    from streamrl.sample import Prompt

    release = threading.Event()

    async def blocks(client, row):
        release.wait(30)  # (a blocking call: the cancel at the timeout never lands)

    thread = rollout.RolloutThread(lambda: blocks(None, None))
    started = time.time()
    thread.start()
    thread.join(0.2)
    outcome = rollout._outcome(thread, started, 0.2)
    assert outcome.error.startswith("RolloutTimeout") and thread in rollout._STUCK
    held = rollout.stuck()
    # past the bound the next group starts no thread: its rollouts are that error, said in the step's counts
    events = []
    monkeypatch.setattr(rollout, "MAX_STUCK", held)
    monkeypatch.setattr(rollout, "get_worker", lambda: SimpleNamespace(name="agent-0",
                                                                       log_event=lambda topic, m: events.append(m)))
    before = threading.active_count()
    spec = {"path": "a.py", "source": "async def f(client, row):\n    return 1.0\n", "function": "f", "timeout_s": 5}
    assert rollout.run_group(Prompt(uid="0-0", text="x"), 4, ["http://127.0.0.1:9"], spec, "", 0) == []
    assert threading.active_count() == before
    (counts,) = events
    assert counts["errors"] == 4 and counts["stuck"] >= 1  # (this one, and any other test's still ending)
    assert counts["first_error"].startswith(f"AgentStuck: {counts['stuck']} rollouts of worker agent-0")
    release.set()
    thread.join(5)
    rollout.stuck()
    assert thread not in rollout._STUCK  # (one that ends is counted no more)


def test_a_groups_trajectories_are_asked_for_side_by_side(monkeypatch):
    # (httpx's own test transport stands in for the endpoint) each answer waits until all four
    # are asked: one after another, the first never got its answer and the group lost every rollout
    from types import SimpleNamespace

    import httpx

    from streamrl.agents import rollout

    together = threading.Barrier(4, timeout=20)

    def handler(request):
        together.wait()
        return httpx.Response(200, json={"segments": [], "calls": 0, "tool_calls": 0, "splits": 0})

    events = []
    monkeypatch.setattr(rollout, "_HTTP", httpx.Client(transport=httpx.MockTransport(handler)))
    monkeypatch.setattr(rollout, "get_worker", lambda: SimpleNamespace(name="agent-0",
                                                                       log_event=lambda topic, m: events.append(m)))
    spec = {"path": "a.py", "source": "async def f(client, row):\n    return 1.0\n", "function": "f", "timeout_s": 5}
    assert rollout.run_group(Prompt(uid="0-0", text="x"), 4, ["http://127.0.0.1:9"], spec, "", 0) == []
    (counts,) = events
    assert counts["errors"] == 0 and counts["no_calls"] == 4, counts  # (all four answered: none called the model)


def test_a_trajectory_whose_answer_timed_out_is_asked_for_again(monkeypatch):
    # (httpx's own test transport stands in for a slow endpoint) the first answer never came back:
    # asked again, the endpoint gives the same trajectory (above), and the rollout is not lost
    import httpx

    from streamrl.agents import rollout

    asked = []

    def handler(request):
        asked.append(str(request.url))
        if len(asked) == 1:
            raise httpx.ReadTimeout("timed out", request=request)
        return httpx.Response(200, json={"segments": [], "calls": 3, "tool_calls": 1, "splits": 0})

    monkeypatch.setattr(rollout, "_HTTP", httpx.Client(transport=httpx.MockTransport(handler)))
    traj = rollout._finish("http://127.0.0.1:9/v1", "", "r-late", KEY)
    assert traj["calls"] == 3 and asked == ["http://127.0.0.1:9/v1/streamrl/rollouts/r-late/finish"] * 2
    monkeypatch.setattr(rollout, "_HTTP", httpx.Client(transport=httpx.MockTransport(
        lambda request: (_ for _ in ()).throw(httpx.ReadTimeout("timed out", request=request)))))
    with pytest.raises(httpx.ReadTimeout):
        rollout._finish("http://127.0.0.1:9/v1", "", "r-gone", KEY)


def test_the_runs_rollouts_queue_past_max_pending_and_other_requests_are_refused(served):
    # (a run whose agent pool holds more rollouts than serve.max_pending) each rollout past it got
    # a 429, then failed after the client's two retries, and was trained at reward 0
    api, url = served
    config = api.config
    api.config = config.model_copy(update={"max_pending": 1})
    api.pending += 1  # (one completion running already: the endpoint is full)
    try:
        reply = rollout_client(url, "r-queued").chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "6*7"}], max_tokens=2)
        assert reply.choices[0].message is not None
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=url, api_key="x", max_retries=0).chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "6*7"}], max_tokens=2)
    finally:
        api.pending -= 1
        api.config = config
    finish(url, "r-queued")


def test_a_hand_over_asked_again_while_the_first_is_built_gets_the_same_trajectory(served, monkeypatch):
    # the client asks again when its first answer timed out, which is when that answer is still
    # being built: the second ask found the rollout gone and nothing kept, and got an empty one
    import threading
    import time

    api, url = served
    two_turns(url, "r-race")
    store = api.trajectories
    decode = store.tokenizer.decode

    class Slow:
        def __getattr__(self, name):
            return getattr(store.tokenizer_real, name)

        def decode(self, *args, **kwargs):
            time.sleep(0.5)
            return decode(*args, **kwargs)

    monkeypatch.setattr(store, "tokenizer_real", store.tokenizer, raising=False)
    monkeypatch.setattr(store, "tokenizer", Slow())
    first = []
    thread = threading.Thread(target=lambda: first.append(store.finish("r-race")))
    thread.start()
    time.sleep(0.1)
    second = store.finish("r-race")
    thread.join()
    assert second == first[0] and second["calls"] == 2 and second["segments"]
    assert store.finish("r-race") == second  # (kept for a client that asks again, however often)


def test_a_rollout_the_endpoint_dropped_is_a_409_with_its_reason_and_the_agent_side_says_it(served, monkeypatch):
    # (an empty trajectory before: counted as an agent that never called the model, its reason lost)
    import httpx

    from streamrl.agents import rollout
    from streamrl.serve import trajectories as store

    api, url = served
    two_turns(url, "r-dropped")
    monkeypatch.setattr(store, "STALE_ROLLOUT_S", 0.0)
    rollout_client(url, "r-sweeper").chat.completions.create(  # (its call sweeps the stale ones first)
        model="anything", messages=[{"role": "user", "content": "What is 1+1?"}], max_tokens=4)
    monkeypatch.setattr(store, "STALE_ROLLOUT_S", 3600.0)
    r = httpx.post(f"{url}/streamrl/rollouts/r-dropped/finish", headers={"X-Streamrl-Rollout-Key": KEY}, timeout=30)
    assert r.status_code == 409 and r.json()["error"]["code"] == "rollout_finished", r.text
    assert "dropped after 0 s without a call" in r.json()["error"]["message"]
    with pytest.raises(rollout.RolloutDropped, match="Rollout 'r-dropped' is finished: dropped after 0 s"):
        rollout._finish(url, "", "r-dropped", KEY)


def test_a_tool_that_blocks_in_a_thread_of_its_own_past_the_timeout_is_counted_stuck():
    # (asyncio.to_thread, as the AgentStuck message advises): the rollout's thread ended at its
    # cancel while the tool's thread ran on in the loop's pool, uncounted, one more per rollout
    import asyncio

    from streamrl.agents import rollout

    release = threading.Event()

    async def tool_blocks(client, row):
        await asyncio.to_thread(release.wait, 30)

    thread = rollout.RolloutThread(lambda: tool_blocks(None, None))
    thread.start()
    thread.join(0.3)
    thread.abandon()  # (the group's cancel at the timeout: the await ends, the tool's thread does not)
    thread.join(5)
    assert not thread.is_alive()
    tools = [t for t in rollout._STUCK if t.name.startswith("streamrl-rollout-tool")]
    assert tools and all(t.is_alive() for t in tools)
    release.set()
    for t in tools:
        t.join(5)
    rollout.stuck()
    assert not any(t in rollout._STUCK for t in tools)  # (ended: counted no more)
