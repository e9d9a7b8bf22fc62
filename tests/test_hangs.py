"""Nothing hangs, and a user mistake is one line: the real command, real worker processes, real
signals and real sockets.

SIGTERM sent to the whole process group (systemd, Slurm, ``kill -- -PGID``) stops a run as
SIGTERM to its pid does; a reward that never returns is cut off by ``reward.score_timeout_s``;
a ``cluster.address`` that is not a Dask scheduler (a web server, a service that speaks first,
a scheme without its backend) is one line within a deadline; a broken recipe-local plugin, a
component whose constructor raises, a reward calling ``sys.exit()`` and weights whose shapes do
not fit the engine are one line each, never a traceback."""

from __future__ import annotations

import http.server
import json
import os
import re
import signal
import socket
import threading
import time

import pytest

from tests.helpers import (kill_worker, last_error_line, one_line_error, read_records, sets, start, stop, streamrl,
                           wait_for_steps, with_plugin, worker_addresses, worker_processes)


# -- SIGTERM to the process group ----------------------------------------------------------

@pytest.mark.slow
def test_sigterm_to_the_process_group_stops_the_run_in_order_and_names_the_resume_command(tiny_recipe, tmp_path):
    # the CLI leads its own process group, as under systemd or Slurm; its workers are in it
    proc = start("recipe", "run", str(tiny_recipe), "--plain", "--set", f"run.out_dir={tmp_path}",
                 "--set", "run.steps=400")
    try:
        run_dir = wait_for_steps(proc, tmp_path, 2)
        # a worker its nanny restarts is spawned while the CLI has its own SIGTERM handler, which
        # a new process does not inherit: the group's signal must spare it too
        before = worker_addresses(run_dir)
        kill_worker(run_dir, "generate-0")
        deadline = time.time() + 120  # (its restart is what the signal must find done: steps take 0.1 s)
        while worker_addresses(run_dir).get("generate-0") in (None, before["generate-0"]):
            assert time.time() < deadline and proc.poll() is None
            time.sleep(0.2)
        done = len(read_records(run_dir))
        wait_for_steps(proc, tmp_path, done + 2)
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=180)  # a hang guard only
    finally:
        stop(proc)
    assert proc.returncode == 130, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("streamrl: stopped after step ") and f"Resume with: streamrl recipe resume {run_dir}" in last
    state = json.loads((run_dir / "status.json").read_text())
    assert state["state"] == "interrupted", state
    assert (run_dir / "checkpoints" / f"step-{state['step']:06d}").is_dir()
    # the trainer was never lost (it is what the checkpoint was taken from) ...
    assert "lost its state" not in err and "Restarting worker" not in err.split("SIGTERM:")[-1], err[-3000:]
    # ... and nothing of the run outlives it
    deadline = time.time() + 30
    while True:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        assert time.time() < deadline, "worker processes outlived the run"
        time.sleep(0.2)


@pytest.mark.slow
def test_sigterm_to_the_process_group_while_the_cluster_starts_stops_the_run_after_its_first_step(tiny_recipe, tmp_path):
    proc = start("recipe", "run", str(tiny_recipe), "--plain", "--set", f"run.out_dir={tmp_path}",
                 "--set", "run.steps=400")
    try:
        # the first worker process started: the embedded cluster is starting (its start takes seconds)
        deadline = time.time() + 120
        while proc.poll() is None and time.time() < deadline and not worker_processes(proc.pid):
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=180)  # a hang guard only
    finally:
        stop(proc)
    # the signal was held, not lost: the run stopped after its first step, with a checkpoint
    assert proc.returncode == 130, err[-3000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if (p / "status.json").exists()]
    assert err.strip().splitlines()[-1] == (
        f"streamrl: stopped after step 1 of 400; checkpoint step-000001 written. Resume with: "
        f"streamrl recipe resume {run_dir}"), err[-3000:]
    assert "Traceback" not in err and "Restarting worker" not in err, err[-3000:]
    state = json.loads((run_dir / "status.json").read_text())
    assert state["state"] == "interrupted" and state["step"] == 1, state


