"""Checkpoint and resume, the way a user meets them: the real command, real signals, real
processes. A run stopped with Ctrl-C and resumed ends with exactly the parameters of a run that
was never stopped, and trains every prompt of every step once."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from streamrl.errors import UserError
from tests.helpers import (check_every_sample_trained_once, only_run, read_records, sets, start_run,
                           streamrl, wait_for_steps, write_tiny_recipe)

# reproducible sampling + batch order: the same seed gives the same samples and the same update
SAME = ["engine.reproducible=true", "run.mode=batch", "run.steps=12", "run.checkpoint_every=0",
        "trainer.lr=1e-2"]


def start_and_wait(recipe: Path, settings: list[str], out: Path, steps_done: int):
    """``streamrl recipe run`` in its own process group, returned once ``steps_done`` records exist."""
    run = start_run(recipe, out, *settings, steps=None)
    wait_for_steps(run, out, steps_done)
    return run


@pytest.fixture(scope="module")
def straight(tiny_model, tmp_path_factory) -> tuple[Path, Path]:
    """The recipe, and the folder of its uninterrupted run (the oracle)."""
    folder = tmp_path_factory.mktemp("resume")
    recipe = write_tiny_recipe(folder, tiny_model)
    proc = streamrl("recipe", "run", str(recipe), *sets(*SAME, f"run.out_dir={folder / 'straight'}"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return recipe, only_run(folder / "straight")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl-c", pytest.param("kill-9", marks=pytest.mark.smoke)])
def test_a_stopped_or_killed_run_resumes_to_where_an_uninterrupted_run_ends(straight, tmp_path, how):
    recipe, oracle = straight
    stopped = tmp_path / "stopped"
    # Ctrl-C goes to the whole process group, the cluster's worker processes included;
    # kill -9 hits only the controller's process (the workers must not outlive it)
    t0 = time.perf_counter()
    run = start_and_wait(recipe, [*SAME, "run.checkpoint_every=2"], stopped, steps_done=3)
    starting = time.perf_counter() - t0  # the cluster's start, the model loads and 3 steps
    children = psutil.Process(run.pid).children(recursive=True)
    assert children  # the embedded cluster's processes
    if how == "ctrl-c":
        os.killpg(run.pid, signal.SIGINT)
    else:
        os.kill(run.pid, signal.SIGKILL)
    t0 = time.perf_counter()
    _, err = run.communicate(timeout=120)  # a hang guard only
    stopping = time.perf_counter() - t0
    # a stop takes seconds: well under what this run took to start and take 3 steps here (its
    # workers forked warm, so a shorter start than spawned ones had, when the bound was half; a
    # floor of 20 s, as the other xdist worker's load can fall on the stop alone)
    assert stopping < max(0.75 * starting, 20.0), ("a stop must take seconds", stopping, starting)
    folder = only_run(stopped)
    state = json.loads((folder / "status.json").read_text())
    if how == "ctrl-c":
        assert run.returncode == 130, err[-3000:]
        assert "Resume with: streamrl recipe resume" in err, err[-2000:]
        assert state["state"] == "interrupted" and 3 <= state["step"] < 12
        resumed_at = state["step"]
    else:  # no chance to clean up: status still says running, the newest checkpoint is what counts
        assert state["state"] == "running"
        resumed_at = json.loads(sorted((folder / "checkpoints").glob("step-*"))[-1].joinpath(
            "controller.json").read_text())["next_step"]
        assert resumed_at >= 2
    # no orphans: the workers go too (the deadline is a generous guard, not a figure asserted)
    deadline = time.time() + 60
    while [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]:
        assert time.time() < deadline, "worker processes outlived the run"
        time.sleep(0.2)

    proc = streamrl("recipe", "resume", str(folder))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from step-{resumed_at:06d}" in proc.stderr, (state, err[-2000:], proc.stderr[-2000:])
    assert "resumed with other settings" not in proc.stderr
    assert json.loads((folder / "status.json").read_text())["state"] == "completed"
    recs = read_records(folder)
    assert [r["step"] for r in recs] == list(range(12)) and [r["policy_version"] for r in recs] == list(range(1, 13))
    check_every_sample_trained_once(recs)
    a = load_file(oracle / "policy" / "model.safetensors")
    b = load_file(folder / "policy" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    # and the runs were the same all along: same rewards every step
    assert [r["reward_mean"] for r in recs] == [r["reward_mean"] for r in read_records(oracle)]


@pytest.mark.slow
def test_a_resume_that_changes_which_prompts_a_step_gets_says_so(straight, tmp_path):
    # a step's prompts are drawn from the task's stream by step, prompts per step and seed: a
    # resume with others trains some prompts again and skips others, without a word before
    _, oracle = straight
    folder = tmp_path / oracle.name
    shutil.copytree(oracle, folder)
    proc = streamrl("recipe", "resume", str(folder), *sets("run.steps=13", "trainer.prompts_per_step=2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "resumed with other settings" in line]
    assert said and "(trainer.prompts_per_step: 4 -> 2): the prompts of step 13 on are not those" in said[0], said


@pytest.mark.slow
def test_a_run_whose_policy_save_was_cut_short_is_resumed_to_write_it(straight, tmp_path):
    # every step ran and the last checkpoint was written, then the save of the policy was cut
    # short (a killed train worker, a second Ctrl-C): the resume its line names was refused
    # ("the run already has 12 steps") and the half-written policy stayed where it is read
    _, oracle = straight
    folder = tmp_path / oracle.name
    shutil.copytree(oracle, folder)
    shutil.rmtree(folder / "policy")
    (folder / "policy").mkdir()
    (folder / "policy" / "config.json").write_text("{")  # (half of what a save writes)
    status = json.loads((folder / "status.json").read_text())
    (folder / "status.json").write_text(json.dumps({**status, "state": "failed"}))
    proc = streamrl("recipe", "resume", str(folder))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((folder / "status.json").read_text())["state"] == "completed"
    a = load_file(oracle / "policy" / "model.safetensors")
    b = load_file(folder / "policy" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert json.loads((folder / "policy" / "config.json").read_text())["model_type"]
    assert [r["step"] for r in read_records(folder)] == list(range(12))
    assert not list(folder.glob(".tmp-*"))
    # a completed run is still refused
    again = streamrl("recipe", "resume", str(folder))
    assert again.returncode == 2 and "run.steps: the run already has 12 steps" in again.stderr


def test_resume_of_a_folder_that_is_not_a_run_is_one_line(tmp_path):
    proc = streamrl("recipe", "resume", str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"streamrl: error: {tmp_path}: not a run folder "
                                                "(expected status.json and recipe.toml in it)"]


def a_checkpoint(run: Path) -> None:
    """A step-2 checkpoint in ``run`` as a sim trainer's run writes it (what a resume reads)."""
    (run / "checkpoints" / "step-000002" / "trainer").mkdir(parents=True)
    (run / "checkpoints" / "step-000002" / "trainer" / "sim_trainer.json").write_text('{"version": 2}')
    (run / "checkpoints" / "step-000002" / "controller.json").write_text(
        json.dumps({"next_step": 2, "policy_version": 2, "records": 2}))


