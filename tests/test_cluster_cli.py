"""A cluster started by hand with Dask's own command line, as README and docs/deploy.md tell
users: ``dask scheduler`` and one ``dask worker`` per pool (``--name``, ``--nthreads``,
``--resources``), real processes on loopback, and the recipe run against it with ``--set
cluster.address=...`` by the real ``streamrl`` command.

The run trains every sample once and leaves the cluster running, with nothing of the run left
on it, so a second run works too; a worker killed mid-run (its nanny restarts it) does not stop
the run, and a second run while one is going is refused in one line; a pool no worker offers,
and a worker without a plugin package the recipe uses (installed only where ``streamrl`` runs),
are one line each. One scheduler and three workers for the whole module.
"""

from __future__ import annotations

import json
import os
import re

import pytest
from distributed import Client

from streamrl.cluster import lifecycle
from streamrl.errors import UserError
from streamrl.recipe.recipe import load_recipe
from tests.helpers import (check_every_sample_trained_once, hand_started_cluster, kill_all, kill_worker, one_line_error,
                           read_records, start_run, start_scheduler, streamrl, wait_for_steps)

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def hand_cluster(tmp_path_factory):
    """``dask scheduler`` and one ``dask worker`` per pool, exactly as docs/deploy.md says
    (a worker's ``worker:<name>`` resource is streamrl's to add, so it is left out here). Its own,
    not the session's shared one: a test here kills one of its workers."""
    with hand_started_cluster(tmp_path_factory.mktemp("hand-cluster")) as hc:
        yield hc


def worker_pids(address: str) -> dict[str, int]:
    with Client(address, timeout=10) as client:
        pids = client.run(os.getpid)
        return {w["name"]: pids[a] for a, w in lifecycle.workers(client).items()}


def watcher_rates(address: str) -> set[tuple[float, float]]:
    """(tick, system monitor) periods in ms of the cluster's scheduler and workers."""
    def rates(dask_worker=None, dask_scheduler=None):
        server = dask_worker or dask_scheduler
        return server.periodic_callbacks["tick"].callback_time, server.periodic_callbacks["monitor"].callback_time

    with Client(address, timeout=10) as client:
        return {*client.run(rates).values(), client.run_on_scheduler(rates)}


def left_on(address: str) -> dict:
    """What of streamrl runs a cluster holds now: plugins and variables named ``streamrl-*``,
    tasks someone still wants, the workers' ``streamrl-*`` plugins (engines, trainers), and
    whether the scheduler's Active Memory Manager runs (a run stops it and starts it again)."""
    def state(dask_scheduler):
        variables = dask_scheduler.extensions["variables"].variables
        return {"plugins": [n for n in [*dask_scheduler.worker_plugins, *dask_scheduler.plugins]
                            if n.startswith("streamrl-")],
                "variables": [n for n in variables if n.startswith("streamrl-")],
                "wanted": [str(k) for k, ts in dask_scheduler.tasks.items() if ts.who_wants],
                "amm": dask_scheduler.extensions["amm"].running}

    with Client(address, timeout=10) as client:
        out = client.run_on_scheduler(state)
        on_workers = client.run(lambda dask_worker: [n for n in dask_worker.plugins if n.startswith("streamrl-")])
        out["worker_plugins"] = sorted({n for names in on_workers.values() for n in names})
    return out


