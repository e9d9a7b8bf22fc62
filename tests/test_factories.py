"""``[cluster] factory``: a recipe names a callable that returns a Dask cluster.

Real library objects, no batch system: ``distributed.LocalCluster`` runs a recipe end to end;
``dask_jobqueue.SLURMCluster`` writes one job script per pool worker, each carrying the worker's
name, threads and resources (read back with ``dask worker``'s own argument parser), and -- with
``sbatch`` and ``scancel`` standing in for SLURM by running each job script here -- runs the
recipe on the workers those scripts start and cancels the jobs at the end. A user's own factory
module, a cluster streamrl cannot label, a missing package and bad options are covered too.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from distributed.cli.dask_worker import main as dask_worker_cli

from streamrl.cluster import lifecycle, factories
from streamrl.errors import UserError
from streamrl.recipe.recipe import check_pools, load_recipe
from tests.helpers import (ROOT, check_every_sample_trained_once, one_line_error, only_run, read_records, streamrl,
                           with_learners)

LOOPBACK = 'scheduler_options = { host = "127.0.0.1", dashboard_address = "127.0.0.1:0" }'
SLURM = f"""
[cluster]
factory = "dask_jobqueue.SLURMCluster"
factory_options = {{ cores = 2, memory = "2GB", walltime = "00:10:00", {LOOPBACK} }}
[cluster.pool_options.train]
job_extra_directives = ["--gres=gpu:1"]
"""


def with_cluster_table(recipe: Path, table: str) -> Path:
    """The tiny recipe with its ``[cluster]`` table replaced by ``table``."""
    text = recipe.read_text().replace("[cluster]\ndashboard_port = 0\ndashboard = false\n", table)
    assert text != recipe.read_text()
    recipe.write_text(text)
    return recipe


def worker_line(script: str) -> dict:
    """The ``dask worker`` line of a job script, parsed by ``dask worker``'s own parser (so a
    flag given twice counts as the worker will count it: the last one wins)."""
    (line,) = [ln for ln in script.splitlines() if "distributed.cli.dask_worker" in ln]
    args = shlex.split(line)
    rest = args[args.index("distributed.cli.dask_worker") + 1:]
    return dask_worker_cli.make_context("dask worker", rest).params


@pytest.mark.slow
def test_a_local_cluster_factory_runs_a_recipe_with_the_pools_it_labels(tiny_recipe, tmp_path):
    proc = streamrl("recipe", "run", str(tiny_recipe), "--plain", "--set", "cluster.factory=distributed.LocalCluster",
                    "--set", 'cluster.factory_options={host="127.0.0.1", dashboard_address="127.0.0.1:0"}',
                    "--set", "pools.generate.workers=2", "--set", "run.steps=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "still alive" not in proc.stderr
    # LocalCluster alone would start one worker per core, of no pool: streamrl asked it for
    # none and started the pools' own, named as on the embedded cluster
    assert "pools: generate=2, train=1, reward=1" in proc.stderr
    recs = read_records(only_run(tmp_path / "runs"))
    assert [r["step"] for r in recs] == [0, 1, 2]
    check_every_sample_trained_once(recs)
    assert {x["worker"] for r in recs for x in r["sample_log"]} == {"generate-0", "generate-1"}


def test_slurm_job_scripts_carry_each_pool_workers_name_threads_resources_and_options(tiny_recipe):
    recipe = with_cluster_table(tiny_recipe, SLURM)
    loaded = load_recipe(recipe, ["pools.generate.workers=2", 'pools.reward.env={FOO="a b"}'])
    scripts = factories.preview(loaded.recipe)  # builds the jobs, submits nothing
    assert list(scripts) == ["generate-0", "generate-1", "train-0", "reward-0"]
    for name, script in scripts.items():
        pool = name.rsplit("-", 1)[0]
        threads = {"generate": 4, "train": 1, "reward": 1}[pool]
        params = worker_line(script)
        assert params["name"] == name
        assert params["nthreads"] == threads  # the pool's task slots, not cores / processes
        assert params["resources"] == f"{pool}={threads},worker:{name}=1000000"
        assert params["nanny"] is True  # a killed worker comes back (and its pin with it)
        assert f"#SBATCH -J streamrl-{name}" in script
        assert "#SBATCH --cpus-per-task=2" in script and "#SBATCH --mem=2G" in script  # factory_options
        assert ("#SBATCH --gres=gpu:1" in script) == (pool == "train")  # pool_options.train
        assert "export MALLOC_MMAP_THRESHOLD_=33554432" in script and "export HF_HUB_OFFLINE=1" in script
        assert ("export FOO='a b'" in script) == (pool == "reward")  # the pool's env, quoted for bash


def test_each_side_learner_gets_a_job_of_its_own_with_the_train_pools_settings(tiny_recipe):
    recipe = with_learners(with_cluster_table(tiny_recipe, SLURM))
    scripts = factories.preview(load_recipe(recipe).recipe)
    # the main learner (grpo) trains on the train pool; rloo on its own worker, a job like the rest
    assert list(scripts) == ["generate-0", "train-0", "reward-0", "learner-rloo"]
    params = worker_line(scripts["learner-rloo"])
    assert params["name"] == "learner-rloo" and params["nthreads"] == 1
    assert params["resources"] == "learn=1,worker:learner-rloo=1000000"  # not train: no train pool task lands there
    assert "#SBATCH --gres=gpu:1" in scripts["learner-rloo"]  # cluster.pool_options.train


@pytest.mark.slow
def test_a_local_cluster_factory_runs_side_learners_on_workers_it_labels(tiny_recipe, tmp_path):
    proc = streamrl("recipe", "run", str(with_learners(tiny_recipe)), "--plain",
                    "--set", "cluster.factory=distributed.LocalCluster",
                    "--set", 'cluster.factory_options={host="127.0.0.1", dashboard_address="127.0.0.1:0"}')
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = read_records(only_run(tmp_path / "runs"))
    assert [r["step"] for r in recs] == [0, 1]
    # the side learner trained on the worker the factory's cluster started for it
    rloo = recs[-1]["learners"]["rloo"]
    assert rloo["worker"] == "learner-rloo" and rloo["steps_trained"] >= 1 and not rloo.get("error")


def test_a_colocated_train_job_offers_both_pools(tiny_recipe):
    loaded = load_recipe(with_cluster_table(tiny_recipe, SLURM), ["run.mode=colocated"])
    params = worker_line(factories.preview(loaded.recipe)["train-0"])
    assert params["nthreads"] == 5 and params["resources"] == "train=1,generate=4,worker:train-0=1000000"


@pytest.mark.slow
def test_a_slurm_factory_runs_a_recipe_on_the_workers_its_job_scripts_start(tiny_recipe, tmp_path):
    # sbatch and scancel stand in for SLURM: each job script runs here, in its own process
    # group, and scancel kills that group -- everything else is dask-jobqueue's own. Like
    # sbatch, the shim keeps a copy of the script (dask-jobqueue deletes its file on return)
    shim = tmp_path / "bin"
    shim.mkdir()
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (shim / "sbatch").write_text(textwrap.dedent(f"""\
        #!/bin/bash
        job=$(mktemp {jobs}/job-XXXX)
        cp "$1" "$job.sh"
        setsid bash "$job.sh" > "$job.log" 2>&1 < /dev/null &
        echo $! >> {jobs}/ids
        echo "Submitted batch job $!"
        """))
    (shim / "scancel").write_text('#!/bin/bash\nkill -TERM -- "-$1" 2>/dev/null\nexit 0\n')
    for f in shim.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{shim}{os.pathsep}{os.environ['PATH']}"}
    recipe = with_cluster_table(tiny_recipe, SLURM)
    proc = streamrl("recipe", "run", str(recipe), "--plain", "--set", "pools.generate.workers=2", "--set",
                    "run.steps=3", env=env)
    ids = [int(x) for x in (jobs / "ids").read_text().split()] if (jobs / "ids").exists() else []
    try:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "pools: generate=2, train=1, reward=1" in proc.stderr
        recs = read_records(only_run(tmp_path / "runs"))
        assert [r["step"] for r in recs] == [0, 1, 2]
        check_every_sample_trained_once(recs)
        assert {x["worker"] for r in recs for x in r["sample_log"]} == {"generate-0", "generate-1"}
        assert len(ids) == 4  # one job per pool worker
        # the run cancelled its jobs (SLURMCluster.close -> scancel): no job is left running
        deadline = time.time() + 30
        while any(alive(pid) for pid in ids) and time.time() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in ids if alive(pid)]
    finally:
        for pid in ids:
            try:
                os.killpg(pid, 9)
            except ProcessLookupError:
                pass


def alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_a_users_own_factory_module_gets_its_options(tiny_recipe, tmp_path, monkeypatch):
    (tmp_path / "mycluster.py").write_text(textwrap.dedent("""\
        from distributed import LocalCluster

        def make_cluster(threads_per_worker=1, **kwargs):
            # a user's function: streamrl passes factory_options and nothing else
            return LocalCluster(n_workers=0, threads_per_worker=threads_per_worker, processes=True, **kwargs)
        """))
    monkeypatch.syspath_prepend(str(tmp_path))  # (the run: PYTHONPATH)
    recipe = with_cluster_table(tiny_recipe, """
