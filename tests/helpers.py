"""What the test modules share (one copy of each): the real ``streamrl`` command run as a user
runs it (a subprocess, ``cwd`` the repository), a recipe run from it and its records, a run
started in the background and stopped, faults put into a running run, a cluster started by hand
with Dask's own command line, and the tiny recipe.

Test modules import from here (and fixtures come from ``conftest.py``); no test module imports
another."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests import in_process

ROOT = Path(__file__).resolve().parent.parent

# (no Dask dashboard: nobody watches a test's run; tests/test_dashboard.py turns it on)
TINY_RECIPE = """
[run]
name = "tiny"
steps = 2
out_dir = "{out}"

[cluster]
dashboard_port = 0
dashboard = false

[pools.generate]
threads = 4
[pools.train]
threads = 1
[pools.reward]
threads = 1

[model]
path = "{model}"

[task]
name = "addition"

[engine]
name = "hf"
max_new_tokens = 6

[reward]
name = "exact_match"

[trainer]
lr = 1e-3
prompts_per_step = 4
samples_per_prompt = 4
groups_per_micro_batch = 1
"""


def write_tiny_recipe(folder: Path, model: Path, name: str = "tiny.toml", more: str = "") -> Path:
    """``TINY_RECIPE`` for ``model`` in ``folder`` (its runs go to ``folder / "runs"``), with ``more``
    appended."""
    path = folder / name
    path.write_text(TINY_RECIPE.format(out=folder / "runs", model=model) + more)
    return path


# -- the command ------------------------------------------------------------------------------------
def streamrl(*args: str, env: dict | None = None, cwd: Path = ROOT, timeout: int = 300,
             fresh: bool = False) -> subprocess.CompletedProcess:
    """``streamrl *args``, waited for within ``timeout`` seconds, its output captured: in this
    process (tests/in_process.py: the same output, a fraction of the CPU), or as ``python -m
    streamrl`` in a process of its own when ``fresh``, when ``env`` is given, or in a smoke test."""
    if env is None and not (fresh or in_process.fresh_only or in_process.ALWAYS_FRESH):
        return in_process.run(list(map(str, args)), cwd, timeout=timeout)
    try:
        return subprocess.run([sys.executable, "-m", "streamrl", *map(str, args)], cwd=cwd, capture_output=True,
                              text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:  # (with what it printed in the message pytest shows)
        raise in_process.TimedOut(exc.cmd, exc.timeout, exc.stdout, exc.stderr) from None


def sets(*values: str) -> list[str]:
    """``--set`` before each of ``values``."""
    return [a for v in values for a in ("--set", v)]


def close_cluster(client, cluster, timeout: float = 60) -> None:
    """Close a cluster a test started in its own process, and its client, each within
    ``timeout`` seconds. A close that hangs then fails the test's teardown instead of stalling
    the whole session: a module fixture's teardown runs when the test's own timeout may have
    fired already, and nothing else would end it."""
    try:
        client.close(timeout=timeout)
    finally:
        cluster.close(timeout=timeout)


def one_line_error(err: str) -> str:
    """The only non-blank line of ``err`` (checked: one line, no traceback)."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def last_error_line(proc: subprocess.CompletedProcess, status: int) -> str:
    """The last line of stderr, after checking the exit status and that no traceback came out."""
    assert proc.returncode == status, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("streamrl: error: "), proc.stderr[-3000:]
    return last


# -- a run's folder -----------------------------------------------------------------------------------
def only_run(out: Path) -> Path:
    """The one run folder in ``out``."""
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    return run


def read_records(run_dir: Path, partial: bool = False) -> list[dict]:
    """The run's ``metrics.jsonl`` records. ``partial``: of a run still going (none yet, or a
    last line being written, is no error)."""
    path = run_dir / "metrics.jsonl"
    if not partial:
        return [json.loads(line) for line in path.read_text().splitlines()]
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


@dataclass
class Run:
    """A finished ``streamrl recipe run``: the process, and its run folder (None if it made none)."""

    proc: subprocess.CompletedProcess
    dir: Path | None

    @property
    def records(self) -> list[dict]:
        return read_records(self.dir)