def test_a_recipe_runs_on_a_hand_started_cluster_which_stays_up_with_nothing_of_the_run_left(
        hand_cluster, tiny_recipe, tmp_path):
    before = worker_pids(hand_cluster.address)
    # Dask's watchers at the rates docs/deploy.md gives for one's own cluster (DASK_* variables)
    assert watcher_rates(hand_cluster.address) == {(1000, 2000)}
    proc = streamrl("recipe", "run", str(tiny_recipe), "--plain", "--set", f"cluster.address={hand_cluster.address}",
                    "--set", "run.steps=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "pools: generate=1, train=1, reward=1" in proc.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    recs = read_records(run_dir)
    assert [r["step"] for r in recs] == [0, 1, 2]
    check_every_sample_trained_once(recs)
    assert {x["worker"] for r in recs for x in r["sample_log"]} == {"generate-0"}
    assert json.loads((run_dir / "status.json").read_text())["state"] == "completed"

    # the same worker processes, still up: streamrl did not shut down a cluster it did not start
    assert worker_pids(hand_cluster.address) == before
    # and nothing of the run is left there: no engine or trainer in the workers' memory, no
    # published weights on the scheduler (their keys come again in the next run, and Dask
    # would answer them with this run's results)
    assert left_on(hand_cluster.address) == {"plugins": [], "variables": [], "wanted": [], "worker_plugins": [],
                                          "amm": True}

    proc = streamrl("recipe", "run", str(tiny_recipe), "--plain", "--set", f"cluster.address={hand_cluster.address}",
                    "--set", "run.steps=2", "--set", f"run.out_dir={tmp_path / 'second'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "second").iterdir()
    recs = read_records(run_dir)
    assert [r["step"] for r in recs] == [0, 1]
    check_every_sample_trained_once(recs)
    assert worker_pids(hand_cluster.address) == before


def test_a_killed_worker_comes_back_and_the_run_completes_while_a_second_run_is_refused(
        hand_cluster, tiny_recipe, tmp_path):
    before = worker_pids(hand_cluster.address)
    steps = 30
    proc = start_run(tiny_recipe, tmp_path, f"cluster.address={hand_cluster.address}", steps=steps)
    try:
        run_dir = wait_for_steps(proc, tmp_path, 2)
        # a second run on the cluster while this one is going would replace its engines and
        # share its task keys: refused, in one line (here in-process, for timing: steps are short)
        second = load_recipe(tiny_recipe, [f"cluster.address={hand_cluster.address}"]).recipe
        refused = "(it was not refused)"
        try:
            lifecycle.stop(*lifecycle.start(second))  # (only if it was not refused: then the test fails)
        except UserError as exc:
            refused = str(exc)
        assert proc.poll() is None, "the run ended before the second one started: make it longer"
        assert re.fullmatch(r"cluster.address: streamrl run 'tiny' \(started [-0-9: ]+\) is still using the cluster "
                            r"at tcp://127\.0\.0\.1:\d+; one run at a time per cluster", refused), refused
        # the only generate worker, started without a worker:<name> resource: its nanny
        # restarts it, streamrl's pin comes back with it, and the weight loads pinned to it run
        kill_worker(run_dir, "generate-0")
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    recs = read_records(run_dir)
    assert [r["step"] for r in recs] == list(range(steps))
    check_every_sample_trained_once(recs)
    assert all(x["version"] == r["step"] for r in recs for x in r["sample_log"])  # stream: on-policy
    after = worker_pids(hand_cluster.address)
    assert after.keys() == before.keys() and after["generate-0"] != before["generate-0"]  # a new process
    assert after["train-0"] == before["train-0"] and after["reward-0"] == before["reward-0"]


def test_a_pool_no_worker_offers_is_one_line(tiny_recipe, tmp_path):
    procs = {}
    try:
        procs["scheduler"], address = start_scheduler(tmp_path)
        proc = streamrl("recipe", "run", str(tiny_recipe), "--set", f"cluster.address={address}")
    finally:
        kill_all(procs)
    assert proc.returncode == 2
    assert one_line_error(proc.stderr) == (
        f"streamrl: error: pools.generate: no worker of cluster {address} offers resource 'generate' (this pool "
        f"runs generate tasks); start one with: dask worker {address} --name generate-0 --nthreads 4 "
        '--resources "generate=4"')


CLIENT_ONLY_PLUGIN = '''
"""A reward plugin installed only where streamrl runs (on PYTHONPATH there, with its
distribution metadata), not on the workers."""
from pydantic import BaseModel
from streamrl.api import Component, Reward, hookimpl


class Config(BaseModel):
    pass


class Match(Reward):
    def __init__(self, config):
        self.config = config

    def score(self, prompt, response):
        return float(response.strip() == str(prompt.answer))


@hookimpl
def register_rewards():
    return [Component("reward", "clientonly_match", Config, Match)]
'''


def test_a_worker_without_a_plugin_package_the_recipe_uses_is_one_line(hand_cluster, tiny_recipe, tmp_path):
    # an installed plugin, for real: a package and its dist-info (entry point group "streamrl")
    site = tmp_path / "site"
    (site / "streamrl_clientonly").mkdir(parents=True)
    (site / "streamrl_clientonly" / "__init__.py").write_text(CLIENT_ONLY_PLUGIN)
    dist = site / "streamrl_clientonly-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: streamrl-clientonly\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[streamrl]\nclientonly = streamrl_clientonly\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    sets = ["--set", f"cluster.address={hand_cluster.address}", "--set", "reward.name=clientonly_match"]

    # where streamrl runs, the recipe is valid: the component is there
    proc = streamrl("recipe", "validate", str(tiny_recipe), *sets, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = streamrl("recipe", "run", str(tiny_recipe), *sets, env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert one_line_error(proc.stderr) == (
        "streamrl: error: pools.reward: worker reward-0 cannot import 'streamrl_clientonly', which reward "
        "'clientonly_match' needs (plugin clientonly, from streamrl-clientonly 0.1); install it in that worker's "
        "Python environment")
    # found before anything of the run reached the cluster, and the cluster is free again
    assert left_on(hand_cluster.address) == {"plugins": [], "variables": [], "wanted": [], "worker_plugins": [],
                                          "amm": True}
