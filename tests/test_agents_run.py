"""Agent tasks end to end through the real CLI: an agent written only against the ``openai``
client trains on its multi-turn, tool-calling trajectories; a hung tool and a raising rollout
are contained and counted; the gym-style environment trains the same way."""

from __future__ import annotations

import json
import math

import pytest

from streamrl.serve.trajectories import MAX_SEGMENTS
from tests.helpers import ROOT, run_recipe

pytestmark = pytest.mark.slow

AGENT_RECIPE = ROOT / "recipes" / "agent.toml"
SMALL = ("trainer.prompts_per_step=4", "trainer.samples_per_prompt=4", "pools.agent.threads=4")

# the shipped calculator agent, and in every step one rollout that hangs in a synchronous tool and
# one that raises after talking to the model; in step 1 one more exits. Chosen by the rollout's id
# (step-prompt-k-tag), not by a count, so that every step has each failure whatever order the
# rollouts start in, and a raised error is the only one of its rank in steps 0, 2 and 3
FLAKY = (ROOT / "examples" / "agent" / "calculator_agent.py").read_text() + '''

import time as _time


async def flaky(client, row):
    step, prompt, k = client.default_headers["X-Streamrl-Rollout"].split("-")[:3]
    if (prompt, k) == ("000", "0"):
        await rollout(client, row)
        _time.sleep(60)  # a tool that hangs without ever awaiting: only its own thread is held
    if (prompt, k) == ("000", "1"):  # (one short call, then the error: no full rollout to time out first)
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}],
                                             max_tokens=4)
        raise ValueError("the tool exploded")
    if (step, prompt, k) == ("1", "001", "2"):  # sys.exit() in agent code: that rollout's error, no traceback
        raise SystemExit(3)
    return await rollout(client, row)
'''


def run_agent(tmp_path, source: str, function: str, *settings: str):
    """The agent recipe, small, with ``function`` of ``source`` (written to a file) as its agent."""
    agent = tmp_path / f"{function}_agent.py"
    agent.write_text(source)
    return run_recipe(AGENT_RECIPE, *SMALL, f'task.path="{agent}"', f'task.function="{function}"', *settings,
                      out=tmp_path / "runs", timeout=420)


def test_an_openai_client_agent_trains_on_its_trajectories_and_hung_or_raising_rollouts_are_contained(tmp_path):
    # 4 steps: a step has one or two multi-turn samples of its 15 or so, and none at times (3 steps
    # without one were seen once on a loaded machine)
    run = run_agent(tmp_path, FLAKY, "flaky", "run.steps=4", "task.rollout_timeout_s=16",
                    "run.step_timeout_s=120")  # (a stuck step says which task within the 420 s: the first one gets 2x)
    records = run.records
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    seen = set()
    for r in records:
        uids = [x["uid"] for x in r["sample_log"]]
        assert len(uids) == len(set(uids)) and not seen & set(uids)  # nothing trained twice
        seen |= set(uids)
        assert all(u.startswith(f"{r['step']}-") for u in uids)
        assert r["turns_mean"] > 0.5 and "tool_calls_mean" in r  # (the exiting rollout calls nothing)
        assert r["agent/timeouts"] >= 1 and r["agent/errors"] >= 1  # the hung and the raising rollouts
        if r["step"] != 1:  # (in step 1 the exiting rollout's error may be quoted instead)
            assert "the tool exploded" in r["agent/first_error"], r
    assert sum(r["agent/errors"] for r in records) >= 5
    # several turns with tool calls were trained (the warm-started model calls the tool at times)
    assert sum(r["tool_calls_mean"] for r in records) > 0
    assert max(r["turns_mean"] for r in records) > 1.0
    # the trace shows the trajectories: a reply that called the tool, its result, the answer
    trace = json.loads((run.dir / "trace.json").read_text())
    texts = [e["args"]["text"] for e in trace["traceEvents"]
             if e.get("name") == "generate" and "text" in e.get("args", {})]
    assert any("<tool_call>" in t and "<|tool|>" in t for t in texts)
    out = run.proc.stdout + run.proc.stderr
    assert "RolloutTimeout" in out or "exploded" in out  # named on the console
    assert "Traceback" not in out