def run_recipe(recipe, *settings: str, out: Path | None = None, args: tuple[str, ...] = (), env: dict | None = None,
               timeout: int = 600, command: str = "run") -> Run:
    """``streamrl recipe run RECIPE --set ...`` (``run.out_dir`` = ``out`` when given), checked to
    succeed; the run folder is the one in ``out``, else the one the command prints. Without Dask's
    dashboard (``cluster.dashboard = false``): nobody watches a test's run."""
    more = [f'run.out_dir="{out}"'] if out is not None else []
    more.append("cluster.dashboard=false")
    proc = streamrl("recipe", command, str(recipe), *sets(*settings, *more), *args, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Run(proc, only_run(out) if out is not None else Path(proc.stdout.strip().splitlines()[-1]))


# -- a run in the background --------------------------------------------------------------------------
def start(*args: str, group: bool = True, env: dict | None = None) -> subprocess.Popen:
    """``python -m streamrl *args`` in the background, its output piped; ``group``: as the leader
    of its own process group (as under systemd, Slurm or a terminal: its workers are in it)."""
    return subprocess.Popen([sys.executable, "-m", "streamrl", *map(str, args)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=group, env=env)


def start_run(recipe: Path, out: Path, *settings: str, steps: int | None = 14) -> subprocess.Popen:
    """``streamrl recipe run`` into ``out`` (of ``steps`` steps unless None), in its own process
    group, without Dask's dashboard."""
    return start("recipe", "run", str(recipe), *sets(f"run.out_dir={out}", *([f"run.steps={steps}"] if steps else []),
                                                     "cluster.dashboard=false", *settings))


def stop(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to ``proc``'s process group (a test's clean-up), also when ``proc`` itself
    has ended: a run that died leaves its workers in its group, and they would go on eating the
    CPU the next tests are timed on. Nothing happens once the whole group is gone."""
    proc.poll()  # (reaped first: a leader that ended is no longer counted in its group)
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# -- `streamrl serve` in the background ----------------------------------------------------------------
def start_serving(*args: str, log: Path) -> subprocess.Popen:
    """``python -m streamrl *args --plain`` (``serve R.toml`` or ``recipe resume``) in the
    background, its output in ``log`` (unbuffered: the test reads it as it comes)."""
    with log.open("w") as out:  # (the process has its own copy of the file)
        return subprocess.Popen([sys.executable, "-m", "streamrl", *map(str, args), "--plain"], stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def served_at(proc: subprocess.Popen, runs: Path, log: Path, timeout: float = 240) -> tuple[dict, Path]:
    """The endpoint of the serve run in ``runs`` once it serves: its ``serve.json`` (``url``,
    ``model``) and its run folder. Fails the test with the log's tail if the process ends first
    or ``timeout`` passes."""
    deadline = time.time() + timeout
    while proc.poll() is None and time.time() < deadline:
        if "serving: " in log.read_text() and list(runs.glob("*/serve.json")):
            break
        time.sleep(0.2)
    found = list(runs.glob("*/serve.json"))
    if proc.poll() is not None or not found:
        stop_serving(proc)
        raise AssertionError(f"the endpoint never served:\n{log.read_text()[-3000:]}")
    return json.loads(found[0].read_text()), found[0].parent


def stop_serving(proc: subprocess.Popen, timeout: float = 90) -> int | None:
    """SIGINT, as a user's Ctrl-C, waited for ``timeout`` seconds, then a kill; the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def wait_for_steps(proc: subprocess.Popen, out: Path, steps: int, timeout: float = 240) -> Path:
    """Wait until the run in ``out`` has recorded ``steps`` steps (while ``proc`` runs); its folder."""
    deadline = time.time() + timeout
    while True:
        runs = list(out.glob("*/metrics.jsonl"))
        if runs and len(runs[0].read_text().splitlines()) >= steps:
            return runs[0].parent
        assert proc.poll() is None and time.time() < deadline, output_at_end(proc)[-3000:]
        time.sleep(0.05)


def output_at_end(proc: subprocess.Popen, timeout: float = 30) -> str:
    """The stderr of ``proc`` (started with its output piped), once it and its process group are
    killed; what came within ``timeout`` seconds. A run's worker processes may hold its pipes
    open after it ended: a plain ``communicate()`` would wait for them."""
    for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
        try:
            kill()
            break
        except (ProcessLookupError, PermissionError):
            continue
    try:
        return proc.communicate(timeout=timeout)[1] or ""
    except subprocess.TimeoutExpired as exc:
        return (exc.stderr or b"").decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")


def finish_order(engine) -> list[str]:
    """The request ids ``engine``'s queue hands responses back for, in the order it does (a list
    that grows as they end). The order in which the asking threads wake up and stamp their
    samples' ``gen_end`` is the OS's, on a loaded machine not the engine's."""
    order: list[str] = []
    finish = engine._queue.finish

    def recorded(rid, response):
        order.append(rid)
        finish(rid, response)

    engine._queue.finish = recorded
    return order


def until(cond, within: float = 30.0, every: float = 0.01):
    """Wait for ``cond()`` to be true and return it; the deadline only guards against a hang."""
    deadline = time.time() + within
    while True:
        got = cond()
        if got:
            return got
        assert time.time() < deadline, "gave up waiting"
        time.sleep(every)


# -- a running run's cluster ---------------------------------------------------------------------------
def worker_processes(pid: int) -> list:
    """The embedded cluster's worker processes under process ``pid`` (``psutil.Process``es): those
    a nanny spawned, and those forked from the warm-start server (``cluster/warm_start.py``)."""
    import psutil

    found = []
    try:
        procs = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for proc in procs:
        try:
            if "spawn_main" in " ".join(proc.cmdline()) or "multiprocessing.forkserver" in " ".join(
                    proc.parent().cmdline()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, AttributeError):
            pass
    return found


def worker_addresses(run_dir: Path) -> dict[str, str]:
    """``{worker name: address}`` of the run's cluster now (through its scheduler)."""
    from distributed import Client

    from streamrl.cluster import lifecycle

    address = json.loads((run_dir / "status.json").read_text())["scheduler"]
    with Client(address, timeout=10) as client:
        return {str(w["name"]): a for a, w in lifecycle.workers(client).items()}


def kill_worker(run_dir: Path, *names: str) -> None:
    """``kill -9`` the processes of the workers called ``names`` (found through the run's
    scheduler), one right after another."""
    from distributed import Client

    from streamrl.cluster import lifecycle

    address = json.loads((run_dir / "status.json").read_text())["scheduler"]
    with Client(address, timeout=10) as client:
        addrs = [a for a, w in lifecycle.workers(client).items() if w["name"] in names]
        assert len(addrs) == len(names), (names, lifecycle.workers(client))
        pids = client.run(os.getpid, workers=addrs)
    for pid in pids.values():
        os.kill(pid, signal.SIGKILL)


# -- a cluster started by hand -------------------------------------------------------------------------
DASK = str(Path(sys.executable).with_name("dask"))
#: The pools' threads in ``TINY_RECIPE``: each worker offers as many slots.
POOLS = {"generate": 4, "train": 1, "reward": 1}


@dataclass
class HandCluster:
    """A cluster started with Dask's own command line (:func:`hand_started_cluster` owns its
    processes): its scheduler's address."""

    address: str

    @property
    def sets(self) -> list[str]:
        """The ``--set`` value that runs a recipe on it."""
        return [f"cluster.address={self.address}"]


def spawn(args: list[str], log: Path) -> subprocess.Popen:
    """A ``dask`` command in its own process group (the worker's nanny and the worker process
    it spawns are both in it: teardown kills the group). The malloc setting and Dask's watchers'
    rates are the ones docs/deploy.md asks for on a hand-started cluster."""
    from streamrl.cluster import lifecycle
    from streamrl.cluster.pool_workers import WATCHERS, dask_environment

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": lifecycle.PRE_SPAWN_ENV["MALLOC_MMAP_THRESHOLD_"],
           **dask_environment(WATCHERS)}
    with open(log, "w") as out:
        return subprocess.Popen([DASK, *args], stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, cwd=ROOT)


def start_scheduler(folder: Path) -> tuple[subprocess.Popen, str]:
    """``dask scheduler`` on a free loopback port; returns it and its address (from the
    scheduler file, which the scheduler writes once it listens)."""
    file = folder / "scheduler.json"
    proc = spawn(["scheduler", "--host", "127.0.0.1", "--port", "0", "--dashboard-address", "127.0.0.1:0",
                  "--scheduler-file", str(file)], folder / "scheduler.log")
    deadline = time.time() + 60
    while True:
        try:
            return proc, json.loads(file.read_text())["address"]
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            assert proc.poll() is None and time.time() < deadline, (folder / "scheduler.log").read_text()[-3000:]
            time.sleep(0.1)


def kill_all(procs: dict[str, subprocess.Popen]) -> None:
    """``kill -9`` each process's group, and wait for it."""
    for proc in procs.values():
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


@contextmanager
def hand_started_cluster(folder: Path):
    """``dask scheduler`` and one ``dask worker`` per pool of ``TINY_RECIPE`` (``--name
    POOL-0 --nthreads N --resources POOL=N``), as docs/deploy.md tells users, all on loopback;
    the ``HandCluster`` once every worker is up; killed on exit."""
    from distributed import Client

    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["scheduler"], address = start_scheduler(folder)
        for pool, threads in POOLS.items():
            procs[f"{pool}-0"] = spawn(["worker", address, "--host", "127.0.0.1", "--no-dashboard",
                                        "--name", f"{pool}-0", "--nthreads", str(threads),
                                        "--resources", f"{pool}={threads}"], folder / f"{pool}-0.log")
        with Client(address, timeout=30) as client:
            client.wait_for_workers(len(POOLS), timeout=180)
        yield HandCluster(address)
    finally:
        kill_all(procs)


# -- what a run listens on ----------------------------------------------------------------------------
def listeners_of(root) -> set[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket ``root`` (a ``psutil.Process``) and its descendants
    listen on."""
    import psutil

    found = set()
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return found
    for proc in procs:
        try:
            for conn in proc.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN:
                    found.add((proc.pid, conn.laddr.ip, conn.laddr.port))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def watch_listeners(args: list[str], timeout: float = 600) -> tuple[subprocess.CompletedProcess, set]:
    """Run ``python -m streamrl *args`` and, every 50 ms until it ends, note what its process
    tree listens on (short-lived listeners too: a weight version's store lives about a second)."""
    import threading

    import psutil

    proc = start(*args, group=False)
    seen: set = set()
    done = threading.Event()

    def poll():
        root = psutil.Process(proc.pid)
        while not done.is_set():
            seen.update(listeners_of(root))
            time.sleep(0.05)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        done.set()
        watcher.join(10)
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), seen


# -- what a run's records must show ------------------------------------------------------------------
def check_every_sample_trained_once(records, prompts=4, n=4):
    """By sample id: each step trained exactly its own prompts' samples, none twice, none lost."""
    seen = set()
    for r in records:
        uids = [x["uid"] for x in r["sample_log"]]
        assert sorted(uids) == sorted(f"{r['step']}-{i:03d}-{k}" for i in range(prompts) for k in range(n)), r["step"]
        assert not seen & set(uids)
        seen |= set(uids)
        for x in r["sample_log"]:
            # the timeline is ordered, and staleness is what the version says
            assert x["submitted"] <= x["gen_start"] <= x["gen_end"] <= x["reward_end"] <= x["trained"], x
            assert x["staleness"] == r["step"] - x["version"]


def check_pool_accounting(records, workers=None, ahead=False):
    """``ahead`` (async): generation runs in earlier windows than its step's, so a step's window
    may hold none of it (the last steps' groups were all generated before they began)."""
    import pytest

    workers = workers or {"generate": 1, "train": 1, "reward": 1}
    for r in records:
        for pool, n in workers.items():
            acc = r["pools"][pool]
            assert 0.0 <= acc["idle_ratio"] <= 1.0 and acc["busy_s"] >= 0.0
            # busy + idle covers the accounting window (step boundary to boundary) once per worker
            assert acc["busy_s"] + acc["idle_s"] == pytest.approx(n * r["accounting_window_s"], abs=1e-3), (pool, acc)
            assert r["step_s"] <= r["accounting_window_s"] + 1e-3
        assert r["pools"]["train"]["busy_s"] > 0 and (ahead or r["pools"]["generate"]["busy_s"] > 0)
    assert sum(r["pools"]["generate"]["busy_s"] for r in records) > 0


# -- recipes with more in them ------------------------------------------------------------------------
def with_plugin(recipe: Path, name: str, code: str, extra: str = "", replace: tuple[str, str] | None = None) -> Path:
    """A copy of ``recipe`` (``<name>.toml`` beside it) that loads ``code`` as the recipe-local
    plugin ``<name>.py``, with ``replace`` applied to its text and ``extra`` appended."""
    (recipe.parent / f"{name}.py").write_text(code)
    text = recipe.read_text()
    if replace:
        text = text.replace(*replace)
    out = recipe.parent / f"{name}.toml"
    out.write_text(text + extra + f'\n[plugins]\nmodules = ["{name}.py"]\n')
    return out


LEARNERS = """
[[learners]]
name = "grpo"

[[learners]]
name = "rloo"
algorithm = {{ name = "rloo" }}
trainer = {{ lr = 2e-3 }}
{more}
"""


def with_learners(recipe: Path, more: str = "", head: str = "") -> Path:
    """``learners.toml`` beside ``recipe``: it, with a grpo and an rloo learner (and ``more``)."""
    out = recipe.with_name("learners.toml")
    out.write_text(head + recipe.read_text() + LEARNERS.format(more=more))
    return out


PARITY_REWARD = """
from pydantic import BaseModel
import streamrl
from streamrl.plugins.registry import Component

class ParityConfig(BaseModel):
    pass

class Parity:
    def __init__(self, config):
        pass
    def score(self, prompt, response):
        return float(len(response) % 2 == 0)

@streamrl.hookimpl
def register_rewards():
    return [Component("reward", "length_parity", ParityConfig, Parity)]
"""


def parity_recipe(folder, tiny_model, overrides=()):
    """The tiny recipe with a recipe-local reward that has variance. An untrained model never
    adds correctly; this gives GRPO a signal (and checks that a plugin defined in a file next to
    the recipe reaches the workers)."""
    from streamrl.recipe.recipe import load_recipe

    path = folder / "tiny.toml"
    (folder / "parity.py").write_text(PARITY_REWARD)
    text = TINY_RECIPE.format(out=folder / "runs", model=tiny_model)
    text = text.replace('name = "exact_match"', 'name = "length_parity"')
    path.write_text(text + '\n[plugins]\nmodules = ["./parity.py"]\n')
    return load_recipe(path, list(overrides))


# -- checkpoints ------------------------------------------------------------------------------------
def rewrite_manifest(ckpt: Path) -> None:
    """What someone who can write the run folder does next: a manifest that matches the files as
    they are now."""
    import hashlib

    from streamrl.checkpoints import integrity

    (ckpt / integrity.MANIFEST).unlink()
    integrity.write_manifest(ckpt)
    files = json.loads((ckpt / integrity.MANIFEST).read_text())["files"]
    for name, f in files.items():
        assert hashlib.sha256((ckpt / name).read_bytes()).hexdigest() == f["sha256"]


def newest_usable(run: Path) -> tuple[Path | None, list[str]]:
    """The checkpoint a resume of ``run`` would take, and the run warnings that choice gave."""
    from streamrl.checkpoints import folders
    from streamrl.errors import RunWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        best = folders.latest(run)
    return best, [str(w.message) for w in caught if issubclass(w.category, RunWarning)]


# -- the trainer in this process ------------------------------------------------------------------
def make_groups(trainer, n_groups=6, size=4, seed=0):
    """Groups sampled from the trainer's own model, with random rewards."""
    import random

    from streamrl.sample import Prompt, Sample

    rng = random.Random(seed)
    tok = trainer.tokenizer
    groups = []
    for g in range(n_groups):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        prompt = Prompt(uid=f"0-{g}", text=f"{a}+{b}=", answer=str(a + b))
        ids = [tok.bos_token_id] + tok(prompt.text, add_special_tokens=False).input_ids
        group = []
        for k in range(size):
            resp = [rng.randint(3, len(tok) - 1) for _ in range(rng.randint(1, 5))]
            s = Sample(uid=f"{prompt.uid}-{k}", prompt=prompt, prompt_ids=ids, response_ids=resp,
                       logprobs=[0.0] * len(resp))
            s.logprobs = trainer.logprobs([s])[0]
            s.reward = float(rng.random() < 0.5)
            group.append(s)
        groups.append(group)
    return groups


@contextmanager
def slot_endpoint(model, max_prompt_tokens: int = 32, serve=None):
    """An endpoint of ``model`` served by a 4-slot engine (4 new tokens, temperature 1.0) on a free
    loopback port, in this process; yields ``(the Endpoint, its base URL)``. ``serve``: its
    ``ServeConfig`` (default: port 0, the rest as a recipe's)."""
    from streamrl.engines.hf_config import HFEngineConfig
    from streamrl.engines.slots import SlotEngine
    from streamrl.recipe.serve import ServeConfig
    from streamrl.serve.openai_api import Endpoint
    from streamrl.serve.traffic import Traffic

    engine = SlotEngine(HFEngineConfig(batching="slots", slots=4, max_prompt_tokens=max_prompt_tokens,
                                       max_new_tokens=4, temperature=1.0, profile=False))
    engine.load(str(model))
    api = Endpoint(engine, serve or ServeConfig(port=0), Traffic(60.0), "policy")
    try:
        with endpoint_in_process(api) as url:
            yield api, url
    finally:
        engine.close()


@contextmanager
def endpoint_in_process(api, **protocol):
    """The OpenAI-compatible app of ``api`` (a ``serve.openai_api.Endpoint``) on a free loopback
    port, served in a thread of this process as a run serves it (``protocol``: the bounds of
    ``http_server.bounded_protocol`` to change); yields its base URL (``.../v1``)."""
    from streamrl.serve.http_server import bounded_protocol, start_in_thread
    from streamrl.serve.routes import make_app

    server, thread, port = start_in_thread(make_app(api), "127.0.0.1", 0, "test-endpoint",
                                           protocol=bounded_protocol(**protocol))
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(5)

