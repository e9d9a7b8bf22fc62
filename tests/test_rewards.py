"""The ``python`` reward (verl's and TRL's reward functions, weighted sums, failures contained,
one-line errors at validation) and the ``math`` reward (math-verify in threads, with a timeout
that works there), scored the way reward tasks score them (``rewards/scoring.py``)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import signal
import sys
import threading
import time
from functools import partial

import pytest

from streamrl.api import Reward
from streamrl.errors import UserError
from streamrl.plugins.resolve import resolve
from streamrl.recipe.recipe import load_recipe, validate_section
from streamrl.rewards.math_reward import MathReward, MathRewardConfig
from streamrl.rewards.python import PythonReward, PythonRewardConfig
from streamrl.rewards.scoring import score_group
from streamrl.sample import Prompt, Sample
from streamrl.telemetry.record import reward_means
from streamrl.telemetry.stats import TrainTaskStats
from tests.helpers import ROOT, TINY_RECIPE, run_recipe, streamrl

DATA = ROOT / "tests" / "data"


def group(prompt: Prompt, *texts: str) -> list[Sample]:
    return [Sample(uid=f"{prompt.uid}-{k}", prompt=prompt, prompt_ids=[1], response_ids=[2], logprobs=[0.0],
                   response_text=text) for k, text in enumerate(texts)]


def python_reward(**section) -> PythonReward:
    """Built as a worker builds it: validated as the recipe's [reward] table (paths relative to
    tests/data), pickled with cloudpickle, then built."""
    import cloudpickle

    config = validate_section(PythonRewardConfig, section, "reward", recipe_dir=DATA)
    return cloudpickle.loads(cloudpickle.dumps(partial(PythonReward, config)))()


def calls(reward: PythonReward) -> list:
    return reward.functions[0].fn.__globals__["CALLS"]


VERL_ROW = Prompt("0-000", "<templated> what is 6*7?", answer="42", columns={
    "data_source": "openai/gsm8k", "ability": "math", "reward_model": {"style": "rule", "ground_truth": "42"},
    "extra_info": {"split": "train", "index": 7}})


# -- python: the conventions ------------------------------------------------------------------


def test_a_verl_compute_score_gets_the_row_as_verl_passes_it():
    reward = python_reward(path="python_rewards.py")  # compute_score, found by its name
    g = score_group(reward, group(VERL_ROW, "42", " 41"))
    assert [s.reward for s in g] == [1.0, 0.0] and all(s.reward_info == {} for s in g)
    assert calls(reward) == [("compute_score", "openai/gsm8k", "42", "42", {"split": "train", "index": 7}),
                             ("compute_score", "openai/gsm8k", " 41", "42", {"split": "train", "index": 7})]
    # extra_info as the row holds it where it is not a dict (a CSV's text), as verl passes it; {} where none
    calls(reward).clear()
    as_text = Prompt("1-000", "what is 6*7?", answer="42", columns={"extra_info": "{'index': 7}"})
    bare = Prompt("2-000", "what is 6*7?", answer="42", columns={})
    assert [s.reward for s in score_group(reward, group(as_text, "42") + group(bare, "42"))] == [1.0, 1.0]
    assert [c[-1] for c in calls(reward)] == ["{'index': 7}", {}]


def test_a_verl_dict_gives_the_score_and_logs_its_other_numbers_per_step():
    reward = python_reward(path="python_rewards.py", function="scored_dict")
    g = score_group(reward, group(VERL_ROW, "42", "7", "no"))
    assert [s.reward for s in g] == [2.0, -1.0, -1.0]  # (a dict once scored 0 as an error)
    assert not any("reward_error" in s.times for s in g)
    # the string among its values is left out; a bool is a number
    assert g[0].reward_info == {"acc": 1.0, "length": 2.0} and g[1].reward_info == {"acc": 0.0, "length": 1.0}
    # what a train task sends and the step's record makes of them: reward/<name>/mean
    stats = TrainTaskStats()
    stats.add_reward_info(s.reward_info for s in g)
    assert reward_means([stats]) == {"reward/acc/mean": pytest.approx(1 / 3),
                                     "reward/length/mean": pytest.approx(5 / 3)}


def test_a_reward_that_names_a_value_per_sample_adds_a_bounded_number_of_fields_to_a_step():
    from streamrl.telemetry.names import REWARD_NAMES_KEPT

    # (each response's dict is small; their union over a step is what the record would hold)
    a, b = TrainTaskStats(), TrainTaskStats()
    a.add_reward_info({f"id{i:03d}": 1.0, "acc": 1.0} for i in range(100))
    b.add_reward_info({f"id{i:03d}": 1.0, "acc": 0.0} for i in range(100, 200))
    assert len(a.reward_info_sums) == len(b.reward_info_sums) == REWARD_NAMES_KEPT
    means = reward_means([a, b])
    assert len(means) == REWARD_NAMES_KEPT and means["reward/acc/mean"] == pytest.approx(0.5)


def test_a_trl_function_is_called_once_per_group_with_the_rows_columns_as_lists():
    reward = python_reward(path="python_rewards.py", function="contains_solution")
    plain = Prompt("0-001", "Solve 2+3.", answer="5", columns={"solution": "5", "level": 1})
    g = score_group(reward, group(plain, "it is 5", "it is 6", "5!"))
    assert [s.reward for s in g] == [1.0, 0.0, 1.0]
    assert [s.reward_info for s in g] == [{"none": 0.0}] * 3
    ((_, prompts, completions, solution, kwargs),) = calls(reward)  # one call for the group
    assert prompts == ["Solve 2+3."] * 3 and completions == ["it is 5", "it is 6", "5!"]
    assert solution == ["5"] * 3 and kwargs == {"level": [1] * 3, "answer": ["5"] * 3}

    # a chat row (the task kept its messages as the prompt column): completions are messages too;
    # a row without a solution gets None from the function: no reward (0), counted, no error
    messages = [{"role": "user", "content": "Solve 2+3."}]
    chat = Prompt("0-002", "<|user|>Solve 2+3.<|assistant|>", answer=None,
                  columns={"prompt": messages, "solution": None})
    g = score_group(reward, group(chat, "5", "6"))
    _, prompts, completions, solution, kwargs = calls(reward)[-1]
    assert prompts == [messages, messages] and completions == [[{"role": "assistant", "content": "5"}],
                                                               [{"role": "assistant", "content": "6"}]]
    assert solution == [None, None] and kwargs == {}
    assert [s.reward for s in g] == [0.0, 0.0] and [s.reward_info for s in g] == [{"none": 1.0}] * 2
    assert not any("reward_error" in s.times for s in g)
    # a row without the column at all: the function cannot be called, and each sample says why
    g = score_group(reward, group(Prompt("0-003", "Solve 1+1."), "2"))
    assert g[0].reward == 0.0 and "missing 1 required positional argument: 'solution'" in g[0].response_text


def test_weighted_functions_sum_and_each_is_logged_under_its_name():
    reward = python_reward(path="python_rewards.py", functions=[
        {"function": "scored_dict", "weight": 0.5},
        {"function": "contains_solution", "weight": 2.0, "name": "solved"},
        {"path": str(DATA / "python_rewards.py"), "function": "shorter", "weight": 1.0}])
    row = Prompt("0-003", "Solve 40+2.", answer="42", columns={"solution": "42"})
    g = score_group(reward, group(row, "42", "the answer is 42"))
    assert g[0].reward == pytest.approx(0.5 * 2.0 + 2.0 * 1.0 - 0.2)
    assert g[1].reward == pytest.approx(0.5 * -1.0 + 2.0 * 1.0 - 1.6)
    assert g[0].reward_info == {"scored_dict": 2.0, "scored_dict/acc": 1.0, "scored_dict/length": 2.0,
                                "solved": 1.0, "solved/none": 0.0, "shorter": pytest.approx(-0.2)}


# -- python: failures are contained per sample -------------------------------------------------


def test_a_function_that_raises_or_returns_no_score_fails_only_its_sample():
    reward = python_reward(path="python_rewards.py", function="misbehaves")
    g = score_group(reward, group(VERL_ROW, "raise", "none", "text", "nan", "nodict", "textdict", "bytes", "fine"))
    assert [s.reward for s in g] == [0.0] * 7 + [1.0]
    assert ["reward_error" in s.times for s in g] == [True] * 7 + [False]
    errors = [s.response_text.split("\n", 1)[1] for s in g[:7]]
    assert "ZeroDivisionError: nothing to divide" in errors[0]
    assert "returned None" in errors[1] and "returned str" in errors[2]
    assert "reward is nan" in errors[3] and "without 'score'" in errors[4]
    # text is not a reward, though float() reads it (inside a dict as well)
    assert "got str '1'; expected a number" in errors[5] and "returned bytes" in errors[6]
    assert all(e.startswith("[reward error: RewardFunctionError: misbehaves: ") for e in errors)


def test_a_trl_batch_that_fails_is_retried_one_completion_at_a_time():
    reward = python_reward(path="python_rewards.py", function="wrong_length")
    g = score_group(reward, group(VERL_ROW, "a", "b"))
    assert [s.reward for s in g] == [1.0, 1.0] and not any("reward_error" in s.times for s in g)


def test_a_verl_function_that_hangs_on_one_response_is_called_once_for_it_within_its_own_limit(tmp_path):
    # verl's functions score one response at a time: the group is not one call under the
    # group's allowance (a hung response would hold all of it, then be called again alone)
    (tmp_path / "hangs.py").write_text(
        "import threading\nRELEASE = threading.Event()\nCALLS = []\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    CALLS.append(solution_str)\n"
        "    if solution_str == 'hang':\n        RELEASE.wait(30)\n"
        "    return float(solution_str == ground_truth)\n")
    config = validate_section(PythonRewardConfig, {"path": "hangs.py"}, "reward", recipe_dir=tmp_path)
    reward = PythonReward(config)
    fn = reward.functions[0].fn
    assert not reward.scores_groups()
    try:
        g = score_group(reward, group(VERL_ROW, "42", "hang", "7"), timeout_s=1.0)
    finally:
        fn.__globals__["RELEASE"].set()
    assert [s.reward for s in g] == [1.0, 0.0, 0.0]
    assert g[1].reward_error.startswith("RewardTimeout: reward.score_timeout_s:")
    assert fn.__globals__["CALLS"] == ["42", "hang", "7"]
    assert python_reward(path="python_rewards.py", function="wrong_length").scores_groups()


def test_a_reward_whose_batch_method_raises_is_scored_one_response_at_a_time():
    class Batched(Reward):
        def score(self, prompt, response):
            return {"score": float(response == "ok"), "ok": 1.0}

        def score_group(self, prompts, responses):
            raise RuntimeError("the batch failed")

    g = score_group(Batched(), group(VERL_ROW, "ok", "no"))
    assert [(s.reward, s.reward_info) for s in g] == [(1.0, {"ok": 1.0}), (0.0, {"ok": 1.0})]


def test_the_reward_travels_as_its_files_text_not_as_a_path(tmp_path):
    import cloudpickle

    shutil.copy(DATA / "python_rewards.py", tmp_path / "mine.py")
    config = validate_section(PythonRewardConfig, {"path": "mine.py"}, "reward", recipe_dir=tmp_path)
    blob = cloudpickle.dumps(partial(PythonReward, config))
    (tmp_path / "mine.py").unlink()  # as on a worker of another machine
    reward = cloudpickle.loads(blob)()
    assert score_group(reward, group(VERL_ROW, "42"))[0].reward == 1.0
    assert cloudpickle.loads(cloudpickle.dumps(reward)).score(VERL_ROW, "42") == {"score": 1.0}


# -- python: one-line errors when the recipe is validated --------------------------------------

SIM_RECIPE = """
[run]
name = "rewards"
steps = 1
out_dir = "runs"