HANGING_ALGORITHM = '''
import threading

from streamrl.algorithms.grpo import GRPO, GRPOConfig
from streamrl.api import Component, hookimpl


class HangsLater(GRPO):
    """GRPO until its loss has run 4 times (step 1's micro-batches); then its call never returns."""

    calls = 0

    def __init__(self, config):
        super().__init__(config)
        self.zero_advantage_no_gradient = False  # every sample reaches the loss, whatever its reward

    def loss(self, new, old, ref, adv, mask):
        self.calls += 1
        if self.calls > 4:
            threading.Event().wait()
        return super().loss(new, old, ref, adv, mask)


@hookimpl
def register_algorithms():
    return [Component("algorithm", "hangs_later", GRPOConfig, HangsLater)]
'''


@pytest.mark.slow
def test_a_step_that_hangs_on_a_live_worker_stops_the_run_at_run_step_timeout_s_naming_the_task(tiny_recipe):
    recipe = with_plugin(tiny_recipe, "hangs_later", HANGING_ALGORITHM, extra='\n[algorithm]\nname = "hangs_later"\n')
    t0 = time.perf_counter()
    proc = streamrl("recipe", "run", str(recipe), "--set", "run.steps=4", "--set", "run.checkpoint_every=1",
                    "--set", "run.mode=batch", "--set", "run.step_timeout_s=15", "--plain", "--no-report")
    took = time.perf_counter() - t0
    last = last_error_line(proc, 1)
    (run_dir,) = (tiny_recipe.parent / "runs").iterdir()
    assert re.fullmatch(r"streamrl: error: step 2 did not finish within 15 s \(run.step_timeout_s\); still running: "
                        r"train-1 \S+ on train-0(, .*)?; the last checkpoint is step-000001 \(resume with: "
                        rf"streamrl recipe resume {re.escape(str(run_dir))}, --set to change the recipe\)", last), last
    state = json.loads((run_dir / "status.json").read_text())
    assert state["state"] == "failed" and state["error"].startswith("StepTimeout: step 2 did not finish")
    assert took < 120, took  # (a hang guard: the hung worker is closed with the cluster, not waited for)


# -- reward.score_timeout_s ----------------------------------------------------------------

HANGING_REWARD = '''
import itertools
import threading

from pydantic import BaseModel

from streamrl.api import Component, Reward, hookimpl


class Empty(BaseModel):
    pass


class Hangs(Reward):
    """Every 4th response's grader waits for ever; the rest score 1.0."""

    def __init__(self, config):
        self.calls = itertools.count()

    def score(self, prompt, response):
        if next(self.calls) % 4 == 0:
            threading.Event().wait()
        return 1.0


@hookimpl
def register_rewards():
    return [Component("reward", "hangs", Empty, Hangs)]
'''