def test_resume_refuses_a_run_that_is_still_going(tmp_path):
    (tmp_path / "recipe.toml").write_text("")
    a_checkpoint(tmp_path)
    (tmp_path / "status.json").write_text(json.dumps({"state": "running", "pid": os.getpid(), "recipe_file": "x"}))
    proc = streamrl("recipe", "resume", str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"streamrl: error: {tmp_path}: the run is still going (pid {os.getpid()}); "
                                   "stop it first (Ctrl-C)")


def test_a_pid_written_on_another_host_does_not_say_the_run_is_going_here(tmp_path, tiny_model):
    # killed with -9 on one node, resumed on another: a process there with the same pid made the
    # resume refuse for ever ("still going")
    import socket

    from streamrl.errors import UserError
    from streamrl.run.run_folder import RunFolder

    write_tiny_recipe(tmp_path, tiny_model, name="recipe.toml")
    a_checkpoint(tmp_path)
    for host, going in (("another-node", False), (socket.gethostname(), True)):
        (tmp_path / "status.json").write_text(json.dumps({"state": "running", "pid": os.getpid(), "host": host,
                                                          "recipe_file": str(tmp_path / "recipe.toml")}))
        if going:
            with pytest.raises(UserError, match="the run is still going"):
                RunFolder.for_resume(tmp_path)
        else:
            _, folder = RunFolder.for_resume(tmp_path)
            assert folder.path == tmp_path