def test_the_gym_style_environment_trains(tmp_path):
    env = ROOT / "examples" / "agent" / "calculator_env.py"
    run = run_recipe(AGENT_RECIPE, "run.steps=2", *SMALL, f'task.path="{env}"', 'task.function=""',
                     'task.environment="Calculator"', "task.max_turns=3", out=tmp_path / "runs", timeout=300)
    records = run.records
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["samples"] >= 16 and r["turns_mean"] >= 1.0 for r in records)


LOCAL_PARSER = '''
import streamrl
from streamrl.chat.tool_calls import HermesConfig, HermesToolParser
from streamrl.plugins.registry import Component

MARK = {mark!r}


class CountingParser(HermesToolParser):
    """Hermes's blocks, and a line in MARK per reply parsed (on the generate worker)."""

    def parse(self, text):
        content, calls = super().parse(text)
        with open(MARK, "a") as f:
            f.write(f"{{len(calls)}}\\n")
        return content, calls


@streamrl.hookimpl
def register_tool_parsers():
    return [Component("tool_parser", "counting_hermes", HermesConfig, CountingParser)]
'''


def test_a_tool_parser_from_a_recipe_local_file_parses_the_agents_calls(tmp_path):
    mark = tmp_path / "parsed.txt"
    parser = tmp_path / "counting_parser.py"
    parser.write_text(LOCAL_PARSER.format(mark=str(mark)))
    run = run_recipe(AGENT_RECIPE, "run.steps=1", *SMALL, f'plugins.modules=["{parser}"]',
                     'serve.tool_parser="counting_hermes"', out=tmp_path / "runs", timeout=420)
    assert [r["step"] for r in run.records] == [0]
    parsed = mark.read_text().split()  # written on the generate worker by the recipe's own file
    assert len(parsed) >= 16  # every rollout's replies (4 prompts x 4 rollouts, a call or more each)
    assert "Traceback" not in run.proc.stdout + run.proc.stderr


def test_an_agent_that_ends_its_process_stops_the_run_in_one_line_naming_task_path(tmp_path):
    from tests.helpers import sets, streamrl

    agent = tmp_path / "exiting_agent.py"
    agent.write_text("import os\n\n\nasync def rollout(client, row):\n    os._exit(3)\n")
    proc = streamrl("recipe", "run", str(AGENT_RECIPE), "--plain", "--no-report",
                    *sets("run.steps=2", *SMALL, f'task.path="{agent}"', 'task.function="rollout"',
                          f'run.out_dir="{tmp_path / "runs"}"', "cluster.dashboard_port=0"), timeout=420)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("streamrl: error: task agent-0-") and "took down every worker it ran on" in line, line
    assert f"task.path ({agent})" in line


# the shipped agent, whose every rollout from the run's second step on answers once and then
# hangs: as when one abusive rollout (megabytes of tool result, a CPU spin) starves the others
STARVED = (ROOT / "examples" / "agent" / "calculator_agent.py").read_text() + '''

import asyncio as _asyncio


async def starved(client, row):
    if client.default_headers["X-Streamrl-Rollout"].startswith("0-"):  # (its prompt's id: the step first)
        return await rollout(client, row)
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=4)
    await _asyncio.sleep(3600)
'''


def test_steps_whose_every_rollout_timed_out_train_on_and_only_three_in_a_row_stop_the_run(tmp_path):
    from tests.helpers import only_run, read_records, sets, streamrl

    agent = tmp_path / "starved_agent.py"
    agent.write_text(STARVED)
    proc = streamrl("recipe", "run", str(AGENT_RECIPE), "--plain", "--no-report",
                    *sets("run.steps=6", "run.mode=batch", *SMALL, f'task.path="{agent}"', 'task.function="starved"',
                          # (20 s: a healthy rollout of step 0 took over 5 s on a loaded machine)
                          "task.rollout_timeout_s=20", f'run.out_dir="{tmp_path / "runs"}"',
                          "cluster.dashboard=false"), timeout=420)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in out, out[-3000:]
    records = read_records(only_run(tmp_path / "runs"))
    # steps 2 and 3 timed out in every rollout, and trained on (their samples scored 0)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[0]["reward_errors_transient"] == 0
    for r in records[1:]:
        assert r["samples"] >= 16 and r["reward_errors"] == r["reward_errors_transient"] == r["samples"], r
        assert r["reward_mean"] == 0.0 and "RolloutTimeout" in r["reward_error_first"]
    assert "step 2: every rollout timed out or lost its endpoint" in out
    line = proc.stderr.strip().splitlines()[-1]
    assert "step 4: every rollout failed for 3 steps in a row" in line and "task.rollout_timeout_s" in line, line