[pools.generate]
[pools.train]
[pools.reward]

[task]
name = "addition"

[engine]
name = "sim"

[trainer]
name = "sim"
prompts_per_step = 2
samples_per_prompt = 2

[reward]
name = "python"
"""


def validate(tmp_path, reward: str, rewards_file: str | None = None):
    """``resolve(load_recipe(...))`` of a recipe whose [reward] table ends with ``reward``, next to
    ``rewards.py`` (tests/data/python_rewards.py, or ``rewards_file``'s text)."""
    if rewards_file is None:
        shutil.copy(DATA / "python_rewards.py", tmp_path / "rewards.py")
    else:
        (tmp_path / "rewards.py").write_text(rewards_file)
    (tmp_path / "recipe.toml").write_text(SIM_RECIPE + reward)
    return resolve(load_recipe(tmp_path / "recipe.toml"))


def test_a_valid_python_reward_resolves(tmp_path):
    resolved = validate(tmp_path, 'path = "rewards.py"\n[[reward.functions]]\nfunction = "scored_dict"\n'
                                  '[[reward.functions]]\nfunction = "contains_solution"\nweight = 0.5\n')
    assert [f[1:] for f in resolved.reward.config.chosen()] == [("scored_dict", "scored_dict", 1.0),
                                                                ("contains_solution", "contains_solution", 0.5)]
    assert resolved.reward.config.functions[0].path == str(tmp_path / "rewards.py")
    # a positional-only parameter with a default is left to it by a call by name: not refused
    from streamrl.rewards.python import VERL, convention

    def cached(_cache=None, /, data_source=None, solution_str="", ground_truth=None, extra_info=None):
        return 1.0
    assert convention(cached) == VERL


def test_a_reward_file_is_read_in_the_encoding_its_coding_line_names(tmp_path):
    # Python reads a source file so; read as UTF-8 whatever it said, it could not be imported
    (tmp_path / "latin.py").write_bytes("# -*- coding: latin-1 -*-\n"
                                        "def compute_score(data_source, solution_str, ground_truth):\n"
                                        "    return float('é' in solution_str)\n".encode("latin-1"))
    (tmp_path / "recipe.toml").write_text(SIM_RECIPE + 'path = "latin.py"\n')
    reward = resolve(load_recipe(tmp_path / "recipe.toml")).reward.build()
    assert [s.reward for s in score_group(reward, group(VERL_ROW, "café", "cafe"))] == [1.0, 0.0]


@pytest.mark.parametrize("reward, rewards_file, expected", [
    ('path = "missing.py"', None, "reward.path: no such file: {tmp}/missing.py (got 'missing.py')"),
    ('path = "rewards.py"', "def compute_score(data_source, solution_str, ground_truth:\n    return 1\n",
     "reward.path: cannot import it: SyntaxError: "),
    ('path = "rewards.py"', "import no_such_package\n",
     "reward.path: cannot import it: ModuleNotFoundError: No module named 'no_such_package'"),
    # a script's own exit at its top level (sys.exit, argparse's usage) is not the run's end
    ('path = "rewards.py"', "import sys\nsys.exit(0)\n", "reward.path: cannot import it: SystemExit: 0"),
    ('path = "rewards.py"\nfunction = "nope"', None, "reward.function: rewards.py defines no function 'nope' (it "),
    ('path = "rewards.py"', "def accuracy(prompts, completions, **kwargs):\n    return [1.0]\n",
     "reward.function: rewards.py defines no function 'compute_score' (it defines: accuracy); "
     'name it with function = "<name>"'),
    ('path = "rewards.py"\nfunction = "two_args"', None,
     "reward.function: cannot tell how to call it from its parameters (a, b): expected (data_source, "),
    ('path = "rewards.py"', "def compute_score(data_source, solution_str, ground_truth, tokenizer):\n    return 1\n",
     "reward.function: needs tokenizer, which verl's convention does not pass"),
    ('path = "rewards.py"', "def compute_score(prompts, completions, completion_ids, **kwargs):\n    return []\n",
     "reward.function: needs completion_ids, which streamrl does not pass (give it a default)"),
    ('function = "compute_score"', None, "reward.path: required key missing"),
    ('path = "rewards.py"\nfunction = "compute_score"\n[[reward.functions]]\nfunction = "shorter"', None,
     "reward.function: give either function or [[reward.functions]] tables, not both"),
    ('path = "rewards.py"\n[[reward.functions]]\nfunction = "shorter"\n[[reward.functions]]\nfunction = "shorter"',
     None, "reward.functions: shorter named twice"),
    ('path = "rewards.py"\n[[reward.functions]]\nfunction = "shorter"\n[[reward.functions]]\nfunction = "gone"',
     None, "reward.functions.1.function: rewards.py defines no function 'gone'"),
    ('path = "rewards.py"\n[[reward.functions]]\nfunction = "shorter"\nname = "score"\n[[reward.functions]]\n'
     'function = "scored_dict"', None, 'reward.functions: a function named "score" would hide the weighted sum'),
    ('path = "rewards.py"', "def compute_score(data_source, solution_str, ground_truth, /):\n    return 1\n",
     "reward.function: takes data_source, solution_str, ground_truth positionally only (before '/')"),
    ('path = "rewards.py"', "def compute_score(prompts, completions, /, **kwargs):\n    return [1.0]\n",
     "reward.function: takes prompts, completions positionally only (before '/')"),
    ('[[reward.functions]]\nfunction = "shorter"', None,
     "reward.functions.0.function: no file: give path here or reward.path"),
    ('path = "rewards.py"\n[[reward.functions]]\npath = "other.py"\nfunction = "shorter"', None,
     "reward.functions.0.path: no such file"),
])
def test_a_bad_python_reward_is_one_line_at_validation(tmp_path, reward, rewards_file, expected):
    with pytest.raises(UserError) as err:
        validate(tmp_path, reward, rewards_file)
    message = str(err.value)
    assert message.startswith(expected.format(tmp=tmp_path)), message
    assert "\n" not in message


def test_recipe_validate_prints_the_error_on_one_line(tmp_path):
    shutil.copy(DATA / "python_rewards.py", tmp_path / "rewards.py")
    (tmp_path / "recipe.toml").write_text(SIM_RECIPE + 'path = "rewards.py"\nfunction = "nope"\n')
    proc = streamrl("recipe", "validate", str(tmp_path / "recipe.toml"), timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("streamrl: error: reward.function: rewards.py defines no function 'nope'")
    assert len(proc.stderr.strip().splitlines()) == 1


# -- math ---------------------------------------------------------------------------------------

EQUIVALENT = [("0.5", "so the answer is \\boxed{\\frac{1}{2}}"), ("\\frac{1}{2}", "It is 1/2."),
              ("1/2", "we get x = 0.5"), ("42", "First 40, then 2 more: 42"), ("3", "\\boxed{3.0}")]
WRONG = [("0.5", "\\boxed{\\frac{1}{3}}"), ("42", "the answer is 41")]


needs_math_verify = pytest.mark.skipif(importlib.util.find_spec("math_verify") is None,
                                       reason="math-verify is not installed: pip install 'streamrl[math]'")


@pytest.fixture
def math_reward():
    reward = MathReward(MathRewardConfig(timeout_s=5.0, processes=2))
    yield reward
    reward.close()


@needs_math_verify
def test_math_scores_equivalent_answers_from_several_threads_at_once(math_reward):
    cases = (EQUIVALENT + WRONG) * 2
    results: dict[int, float] = {}

    def score(i, gold, response):
        results[i] = math_reward.score(Prompt(f"0-{i}", "q", answer=gold), response)["score"]

    threads = [threading.Thread(target=score, args=(i, *c)) for i, c in enumerate(cases)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [results.get(i) for i in range(len(cases))] == ([1.0] * len(EQUIVALENT) + [0.0] * len(WRONG)) * 2


@needs_math_verify
def test_math_verify_alone_scores_a_right_answer_0_in_a_thread_and_ours_scores_1(math_reward):
    from math_verify import parse, verify

    def as_verl_and_trl_call_it(gold, response):
        # math-verify's default timeouts use signal.alarm: off the main thread it raises, and the
        # reward's except turns every answer into a 0
        try:
            return float(verify(parse(gold), parse(response)))
        except Exception:
            return 0.0

    gold, response = "0.5", "\\boxed{\\frac{1}{2}}"
    assert as_verl_and_trl_call_it(gold, response) == 1.0  # in the main thread it works
    out = {}
    thread = threading.Thread(target=lambda: out.update(
        theirs=as_verl_and_trl_call_it(gold, response),
        ours=math_reward.score(Prompt("0-0", "q", answer=gold), response)["score"]))
    thread.start()
    thread.join(timeout=60)
    assert out == {"theirs": 0.0, "ours": 1.0}


@needs_math_verify
def test_math_cuts_off_a_check_that_would_hang_and_scores_it_0():
    # verifying 9^(9^(9^9)) against 2 makes sympy compute without end (measured: over 20 s)
    # (4 s: the fresh process that takes over checks its first answer cold, slow on a loaded machine)
    reward = MathReward(MathRewardConfig(timeout_s=4.0, processes=1))
    try:
        prompt = Prompt("0-0", "q", answer="2")
        reward.score(prompt, "\\boxed{3}")  # (the check process started: the timeout is the check's)
        result = {}
        worker = threading.Thread(target=lambda: result.update(
            g=score_group(reward, group(prompt, "\\boxed{9^{9^{9^{9}}}}", "\\boxed{2}"))))
        start = time.monotonic()
        worker.start()
        worker.join(timeout=40)
        elapsed = time.monotonic() - start
        g = result["g"]
        assert [s.reward for s in g] == [0.0, 1.0] and not any("reward_error" in s.times for s in g)
        assert g[0].reward_info == {"answered": 0.0, "timeout": 1.0}
        assert g[1].reward_info == {"answered": 1.0, "timeout": 0.0}  # a fresh process took over
        # cut at its 4 s timeout: the check itself would run for far longer than the join waited
        assert 4.0 <= elapsed and not worker.is_alive(), elapsed
    finally:
        reward.close()


@needs_math_verify
def test_a_check_left_running_by_a_dead_reward_ends_itself_at_its_cpu_limit():
    from streamrl.rewards.math_reward import _Checker

    checker = _Checker()
    try:
        # sent by hand, as a reward would before its process died: nobody waits to kill it
        checker.proc.stdin.write(json.dumps({"gold": "2", "response": "\\boxed{9^{9^{9^{9}}}}", "cpu_s": 1.0})
                                 .encode() + b"\n")
        assert checker.proc.wait(timeout=30) == -signal.SIGXCPU
    finally:
        checker.kill()


@needs_math_verify
def test_math_reads_verls_ground_truth_and_gives_format_score_to_a_wrong_answer():
    reward = MathReward(MathRewardConfig(format_score=0.1))
    try:
        row = Prompt("0-0", "q", columns={"reward_model": {"style": "rule", "ground_truth": "\\frac{3}{4}"}})
        g = score_group(reward, group(row, "\\boxed{0.75}", "\\boxed{0.7}", "no idea"))
        assert [s.reward for s in g] == [1.0, 0.1, 0.0]
        assert [s.reward_info["answered"] for s in g] == [1.0, 1.0, 0.0]
        g = score_group(reward, group(Prompt("0-1", "q"), "\\boxed{1}"))  # no ground truth: an error
        assert g[0].reward == 0.0 and "no ground truth" in g[0].response_text
    finally:
        reward.close()


def test_math_without_math_verify_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # as if not installed
    expected = r"^reward.name = \"math\": needs math-verify .*pip install 'streamrl\[math\]'$"
    with pytest.raises(UserError, match=expected):
        validate_section(MathRewardConfig, {}, "reward")


@pytest.mark.slow
@needs_math_verify
def test_math_scores_in_a_dask_worker_thread():
    from distributed import Client, LocalCluster

    import multiprocessing

    reward = MathReward(MathRewardConfig(timeout_s=5.0))
    with LocalCluster(n_workers=1, processes=True, threads_per_worker=2, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster) as client:
        # a Dask worker is a daemonic process: multiprocessing may not start children there
        assert client.submit(lambda: multiprocessing.current_process().daemon).result()
        groups = [group(Prompt(f"0-{i}", "q", answer=gold), response, "\\boxed{7}")
                  for i, (gold, response) in enumerate(EQUIVALENT)]
        futures = [client.submit(score_group, reward, g, pure=False) for g in groups]
        scored = client.gather(futures)
    assert [[s.reward for s in g] for g in scored] == [[1.0, 0.0]] * len(EQUIVALENT)


# -- end to end --------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_recipe_with_python_rewards_runs_and_logs_each_function(tmp_path, tiny_model, shared_cluster):
    shutil.copy(DATA / "python_rewards.py", tmp_path / "rewards.py")
    text = TINY_RECIPE.format(out=tmp_path / "runs", model=tiny_model).replace(
        '[reward]\nname = "exact_match"\n',
        '[reward]\nname = "python"\npath = "rewards.py"\n'
        '[[reward.functions]]\nfunction = "scored_dict"\n'
        '[[reward.functions]]\nfunction = "answer_in"\nweight = 0.5\n'
        '[[reward.functions]]\nfunction = "shorter"\nweight = 0.1\nname = "brevity"\n')
    (tmp_path / "recipe.toml").write_text(text)
    records = run_recipe(tmp_path / "recipe.toml", *shared_cluster.sets, timeout=300).records
    assert len(records) == 2
    for r in records:
        assert r["reward_errors"] == 0
        means = {k: v for k, v in r.items() if k.startswith("reward/")}
        assert set(means) == {f"reward/{k}/mean" for k in (
            "scored_dict", "scored_dict/acc", "scored_dict/length", "answer_in", "answer_in/none", "brevity")}
        assert 0.0 <= means["reward/scored_dict/acc/mean"] <= 1.0 and means["reward/answer_in/none/mean"] == 0.0
        assert means["reward/brevity/mean"] == pytest.approx(-means["reward/scored_dict/length/mean"] / 10)
        # the reward is the weighted sum of the functions
        total = (means["reward/scored_dict/mean"] + 0.5 * means["reward/answer_in/mean"]
                 + 0.1 * means["reward/brevity/mean"])
        assert r["reward_mean"] == pytest.approx(total, abs=1e-6)


@pytest.mark.slow
@needs_math_verify
def test_the_math_reward_runs_on_the_shipped_verl_dataset(tmp_path, shared_cluster):
    # verl's layout (chat prompts, reward_model.ground_truth) through the dataset task, checked by
    # math-verify on the reward workers of a real run
    text = TINY_RECIPE.format(out=tmp_path / "runs", model=ROOT / "models" / "tiny-word-problems")
    text = text.replace('[task]\nname = "addition"\n',
                        f'[task]\nname = "dataset"\npath = "{ROOT / "data" / "word-problems" / "train.parquet"}"\n')
    text = text.replace('[reward]\nname = "exact_match"\n', '[reward]\nname = "math"\n')
    text = text.replace("max_new_tokens = 6", "max_new_tokens = 16")
    # a step at the tiny recipe's lr can unlearn the boxes (measured: 8 of 16 answered after it):
    # this checks the reward, not learning, so the policy stays the warm-started one
    text = text.replace("lr = 1e-3", "lr = 1e-7")
    (tmp_path / "recipe.toml").write_text(text)
    records = run_recipe(tmp_path / "recipe.toml", *shared_cluster.sets, timeout=300).records
    assert [r["reward_errors"] for r in records] == [0, 0]
    assert all(r["reward/timeout/mean"] == 0.0 for r in records)
    # the warm-started model boxes its answers: math-verify reads them
    assert all(r["reward/answered/mean"] > 0.5 for r in records), [r["reward/answered/mean"] for r in records]


def test_deadline_calls_reuse_their_threads_and_a_hung_call_holds_only_its_own():
    import threading

    from streamrl.rewards.scoring import RewardTimeout, call_with_deadline

    call_with_deadline(lambda: 1.0, timeout_s=5)  # a runner exists
    before = threading.active_count()
    assert [call_with_deadline(lambda k=k: float(k), timeout_s=5) for k in range(200)] == [float(k) for k in range(200)]
    assert threading.active_count() == before  # 200 calls, no new thread
    release = threading.Event()
    with pytest.raises(RewardTimeout):
        call_with_deadline(release.wait, timeout_s=0.05)
    assert call_with_deadline(lambda: 2.0, timeout_s=5) == 2.0  # the next call is not stuck behind it
    # the hung call holds its thread, the next got an idle one (if another test left one) or a new one
    assert before <= threading.active_count() <= before + 1
    release.set()


def test_exact_match_gives_nothing_for_a_prompt_without_an_answer_even_to_the_reply_none():
    from streamrl.rewards.exact_match import ExactMatch, ExactMatchConfig

    reward = ExactMatch(ExactMatchConfig())
    assert reward.score(Prompt("0-000", "say 7", answer="7"), " 7\n") == 1.0
    assert reward.score(Prompt("0-001", "say something", answer=None), "None") == 0.0


# -- scoring: what a failure and a reward's named values may hold ------------------------------


class Gives(Reward):
    """A reward that gives (or raises, when it is an exception) ``value`` for every response."""

    def __init__(self, value):
        self.value = value

    def score(self, prompt, response):
        if isinstance(self.value, BaseException):
            raise self.value
        return self.value


@pytest.mark.parametrize("timeout_s", [None, 5.0])
def test_a_reward_raising_what_is_not_an_exception_scores_0_with_its_error(timeout_s):
    import asyncio

    class FunctionTimedOut(BaseException):  # (func_timeout's: a BaseException, not an Exception)
        pass

    for exc, name in [(asyncio.CancelledError("cancelled"), "CancelledError"), (FunctionTimedOut("late"), "FunctionTimedOut")]:
        g = score_group(Gives(exc), group(Prompt("0-000", "p"), "a", "b"), timeout_s=timeout_s)
        assert [s.reward for s in g] == [0.0, 0.0] and all(s.times["reward_error"] == 1.0 for s in g)
        assert name in g[0].reward_error
    with pytest.raises(KeyboardInterrupt):  # (the user's Ctrl-C is never a failed score)
        score_group(Gives(KeyboardInterrupt()), group(Prompt("0-000", "p"), "a"), timeout_s=timeout_s)


def test_a_rewards_error_text_is_one_printable_bounded_line():
    g = score_group(Gives(ValueError("the model wrote:\n\x1b[2J\x1b]0;title\x07" + "x" * 5000)),
                    group(Prompt("0-000", "p"), "a"))
    error = g[0].reward_error
    assert error.startswith("ValueError: the model wrote:\\n\\x1b[2J") and error.isprintable() and len(error) <= 500
    assert g[0].response_text == "a\n[reward error: " + error + "]"


def test_a_rewards_named_values_are_bounded_in_number_and_length_and_never_the_main_reward():
    many = {"score": 1.0, **{f"k{i}": float(i) for i in range(1000)}}
    (s,) = score_group(Gives(many), group(Prompt("0-000", "p"), "a"))
    assert s.reward == 1.0 and len(s.reward_info) == 32 and "k0" in s.reward_info
    odd = {"score": 1.0, "": 1.0, "/": 2.0, "./..": 3.0, "x" * 1000: 4.0, "a\nb": 5.0, "ok": 6.0, "\x1b" * 64: 7.0}
    (s,) = score_group(Gives(odd), group(Prompt("0-000", "p"), "a"))
    # ("", "/" and "./.." would be a tracker's reward/mean: the main reward's name)
    assert s.reward_info == {"x" * 64: 4.0, "a\\nb": 5.0, "ok": 6.0, "\\x1b" * 16: 7.0}