def test_a_second_command_on_a_run_folder_in_use_is_one_line(tmp_path, tiny_model):
    # a resume started while another (or the run itself, on another machine sharing the folder)
    # still went on: each set the other's checkpoints aside and rotated them away
    import fcntl

    write_tiny_recipe(tmp_path, tiny_model, name="recipe.toml")
    a_checkpoint(tmp_path)
    (tmp_path / "status.json").write_text(json.dumps({"state": "running", "pid": 4_000_000, "host": "elsewhere",
                                                      "recipe_file": str(tmp_path / "recipe.toml")}))
    with open(tmp_path / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (the other command's hold)
        proc = streamrl("recipe", "resume", str(tmp_path), "--set", "run.steps=4")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"streamrl: error: {tmp_path}: another streamrl command is running this run (pid 4000000 on elsewhere); "
        "one at a time -- wait for it, or stop it (Ctrl-C)"], proc.stderr[-2000:]
    assert json.loads((tmp_path / "status.json").read_text())["state"] == "running"  # (nothing written)


@pytest.mark.parametrize("status", ["", "[]", "{}", '{"state": "running", "pid": "abc"}',
                                    '{"state": "running", "pid": 100000000000000000000}', "[" * 100_000])
def test_a_damaged_run_folder_is_one_line_on_resume(tmp_path, status):
    # a status record emptied, edited or damaged, and a step- folder streamrl did not write
    (tmp_path / "recipe.toml").write_text("")
    for name in ("step-000002", "step-final"):
        (tmp_path / "checkpoints" / name / "trainer").mkdir(parents=True)
        (tmp_path / "checkpoints" / name / "trainer" / "sim_trainer.json").write_text('{"version": 2}')
        (tmp_path / "checkpoints" / name / "controller.json").write_text(
            json.dumps({"next_step": 2, "policy_version": 2, "records": 2}))
    (tmp_path / "status.json").write_text(status)
    proc = streamrl("recipe", "resume", str(tmp_path))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("streamrl: error: "), proc.stderr[-2000:]
    if not status.startswith('{"state"'):
        assert f"{tmp_path / 'status.json'}: " in lines[0]
    from streamrl.checkpoints import folders

    with pytest.raises(UserError) as refused:  # (what `recipe resume --from 3` says, before any cluster)
        folders.named(tmp_path, "3")
    assert str(refused.value) == f"--from 3: no such checkpoint in {tmp_path / 'checkpoints'} (there are: step-000002)"


@pytest.mark.slow
def test_ctrl_c_on_an_async_run_whose_next_step_is_already_training_checkpoints_the_right_version(straight, tmp_path,
                                                                                                  shared_cluster):
    # async mode hands the next step to the trainer before a step's record is written; a stop
    # then ends after that next step, and every checkpoint holds exactly the version it names
    recipe, _ = straight
    stopped = tmp_path / "stopped"
    args = ["run.mode=async", "run.max_staleness=1", "run.steps=12", "run.checkpoint_every=3"]
    run = start_and_wait(recipe, args, stopped, steps_done=4)
    os.killpg(run.pid, signal.SIGINT)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 130, err[-3000:]
    folder = only_run(stopped)
    state = json.loads((folder / "status.json").read_text())
    assert state["state"] == "interrupted" and 4 <= state["step"] < 12
    checkpoints = sorted((folder / "checkpoints").glob("step-*"))
    assert checkpoints and checkpoints[-1].name == f"step-{state['step']:06d}"
    for ckpt in checkpoints:
        meta = json.loads((ckpt / "controller.json").read_text())
        trainer = torch.load(ckpt / "trainer" / "trainer.pt", weights_only=False)
        assert trainer["version"] == meta["policy_version"] == meta["next_step"] == int(ckpt.name[5:]), ckpt

    proc = streamrl("recipe", "resume", str(folder), *sets(*shared_cluster.sets))
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = read_records(folder)
    assert [r["step"] for r in recs] == list(range(12)) and [r["policy_version"] for r in recs] == list(range(1, 13))
    check_every_sample_trained_once(recs)


def resumed_copy(run: Path, into: Path, checkpoint: str, *settings: str) -> tuple[Path, subprocess.CompletedProcess]:
    """A copy of the finished ``run`` without its policy, resumed from its ``checkpoint`` (``--from``):
    the copy then holds the run as it was at that checkpoint, gone on to the end again. It is what
    a run that stopped at that checkpoint and was resumed holds (the steps after it are set aside,
    their records dropped), without a second run to reach it."""
    copy = into / run.name
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "policy")  # (the resumed run must write it)
    return copy, streamrl("recipe", "resume", str(copy), "--from", checkpoint, *settings)