# the shipped agent, and in every step one rollout that abuses everything at once: a tool result
# of 5 MB, a CPU spin that never awaits, then a loop of 500 calls; and one that returns 1e308
ABUSIVE = (ROOT / "examples" / "agent" / "calculator_agent.py").read_text() + '''

import time as _time


async def abusive(client, row):
    which = client.default_headers["X-Streamrl-Rollout"].split("-")[1:3]  # (step-prompt-k-tag)
    if which == ["001", "0"]:  # a reward that once overflowed a whole step's loss
        await rollout(client, row)
        return 1e308
    if which != ["000", "0"]:
        return await rollout(client, row)  # (all but the first prompt's first rollout of each step)
    messages = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": "calc"},
                {"role": "tool", "tool_call_id": "x", "content": "9" * 5_000_000}]
    try:
        await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    except Exception:
        pass
    end = _time.time() + 15
    while _time.time() < end:
        pass
    for _ in range(500):
        await client.chat.completions.create(model="policy", messages=messages[:1], max_tokens=1)
    return 1.0
'''


def test_one_abusive_rollout_a_step_leaves_the_others_and_the_run_going(tmp_path):
    run = run_agent(tmp_path, ABUSIVE, "abusive", "run.steps=2", "task.rollout_timeout_s=20")
    records = run.records
    assert [r["step"] for r in records] == [0, 1]
    # the others finished and were scored by the agent (the shipped one gets some products right)
    for r in records:
        assert r["samples"] - r["reward_errors"] >= 12, r
        # the abusive rollout ran: it timed out in its spin or its calls, or its calls (each a
        # trajectory segment of its own: the history was rewritten) were refused past the
        # segments one rollout may have -- its error, with the segments it had as its samples
        assert r["agent/timeouts"] == 1 or (r["agent/errors"] >= 1 and r["samples"] > MAX_SEGMENTS), \
            {k: r.get(k) for k in ("samples", "agent/timeouts", "agent/errors")}
        # 1e308 was an error of its rollout (scored 0), and the step trained with finite numbers
        assert r["agent/errors"] >= 1 and math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]), r
        assert 0.0 <= r["reward_mean"] <= 1.0
    assert any("1e+308" in (r.get("agent/first_error") or "") for r in records), [r.get("agent/first_error") for r in records]
    assert "Traceback" not in run.proc.stdout + run.proc.stderr


def test_a_restarted_generate_worker_gets_a_new_endpoint_and_the_rollouts_go_on(tmp_path):
    # kill -9 of the one generate worker mid-run: its nanny brings it back, the next step's
    # rollouts go to a new endpoint there, on the newest policy (not to the dead one's address,
    # every rollout failing from then on)
    from tests.helpers import kill_worker, read_records, sets, start_serving, wait_for_steps

    out, log = tmp_path / "runs", tmp_path / "run.log"
    proc = start_serving("recipe", "run", str(AGENT_RECIPE), "--no-report",
                         *sets("run.steps=10", *SMALL, f'run.out_dir="{out}"', "cluster.dashboard=false",
                               "task.rollout_timeout_s=20"), log=log)
    try:
        run_dir = wait_for_steps(proc, out, 2, timeout=300)
        killed_after = len(read_records(run_dir, partial=True))
        version = read_records(run_dir, partial=True)[-1]["policy_version"]
        kill_worker(run_dir, "generate-0")
        assert proc.wait(timeout=360) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    records = read_records(run_dir)
    assert [r["step"] for r in records] == list(range(10)), text[-3000:]
    assert killed_after < 10
    assert "generate worker generate-0 was restarted; its endpoint is http://127.0.0.1:" in text, text[-3000:]
    # the rollouts in flight at the kill failed (counted); the last step trained on rollouts the
    # restarted worker's engine decoded, at the policy it had caught up to or newer
    last = records[-1]
    assert last["samples"] > 0 and last["turns_mean"] > 0.5 and last["agent/errors"] == 0, last
    assert min(x["version"] for x in last["sample_log"]) >= version, last["sample_log"]
    assert "Traceback" not in text
