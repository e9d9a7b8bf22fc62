"""Stop signals while the embedded cluster starts (``run/stopping.py``): the real CLI, real signals."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.helpers import start, worker_processes


@pytest.mark.slow
def test_a_second_ctrl_c_while_the_cluster_starts_stops_at_once(tiny_recipe, tmp_path):
    # the two signals reach the process group while the workers are being started (their
    # signals blocked, streamrl counting them): the second must stop the run before any step,
    # not be merged with the first into one stop request that runs a step and checkpoints it
    proc = start("recipe", "run", str(tiny_recipe), "--plain", "--set", "run.steps=50")
    deadline = time.time() + 60
    while not worker_processes(proc.pid):  # the cluster's first worker is starting
        assert time.time() < deadline and proc.poll() is None, "the run started no worker process"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines()[-1] == "streamrl: interrupted", err[-3000:]
    assert "Traceback" not in err and "step   1/" not in err, err[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    metrics = run_dir / "metrics.jsonl"
    assert not metrics.exists() or metrics.read_text() == ""  # no step ran
    assert json.loads((run_dir / "status.json").read_text())["state"] == "interrupted"


@pytest.mark.slow
def test_a_second_ctrl_c_mid_run_stops_at_once_with_nothing_of_dasks_on_the_terminal(tiny_recipe, tmp_path):
    proc = start("recipe", "run", str(tiny_recipe), "--plain", "--set", "run.steps=200", group=False)
    seen = []
    while not any("step   3/" in line for line in seen):  # (readline: a hang guard is the test's timeout)
        line = proc.stderr.readline()
        assert line, "".join(seen)[-3000:]
        seen.append(line)
    os.kill(proc.pid, signal.SIGINT)
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    err = "".join(seen) + err
    assert proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines()[-1] == "streamrl: interrupted", err[-3000:]
    # the workers' teardown (a nanny killing a worker slow to exit, a restart) is Dask's to log: not here
    assert not [line for line in err.splitlines() if " - distributed." in line or "Traceback" in line], err[-3000:]


def test_status_json_drops_an_earlier_attempts_error_once_the_run_goes_on_and_completes(tmp_path):
    from streamrl.run.run_folder import RunFolder

    folder = RunFolder(tmp_path / "run")
    folder.path.mkdir()
    folder.mark("running", step=3, scheduler="tcp://127.0.0.1:1")
    folder.failed(RuntimeError("the first attempt died"))
    failed = json.loads((folder.path / "status.json").read_text())
    assert failed["state"] == "failed" and "the first attempt died" in failed["error"]
    folder.mark("running", step=3)  # resumed
    folder.mark("completed", step=8, policy="policy")
    done = json.loads((folder.path / "status.json").read_text())
    assert done["state"] == "completed" and "error" not in done and "resume" not in done
    assert done["scheduler"] == "tcp://127.0.0.1:1" and done["policy"] == "policy"  # the rest is kept


def test_a_cluster_that_does_not_close_is_given_up_on_within_the_bound(monkeypatch, caplog):
    # the end of a run must not wait for ever on a scheduler that does not answer its close
    import asyncio

    from distributed import Scheduler, SpecCluster

    from streamrl.cluster import lifecycle

    class Stuck(SpecCluster):
        async def _close(self):  # (a close that never ends: the edge a real hang sits at)
            await asyncio.sleep(3600)

    cluster = Stuck(workers={}, scheduler={"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": ":0"}},
                    name="streamrl-stuck")
    monkeypatch.setattr(lifecycle, "CLOSE_TIMEOUT", 1.0)
    t0 = time.perf_counter()
    try:
        lifecycle.stop(cluster, None)
        assert time.perf_counter() - t0 < 15
        assert "the cluster did not close within 1 s" in caplog.text
    finally:
        asyncio.run_coroutine_threadsafe(SpecCluster._close(cluster), cluster.loop.asyncio_loop).result(60)
