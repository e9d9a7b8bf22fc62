"""Checkpoint and resume, the way a user meets them: the real command, real signals, real
processes. A run stopped with Ctrl-C and resumed ends with exactly the parameters of a run that
was never stopped, and trains every prompt of every step once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ROOT
from tests.test_cli import check_every_sample_trained_once, streamrl

# reproducible sampling + batch order: the same seed gives the same samples and the same update
SAME = ["engine.reproducible=true", "run.mode=batch", "run.steps=12", "run.checkpoint_every=0",
        "trainer.lr=1e-2"]


def sets(*values):
    return [a for v in values for a in ("--set", v)]


def only_run(out: Path) -> Path:
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    return run


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_ctrl_c_checkpoints_and_resume_ends_where_an_uninterrupted_run_ends(tiny_recipe, tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    proc = streamrl("recipe", "run", str(tiny_recipe), *sets(*SAME, f"run.out_dir={straight}"))
    assert proc.returncode == 0, proc.stderr[-3000:]

    # Ctrl-C goes to the whole process group, the cluster's worker processes included
    run = subprocess.Popen([sys.executable, "-m", "streamrl", "recipe", "run", str(tiny_recipe),
                            *sets(*SAME, f"run.out_dir={stopped}")], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 240
    while not list(stopped.glob("*/metrics.jsonl")) or len(records(only_run(stopped))) < 2:
        assert run.poll() is None and time.time() < deadline, run.communicate()[1][-3000:]
        time.sleep(0.1)
    children = psutil.Process(run.pid).children(recursive=True)
    assert children  # the embedded cluster's processes
    os.killpg(run.pid, signal.SIGINT)
    t0 = time.time()
    _, err = run.communicate(timeout=60)
    assert time.time() - t0 < 10, "a stop must take seconds"
    assert run.returncode == 130, err[-3000:]
    folder = only_run(stopped)
    assert "Resume with: streamrl recipe resume" in err, err[-2000:]
    state = json.loads((folder / "status.json").read_text())
    assert state["state"] == "interrupted" and 2 <= state["step"] < 12
    assert not [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]  # no orphans

    proc = streamrl("recipe", "resume", str(folder))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from step-{state['step']:06d}" in proc.stderr
    assert json.loads((folder / "status.json").read_text())["state"] == "completed"
    recs = records(folder)
    assert [r["step"] for r in recs] == list(range(12)) and [r["policy_version"] for r in recs] == list(range(1, 13))
    check_every_sample_trained_once(recs)
    a = load_file(only_run(straight) / "policy" / "model.safetensors")
    b = load_file(folder / "policy" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    # and the runs were the same all along: same rewards every step
    assert [r["reward_mean"] for r in recs] == [r["reward_mean"] for r in records(only_run(straight))]


def test_resume_of_a_folder_that_is_not_a_run_is_one_line(tmp_path):
    proc = streamrl("recipe", "resume", str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"streamrl: error: {tmp_path}: not a run folder "
                                                "(expected status.json and recipe.toml in it)"]


def test_resume_refuses_a_run_that_is_still_going(tmp_path):
    (tmp_path / "recipe.toml").write_text("")
    (tmp_path / "checkpoints" / "step-000002").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-000002" / "controller.json").write_text("{}")
    (tmp_path / "status.json").write_text(json.dumps({"state": "running", "pid": os.getpid(), "recipe_file": "x"}))
    proc = streamrl("recipe", "resume", str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"streamrl: error: {tmp_path}: the run is still going (pid {os.getpid()}); "
                                   "stop it first (Ctrl-C)")