[cluster]
factory = "mycluster:make_cluster"
factory_options = { threads_per_worker = 3, host = "127.0.0.1", dashboard_address = "127.0.0.1:0" }
[cluster.pool_options.train]
memory_limit = "3GiB"
""")
    made = factories.create(load_recipe(recipe).recipe)
    try:
        assert factories.labellable(made) and made.new_spec["options"]["nthreads"] == 3
        specs = factories.pool_specs(made, load_recipe(recipe).recipe)
        assert list(specs) == ["generate-0", "train-0", "reward-0"] and not made.worker_spec  # nothing started
        train = specs["train-0"]["options"]
        assert train["name"] == "train-0" and train["nthreads"] == 1 and train["memory_limit"] == "3GiB"
        assert train["resources"] == {"train": 1, "worker:train-0": 1_000_000}
        assert train["host"] == "127.0.0.1" and train["env"]["HF_HUB_OFFLINE"] == "1"
    finally:
        made.close()


def test_a_factory_cluster_s_dashboard_stays_on_loopback_unless_the_options_say_and_an_exit_is_one_line(
        tiny_recipe, tmp_path, monkeypatch):
    # (LocalCluster's own default, ":8787", is every interface of the machine)
    made = factories.create(load_recipe(tiny_recipe, ["cluster.factory=distributed.LocalCluster",
                                                      "cluster.factory_options={processes=false}"]).recipe)
    try:
        import socket
        from urllib.parse import urlsplit

        link = urlsplit(made.dashboard_link)  # (the machine's name or address, and the port)
        socket.create_connection(("127.0.0.1", link.port), timeout=5).close()  # listening there
        if link.hostname not in ("127.0.0.1", "localhost"):
            with pytest.raises(OSError):  # and not on the machine's other address
                socket.create_connection((link.hostname, link.port), timeout=5).close()
    finally:
        made.close()
    (tmp_path / "exits.py").write_text("import sys\nsys.exit('needs a batch system')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match=r"^cluster.factory: importing exits failed: SystemExit: needs a batch system$"):
        factories.create(load_recipe(tiny_recipe, ["cluster.factory=exits:make"]).recipe)


@pytest.fixture
def labelled_elsewhere(tmp_path, monkeypatch):
    """A factory module whose cluster has a fixed worker list and no template to scale with, so
    streamrl cannot label it: the factory offers the pools itself (here all but reward)."""
    (tmp_path / "fixed.py").write_text(textwrap.dedent("""\
        from distributed import Scheduler, SpecCluster, Worker

        def make_cluster():
            workers = {name: {"cls": Worker, "options": {"nthreads": 1, "resources": {pool: 1}}}
                       for name, pool in (("g", "generate"), ("t", "train"))}
            return SpecCluster(workers=workers, scheduler={"cls": Scheduler, "options": {
                "host": "127.0.0.1", "dashboard_address": "127.0.0.1:0"}})
        """))
    monkeypatch.syspath_prepend(str(tmp_path))


def test_a_cluster_streamrl_cannot_label_is_waited_for_and_a_missing_pool_is_one_line(
        labelled_elsewhere, tiny_recipe):
    recipe = load_recipe(tiny_recipe, ["cluster.factory=fixed:make_cluster", "cluster.startup_timeout=2"]).recipe
    with pytest.raises(UserError) as err:
        lifecycle.start(recipe)
    assert str(err.value) == (
        "cluster.startup_timeout: after 2s the pools still lack workers (reward 0 of 1) (cluster.factory "
        "fixed:make_cluster: streamrl cannot label this cluster's workers, so they must offer the pools' resources "
        "themselves; see docs/deploy.md)")


def test_a_factory_whose_package_is_missing_or_whose_options_are_wrong_is_one_line(tiny_recipe):
    # validates without the package (a SLURM recipe checked on a laptop); the run says what to install
    sets = ["--set", "cluster.factory=dask_kubernetes.operator.KubeCluster"]
    assert streamrl("recipe", "validate", str(tiny_recipe), *sets).returncode == 0
    proc = streamrl("recipe", "run", str(tiny_recipe), *sets)
    assert proc.returncode == 2
    assert one_line_error(proc.stderr) == (
        "streamrl: error: cluster.factory: 'dask_kubernetes.operator.KubeCluster' needs the Python package "
        "'dask_kubernetes', which is not installed here (pip install dask-kubernetes)")

    def fails(*sets: str) -> str:
        with pytest.raises(UserError) as err:
            lifecycle.start(load_recipe(tiny_recipe, list(sets)).recipe)
        assert "\n" not in str(err.value)
        return str(err.value)

    assert fails("cluster.factory=dask_jobqueue.SLURMCluster", "cluster.factory_options={memory='1GB'}").startswith(
        "cluster.factory: dask_jobqueue.SLURMCluster(**factory_options) failed: ValueError: You must specify how "
        "much cores and memory per job")
    assert fails("cluster.factory=distributed.NoSuchCluster") == (
        "cluster.factory: module 'distributed' has no 'NoSuchCluster'")
    assert fails("cluster.factory=dask.config.get", "cluster.factory_options={key='distributed.version'}") == (
        "cluster.factory: dask.config.get returned a value of type int, not a Dask cluster "
        "(distributed.deploy.Cluster)")
    # (found with the pools, before any cluster starts: `recipe validate` says it too)
    with pytest.raises(UserError, match="^pools.generate.elastic: grows the embedded cluster only"):
        check_pools(load_recipe(tiny_recipe, ["cluster.factory=distributed.LocalCluster",
                                              "pools.generate.elastic={min=1,max=2}"]).recipe)


def test_a_batch_system_that_refuses_the_jobs_is_one_line_and_closes_the_cluster(tiny_recipe, tmp_path, monkeypatch):
    from distributed.core import Status

    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here (nor anything else)
    made = []
    create = factories.create
    monkeypatch.setattr(factories, "create", lambda recipe: made.append(create(recipe)) or made[-1])
    recipe = load_recipe(with_cluster_table(tiny_recipe, SLURM)).recipe
    with pytest.raises(UserError) as err:
        lifecycle.start(recipe)
    assert str(err.value) == ("cluster.factory: SLURMCluster could not start the pools' workers: FileNotFoundError: "
                              "[Errno 2] No such file or directory: 'sbatch'")
    assert made[0].status == Status.closed  # its scheduler too: nothing of the failed start is left


def test_recipe_mistakes_about_the_factory_are_one_line(tiny_recipe):
    def error(*sets: str) -> str:
        proc = streamrl("recipe", "validate", str(tiny_recipe), *[a for s in sets for a in ("--set", s)])
        assert proc.returncode == 2
        return one_line_error(proc.stderr)

    assert "cluster.factory: expected an importable callable like 'dask_jobqueue.SLURMCluster'" in error(
        "cluster.factory=SLURMCluster")
    assert "cluster: address and factory are both set" in error(
        "cluster.factory=distributed.LocalCluster", "cluster.address=tcp://127.0.0.1:8786")
    assert "cluster: factory_options is set but factory is not" in error("cluster.factory_options={cores=2}")
    assert "cluster.pool_options.gen.[key]: expected 'generate', 'train', 'reward', 'rank' or 'agent'" in error(
        "cluster.factory=distributed.LocalCluster", "cluster.pool_options={gen={}}")


def test_streamrl_imports_no_optional_cluster_library():
    code = ("import sys, streamrl.cli, streamrl.cluster.lifecycle, streamrl.cluster.factories; "
            "print([m for m in ('dask_jobqueue', 'dask_kubernetes', 'dask_cuda') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr[-2000:]


class OneWorkerPerGpu:
    """dask-cuda's ``LocalCUDACluster`` as ``factories.pool_specs`` sees it (a stand-in: it needs
    a GPU): worker specs keyed by GPU id, and no spec once every listed GPU has a worker."""

    def __init__(self, gpus: list[int]):
        from distributed import Nanny

        self.gpus, self.worker_spec = gpus, {}
        self.new_spec = {"cls": Nanny, "options": {"preload": ["dask_cuda.initialize"]}}

    def new_worker_spec(self):
        free = sorted(set(self.gpus) - set(self.worker_spec))
        if not free:
            raise ValueError("Can not scale beyond visible devices", self.gpus)
        return {free[0]: {"cls": self.new_spec["cls"],
                          "options": {**self.new_spec["options"], "env": {"CUDA_VISIBLE_DEVICES": str(free[0])}}}}


def test_pools_that_list_their_gpus_share_one_gpu_on_a_cluster_of_one_worker_per_gpu(tiny_recipe):
    shared = ["--set", 'pools.generate.cuda_visible_devices=["0"]', "--set", 'pools.train.cuda_visible_devices=["0"]']
    recipe = load_recipe(tiny_recipe, [*shared, "--set", 'pools.reward.cuda_visible_devices=["0"]'][1::2]).recipe
    specs = factories.pool_specs(OneWorkerPerGpu([0]), recipe)
    assert sorted(specs) == ["generate-0", "reward-0", "train-0"]
    assert all(s["options"]["env"]["CUDA_VISIBLE_DEVICES"] == "0" and s["options"]["preload"] == ["dask_cuda.initialize"]
               for s in specs.values())
    # a pool that names no GPU takes the library's next one: train takes GPU 0, none is left for reward
    recipe = load_recipe(tiny_recipe, shared[1:2]).recipe
    with pytest.raises(UserError, match=r"OneWorkerPerGpu has no worker spec for worker 3 of 3, reward-0"):
        factories.pool_specs(OneWorkerPerGpu([0]), recipe)


def test_the_watchers_rates_as_environment_variables_are_what_dask_reads_back():
    # docs/deploy.md gives these variables for a cluster started by hand; Dask must read them as
    # the very settings the embedded cluster uses
    import dask

    from streamrl.cluster.pool_workers import WATCHERS, dask_environment

    env = dask_environment(WATCHERS)
    assert all(name.startswith("DASK_DISTRIBUTED__") for name in env) and len(env) == 4
    read = {}
    dask.config.update(read, dask.config.collect_env(env))
    for key in ("distributed.admin.tick.interval", "distributed.admin.system-monitor.interval",
                "distributed.worker.memory.monitor-interval", "distributed.worker.profile.interval"):
        assert dask.config.get(key, config=read) == dask.config.get(key, config=WATCHERS), key


@pytest.mark.slow
def test_a_stop_while_a_factorys_workers_are_awaited_ends_the_start_and_closes_the_cluster(
        labelled_elsewhere, tiny_recipe, tmp_path):
    # signals were ignored for the whole start: Ctrl-C or a batch system's SIGTERM while the jobs
    # waited in the queue did nothing for up to cluster.startup_timeout (30 minutes in the docs),
    # then SIGKILL came and the jobs were left behind. Only the processes' own start ignores them,
    # and one signal while the workers are awaited ends the start (a batch system sends one).
    import signal

    from tests.helpers import sets, start, stop

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = start("recipe", "run", str(tiny_recipe), *sets(f"run.out_dir={tmp_path / 'runs'}", "cluster.dashboard=false",
                                                          "cluster.factory=fixed:make_cluster",
                                                          "cluster.startup_timeout=600"), env=env)
    try:
        deadline = time.time() + 120
        while not list((tmp_path / "runs").glob("*/status.json")) and time.time() < deadline:
            time.sleep(0.2)
        time.sleep(5)  # (in the wait for the reward pool's worker, which never comes)
        os.kill(proc.pid, signal.SIGTERM)  # (a batch system's one SIGTERM, then SIGKILL)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    finally:
        stop(proc)