@pytest.mark.slow
def test_a_reward_that_never_returns_is_cut_off_scored_zero_and_counted(tiny_recipe):
    recipe = with_plugin(tiny_recipe, "hangs", HANGING_REWARD, replace=('name = "exact_match"', 'name = "hangs"'))
    proc = streamrl("recipe", "run", str(recipe), "--plain", "--no-report", "--set", "reward.score_timeout_s=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    (run_dir,) = (tiny_recipe.parent / "runs").iterdir()
    recs = read_records(run_dir)
    assert [r["reward_errors"] for r in recs] == [4, 4]  # of 16 samples a step
    assert all(r["reward_error_first"].startswith("RewardTimeout: reward.score_timeout_s:") for r in recs), recs
    assert all(r["reward_mean"] == pytest.approx(0.75) for r in recs)
    step_lines = [line for line in proc.stderr.splitlines() if line.startswith("step ")]
    assert len(step_lines) == 2 and all("reward errors 4/16 (RewardTimeout: reward.score_timeout_s" in line
                                        for line in step_lines), step_lines


def test_score_group_cuts_off_a_late_batch_and_late_or_exiting_responses_alone():
    # no cluster: the containment itself, for a reward that scores a group in one call
    from streamrl.api import Reward
    from streamrl.rewards.scoring import score_group
    from streamrl.sample import Prompt, Sample

    release = threading.Event()

    class Batched(Reward):
        def score_group(self, prompts, responses):
            release.wait()  # the batch call never comes back in time
            return [1.0] * len(responses)

        def score(self, prompt, response):
            if response == "hang":
                release.wait()
            if response == "exit":
                raise SystemExit(3)
            return 1.0

    prompt = Prompt(uid="p", text="1+1=", answer="2")
    group = [Sample(uid=f"p-{i}", prompt=prompt, prompt_ids=[1], response_ids=[2], logprobs=[0.0], response_text=text)
             for i, text in enumerate(["ok", "hang", "exit", "ok"])]
    try:
        score_group(Batched(), group, timeout_s=1.0)  # (room for a thread hand-off on a loaded machine)
    finally:
        release.set()  # lets the abandoned calls end
    assert [s.reward for s in group] == [1.0, 0.0, 0.0, 1.0]
    assert group[1].reward_error.startswith("RewardTimeout: reward.score_timeout_s:")
    assert group[2].reward_error == "RuntimeError: the reward raised SystemExit(3) (sys.exit() called while scoring)"
    assert [("reward_error" in s.times) for s in group] == [False, True, True, False]


def test_a_score_group_that_yields_its_scores_is_held_to_the_deadline_as_it_is_read():
    from streamrl.api import Reward
    from streamrl.rewards.scoring import score_group
    from streamrl.sample import Prompt, Sample

    release = threading.Event()

    class Lazy(Reward):
        def score_group(self, prompts, responses):  # a generator: the work happens as it is read
            for r in responses:
                if r == "hang":
                    release.wait(30)
                yield 1.0

        def score(self, prompt, response):
            if response == "hang":
                release.wait(30)
            return 1.0

    prompt = Prompt(uid="p", text="1+1=", answer="2")
    group = [Sample(uid=f"p-{i}", prompt=prompt, prompt_ids=[1], response_ids=[2], logprobs=[0.0], response_text=text)
             for i, text in enumerate(["ok", "hang"])]
    t0 = time.monotonic()
    try:
        score_group(Lazy(), group, timeout_s=1.0)
    finally:
        release.set()
    assert time.monotonic() - t0 < 20  # (read outside the deadline, it waited for the hung one)
    assert [s.reward for s in group] == [1.0, 0.0] and "reward_error" in group[1].times


def test_a_reward_with_score_only_is_scored_one_response_at_a_time_with_or_without_a_limit():
    # a plugin's reward need not subclass Reward: score() alone is enough
    from streamrl.rewards.scoring import score_group
    from streamrl.sample import Prompt, Sample

    class ScoreOnly:
        def score(self, prompt, response):
            return float(len(response) % 2 == 0)

    prompt = Prompt(uid="p", text="1+1=", answer="2")
    for limit in (None, 5.0):
        group = [Sample(uid=f"p-{i}", prompt=prompt, prompt_ids=[1], response_ids=[2], logprobs=[0.0],
                        response_text=text) for i, text in enumerate(["ab", "abc"])]
        score_group(ScoreOnly(), group, timeout_s=limit)
        assert [s.reward for s in group] == [1.0, 0.0]
        assert not any("reward_error" in s.times for s in group)


# -- cluster.address that is not a Dask scheduler ----------------------------------------

class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def http_server():
    """A real HTTP server on 127.0.0.1 (it waits for a request line, as Dask's dashboard does)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"tcp://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def banner_server():
    """A real service on 127.0.0.1 that speaks first (an SSH banner), then waits."""
    sock = socket.create_server(("127.0.0.1", 0))
    conns = []

    def serve():
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            conns.append(conn)
            conn.sendall(b"SSH-2.0-OpenSSH_9.6p1 Ubuntu-3ubuntu13\r\n")

    threading.Thread(target=serve, daemon=True).start()
    yield f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()
    for conn in conns:
        conn.close()


@pytest.mark.parametrize("server, says", [
    ("http_server", "sent nothing within 3s (cluster.connect_timeout)"),
    ("banner_server", "is not a Dask scheduler: it sent 'SSH-2.0-OpenSSH_9.6p1 Ubuntu-3ubuntu13'"),
    ("ucx://127.0.0.1:9", "Dask cannot connect to ucx://127.0.0.1:9 from here"),
    # (TLS asked for, with no certificate in Dask's config: Dask's own message blames the scheduler)
    ("tls://127.0.0.1:9", "is a TLS address but Dask's config gives this process no certificate"),
])
def test_a_cluster_address_that_is_not_a_dask_scheduler_is_one_line(server, says, tiny_recipe, request):
    address = server if "://" in server else request.getfixturevalue(server)
    recipe = tiny_recipe.parent / "address.toml"
    recipe.write_text(tiny_recipe.read_text().replace("[cluster]\n", f'[cluster]\naddress = "{address}"\n'
                                                                      "connect_timeout = 3\n"))
    proc = streamrl("recipe", "run", str(recipe), "--plain", timeout=90)  # hung before: the deadline is the test
    last = last_error_line(proc, 2)
    assert last.startswith(f"streamrl: error: cluster.address: ") and address in last, last
    assert says in last and "expected" in last, last


# -- one line, no traceback ----------------------------------------------------------------

def test_a_recipe_local_plugin_with_a_syntax_error_is_one_line(tiny_recipe, capsys):
    from streamrl.cli import main

    recipe = with_plugin(tiny_recipe, "broken", "def broken(:\n    pass\n")
    said = (f"streamrl: error: plugins.modules: 'broken.py' cannot be loaded ({recipe.parent / 'broken.py'}, "
            "line 1): SyntaxError: invalid syntax")
    # validate in this process, as the command runs it; run as a user runs it
    assert main(["recipe", "validate", str(recipe)]) == 2
    assert one_line_error(capsys.readouterr().err) == said
    assert last_error_line(streamrl("recipe", "run", str(recipe)), 2) == said


BROKEN_COMPONENTS = '''
from pydantic import BaseModel

from streamrl.api import Component, Reward, hookimpl


class Empty(BaseModel):
    pass


class BadTask:
    def __init__(self, config):
        raise RuntimeError("the task's data folder is missing")


class BadScheduler:
    def __init__(self, config):
        raise ValueError("the scheduler's option is wrong")


class Exits(Reward):
    def __init__(self, config):
        pass

    def score(self, prompt, response):
        raise SystemExit(3)


@hookimpl
def register_tasks():
    return [Component("task", "badtask", Empty, BadTask)]


@hookimpl
def register_schedulers():
    return [Component("scheduler", "badsched", Empty, BadScheduler)]


@hookimpl
def register_rewards():
    return [Component("reward", "exits", Empty, Exits)]
'''


@pytest.mark.slow
@pytest.mark.parametrize("case", ["task", "scheduler", "reward"])
def test_a_component_raising_in_its_constructor_or_a_reward_calling_sys_exit_is_one_line(case, tiny_recipe,
                                                                                          shared_cluster):
    if case == "task":
        recipe = with_plugin(tiny_recipe, "broken", BROKEN_COMPONENTS, replace=('name = "addition"', 'name = "badtask"'))
    elif case == "scheduler":
        recipe = with_plugin(tiny_recipe, "broken", BROKEN_COMPONENTS, extra='\n[scheduler]\nname = "badsched"\n')
    else:
        recipe = with_plugin(tiny_recipe, "broken", BROKEN_COMPONENTS, replace=('name = "exact_match"', 'name = "exits"'))
    proc = streamrl("recipe", "run", str(recipe), "--plain", "--no-report", *sets(*shared_cluster.sets))
    if case == "reward":  # a failed score like any other: every sample of the step, so the run stops
        last = last_error_line(proc, 1)
        assert last.startswith("streamrl: error: step 1: the reward failed for all 16 samples (the first: "
                               "RuntimeError: the reward raised SystemExit(3)"), last
        return
    last = last_error_line(proc, 2)
    expected = {"task": "task 'badtask' could not be built, from plugin local:broken.py: RuntimeError: the task's "
                        "data folder is missing",
                "scheduler": "scheduler 'badsched' could not be built, from plugin local:broken.py: ValueError: the "
                             "scheduler's option is wrong"}[case]
    assert last == f"streamrl: error: {expected}", last


LOSSY_TRANSFER = '''
from streamrl.api import Component, hookimpl
from streamrl.transfer.dask import DaskTransfer, DaskTransferConfig


class Lossy(DaskTransfer):
    """A transfer with a bug: it drops the last column of every 2-d weight."""

    def send(self, weights, version):
        return super().send({n: (t[:, :-1] if t.dim() == 2 else t) for n, t in weights.items()}, version)


@hookimpl
def register_transfers():
    return [Component("transfer", "lossy", DaskTransferConfig, Lossy)]
'''


@pytest.mark.slow
def test_weights_that_do_not_fit_the_engine_name_the_parameter_both_shapes_and_the_transfer(tiny_recipe, tiny_model,
                                                                                             shared_cluster):
    recipe = with_plugin(tiny_recipe, "lossy", LOSSY_TRANSFER, extra='\n[transfer]\nname = "lossy"\n')
    last = last_error_line(streamrl("recipe", "run", str(recipe), "--plain", "--no-report", *sets(*shared_cluster.sets)), 1)
    found = re.search(r"weights for version 1: parameter '([\w.]+)' is \((\d+), (\d+)\) in the engine but "
                      r"\((\d+), (\d+)\) was received", last)
    assert found, last
    name, rows, cols, got_rows, got_cols = found.groups()
    from safetensors import safe_open

    with safe_open(str(tiny_model / "model.safetensors"), "pt") as f:  # the engine's shape is the model's
        assert tuple(f.get_slice(name).get_shape()) == (int(rows), int(cols))
    assert (int(got_rows), int(got_cols)) == (int(rows), int(cols) - 1)
    assert "through transfer 'lossy'" in last, last


@pytest.mark.slow
def test_an_engine_whose_kv_cache_cannot_be_built_stops_the_run_in_one_line(tiny_recipe, shared_cluster):
    # before: transformers' loop died at start, every request was refused and retried, and the
    # run hung until its timeouts, under a traceback and a warning per dropped request
    proc = streamrl("recipe", "run", str(tiny_recipe), "--plain", "--no-report",
                    "--set", "engine.kv_memory_fraction=1e-9", *sets(*shared_cluster.sets), timeout=120)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "will be dropped" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("streamrl: error: engine 'hf' could not be built on worker generate-0: ") and \
        "continuous batching did not start" in last and "kv_memory_fraction" in last, last


def test_a_closing_run_waits_a_bounded_time_for_a_scheduler_that_never_answers_a_cancel(monkeypatch):
    # (the scheduler is stood in for: a client whose cancel never returns, as Dask's does when its
    # scheduler stopped answering -- often why the step timed out and the run is closing)
    from streamrl.errors import RunWarning
    from streamrl.run import controller

    class Unanswered:
        def cancel(self, futures):
            threading.Event().wait(60)

    monkeypatch.setattr(controller, "CANCEL_S", 0.3)
    ctl = controller.Controller.__new__(controller.Controller)
    ctl.client = Unanswered()
    started = time.monotonic()
    with pytest.warns(RunWarning, match="cancelling 2 tasks submitted ahead got no answer from the scheduler"):
        ctl._cancel(["a", "b"])
    assert time.monotonic() - started < 5