@pytest.mark.slow
def test_a_sharded_train_pool_writes_its_shards_and_resumes_to_where_a_straight_run_ends(straight, tmp_path):
    # fsdp over 2 train workers, with a critic and a reference model sharded too: a run of 6
    # steps resumed from its step-3 checkpoint ends exactly where it ended
    recipe, _ = straight
    fsdp = [*SAME, "run.checkpoint_every=3", "pools.train.workers=2", "trainer.strategy=fsdp",
            "algorithm.name=ppo", "algorithm.kl_coef=0.01"]
    whole = streamrl("recipe", "run", str(recipe), *sets(*fsdp, "run.steps=6", f"run.out_dir={tmp_path / 'whole'}"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    straight_run = only_run(tmp_path / "whole")
    # each rank wrote its own shards
    assert len(list((straight_run / "checkpoints" / "step-000003" / "trainer" / "dcp").glob("*.distcp"))) == 2
    (tmp_path / "resumed").mkdir()
    folder, proc = resumed_copy(straight_run, tmp_path / "resumed", "step-000003")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from step-000003" in proc.stderr
    assert [r["step"] for r in read_records(folder)] == list(range(6))
    assert [r["reward_mean"] for r in read_records(folder)] == [r["reward_mean"] for r in read_records(straight_run)]
    for part_file in ("model.safetensors", "critic/model.safetensors"):
        a = load_file(straight_run / "policy" / part_file)
        b = load_file(folder / "policy" / part_file)
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), part_file
    # the policy written from the shards is a whole model (from_pretrained refuses wrong shapes)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder / "policy")
    saved = load_file(folder / "policy" / "model.safetensors")
    assert all(torch.equal(model.state_dict()[n], t) for n, t in saved.items())


@pytest.mark.slow
def test_a_lora_run_resumes_exactly_from_a_checkpoint_that_holds_only_its_adapter(tmp_path, tiny_model, shared_cluster):
    # a LoRA learner (publishing its adapter alone to the engines) run 6 steps and resumed from
    # its step-3 checkpoint ends exactly where it ended: the adapter, its AdamW state and the
    # samples (a reward with variance: the exact-match reward gives an untrained model no
    # gradient, and a zero update would resume "exactly" whatever the checkpoint held)
    from tests.helpers import parity_recipe

    parity_recipe(tmp_path, tiny_model)
    recipe = tmp_path / "tiny.toml"
    lora = [*SAME, "run.checkpoint_every=3", "trainer.lr=5e-2", "trainer.lora={rank=4, alpha=8}", *shared_cluster.sets]
    whole = streamrl("recipe", "run", str(recipe), *sets(*lora, "run.steps=6", f"run.out_dir={tmp_path / 'whole'}"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    straight_run = only_run(tmp_path / "whole")
    dcp = straight_run / "checkpoints" / "step-000003" / "trainer" / "dcp"
    held = sum(f.stat().st_size for f in dcp.iterdir())
    # the adapter and its AdamW state, not the base (a full checkpoint holds the weights and twice them in AdamW)
    assert held < 0.5 * (Path(tiny_model) / "model.safetensors").stat().st_size
    (tmp_path / "resumed").mkdir()
    folder, proc = resumed_copy(straight_run, tmp_path / "resumed", "step-000003", *sets(*shared_cluster.sets))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from step-000003" in proc.stderr
    assert [r["step"] for r in read_records(folder)] == list(range(6))
    assert [r["reward_mean"] for r in read_records(folder)] == [r["reward_mean"] for r in read_records(straight_run)]
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        a, b = load_file(straight_run / "policy" / name), load_file(folder / "policy" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), name
    base = load_file(Path(tiny_model) / "model.safetensors")
    merged = load_file(folder / "policy" / "model.safetensors")
    assert any(not torch.equal(merged[n], base[n].to(merged[n].dtype)) for n in base if n in merged)  # it learned


@pytest.mark.slow
def test_a_resumed_run_keeps_what_its_length_ranker_learned(straight, tmp_path, shared_cluster):
    # the learned ranker (and the lengths the skew scheduler has seen) are in every checkpoint:
    # after a resume the ranker is the one the uninterrupted run has, weights and all
    recipe, _ = straight
    ranked = [*SAME, "run.steps=8", "run.checkpoint_every=2", "run.keep_checkpoints=4", 'ranker.name="learned"',
              'scheduler.name="skew"']
    proc = streamrl("recipe", "run", str(recipe), *sets(*ranked, f"run.out_dir={tmp_path / 'straight'}",
                                                        *shared_cluster.sets))
    assert proc.returncode == 0, proc.stderr[-3000:]
    oracle = only_run(tmp_path / "straight")
    assert "ranker.pt" in {p.name for p in (oracle / "checkpoints" / "step-000004").iterdir()}
    (tmp_path / "resumed").mkdir()
    folder, proc = resumed_copy(oracle, tmp_path / "resumed", "step-000004", *sets(*shared_cluster.sets))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from step-000004" in proc.stderr
    a, b = (torch.load(r / "checkpoints" / "step-000008" / "ranker.pt", weights_only=True) for r in (oracle, folder))
    for part in ("embed", "head"):
        assert all(torch.equal(a[part][k], b[part][k]) for k in a[part]), part
    assert a["data"] == b["data"] and a["mean"] == b["mean"]
    seen = [json.loads((r / "checkpoints" / "step-000008" / "dispatch.json").read_text()) for r in (oracle, folder)]
    assert seen[0] == seen[1] and len(seen[0]["observed_lengths"]) == 8 * 16
    assert [r["step"] for r in read_records(folder)] == list(range(8))
    assert [r["ranker_recall"] for r in read_records(folder)] == [r["ranker_recall"] for r in read_records(oracle)]


BROKEN_RANKER = """
from pydantic import BaseModel
import streamrl
from streamrl.api import Ranker
from streamrl.plugins.registry import Component

class StubbornConfig(BaseModel):
    pass

class Stubborn(Ranker):
    def __init__(self, config):
        pass
    def predict(self, prompts):
        return [float(len(p.text)) for p in prompts]
    def state_dict(self):
        raise RuntimeError("nothing to give")

@streamrl.hookimpl
def register_rankers():
    return [Component("ranker", "stubborn", StubbornConfig, Stubborn)]
"""


@pytest.mark.slow
def test_a_ranker_whose_state_cannot_be_saved_is_warned_about_and_the_checkpoint_still_written(tiny_model, tmp_path,
                                                                                               shared_cluster):
    (tmp_path / "stubborn.py").write_text(BROKEN_RANKER)
    recipe = write_tiny_recipe(tmp_path, tiny_model,
                               more='\n[ranker]\nname = "stubborn"\n\n[plugins]\nmodules = ["./stubborn.py"]\n')
    proc = streamrl("recipe", "run", str(recipe), *sets("run.steps=4", "run.checkpoint_every=2", *shared_cluster.sets))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ranker: its state could not be saved (RuntimeError: nothing to give)" in proc.stderr
    assert "Traceback" not in proc.stderr
    run = only_run(tmp_path / "runs")
    last = sorted((run / "checkpoints").glob("step-*"))[-1]
    assert last.name == "step-000004" and (last / "controller.json").exists() and (last / "dispatch.json").exists()
    assert not (last / "ranker.pt").exists()


WAYWARD_RANKER = """
from pydantic import BaseModel
import streamrl
from streamrl.api import Ranker
from streamrl.plugins.registry import Component

class WaywardConfig(BaseModel):
    pass

class Wayward(Ranker):
    def __init__(self, config):
        self.calls = 0
    def predict(self, prompts):
        self.calls += 1
        if self.calls == 2:
            raise ZeroDivisionError("no scores today")
        if self.calls == 3:
            return [1.0]  # one score for a step's prompts
        return [float(len(p.text)) for p in prompts]
    def observe(self, prompts, lengths):
        raise KeyError("lesson refused")

@streamrl.hookimpl
def register_rankers():
    return [Component("ranker", "wayward", WaywardConfig, Wayward)]
"""


@pytest.mark.slow
def test_a_ranker_that_raises_or_gives_the_wrong_scores_is_said_once_and_the_run_and_its_save_go_on(
        tiny_model, tmp_path, shared_cluster):
    # a ranker's failed lesson failed the next step's ranking with a worker's traceback, and on
    # the last step kept the trained policy from being saved; a short list of scores was an IndexError
    (tmp_path / "wayward.py").write_text(WAYWARD_RANKER)
    recipe = write_tiny_recipe(tmp_path, tiny_model, more='\n[ranker]\nname = "wayward"\n\n[scheduler]\nname = "skew"\n'
                                                          '\n[plugins]\nmodules = ["./wayward.py"]\n')
    proc = streamrl("recipe", "run", str(recipe), *sets("run.steps=5", *shared_cluster.sets))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for said in ("ranker: predict() raised ZeroDivisionError: no scores today; the run goes on",
                 "ranker: predict() gave 1 scores for 4 prompts; the run goes on",
                 "ranker: observe() raised KeyError: 'lesson refused'; the run goes on"):
        assert proc.stderr.count(said) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    run = only_run(tmp_path / "runs")
    assert (run / "policy" / "config.json").exists() and len(read_records(run)) == 5


def test_two_runs_of_one_name_started_in_the_same_second_get_a_folder_each(tmp_path, tiny_model, monkeypatch):
    # the folder was looked for, then made: a second run making it in between got "cannot create
    # a run folder ... (File exists)"; each is made now, the next number taken when it is there
    from pathlib import Path

    from streamrl.recipe.recipe import load_recipe
    from streamrl.run.run_folder import RunFolder

    loaded = load_recipe(write_tiny_recipe(tmp_path, tiny_model, name="recipe.toml"),
                         [f"run.out_dir={json.dumps(str(tmp_path / 'runs'))}"])
    monkeypatch.setattr("time.strftime", lambda *_: "20261203-120000")
    monkeypatch.setattr(Path, "exists", lambda self: False)  # (each look sees no folder: the race, every time)
    first, second = RunFolder.create(loaded), RunFolder.create(loaded)
    assert first.path.name == f"{loaded.recipe.run.name}-20261203-120000"
    assert second.path.name == f"{loaded.recipe.run.name}-20261203-120000-2"
    # an out_dir that is a dangling link (scratch space not mounted): one line, not a loop over names
    (tmp_path / "gone").symlink_to(tmp_path / "not-mounted")
    from streamrl.errors import UserError

    dangling = load_recipe(write_tiny_recipe(tmp_path, tiny_model, name="recipe.toml"),
                           [f"run.out_dir={json.dumps(str(tmp_path / 'gone'))}"])
    with pytest.raises(UserError, match="run.out_dir: cannot create a run folder in"):
        RunFolder.create(dangling)
