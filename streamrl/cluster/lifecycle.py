"""Pools as Dask worker resources: the embedded local cluster, one from a factory, or an existing one.

A pool is a label on workers: a worker of pool ``generate`` offers the resource ``generate``
(one unit per task slot) and is named ``generate-<i>``. Tasks ask for the resource, so the
scheduler sends them only there. The embedded cluster is a ``SpecCluster`` of ``Nanny`` worker
processes bound to ``cluster.host`` (127.0.0.1 by default: nothing listens outside the machine).
``cluster.factory`` names a callable that returns a cluster (``dask_jobqueue.SLURMCluster``,
``distributed.LocalCluster``, your own); ``streamrl/cluster/factories.py`` labels its workers.
``cluster.address`` connects to a cluster someone started (``dask scheduler`` and, per worker,
``dask worker tcp://SCHED:8786 --name generate-0 --nthreads 16 --resources "generate=16"``);
streamrl leaves that one running and takes the run's state off it when the run ends
(``docs/deploy.md``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager, nullcontext

import dask
from distributed import Client, Scheduler, SpecCluster
from distributed.deploy import Cluster

from streamrl.cluster.attach import (EXPECTED_SCHEDULER, check_scheduler_address, check_worker_imports, claim,
                                     name_pins, release)
from streamrl.errors import UserError
from streamrl.cluster.pool_workers import (LEARN, PIN, PRE_SPAWN_ENV, WATCHERS, WORKER_MEMORY, side_learner_names,
                                           worker_spec, workers, addresses)  # noqa: F401  (addresses: said from here)
from streamrl.cluster.quiet import QuickExit, QuietShutdown, QuietTaskErrors, drop_cut_short_restart, quiet_dask
from streamrl.cluster import warm_start
from streamrl.recipe.pools import REQUIRED_POOLS
from streamrl.recipe.recipe import Recipe

log = logging.getLogger(__name__)


def start(recipe: Recipe, verbose: bool = False, spawning: Callable[[], ContextManager] = nullcontext,
          stopping: Callable[[], bool] = lambda: False) -> tuple[Cluster | None, Client]:
    """Start the run's cluster (the embedded one, or ``cluster.factory``'s) or connect to
    ``cluster.address``; wait for every pool and check that its workers can load what the recipe
    runs there. Returns the cluster streamrl started (None for one it did not) and a client.
    ``spawning``: held while a factory's cluster starts its processes (the run ignores stop
    signals then, as the processes inherit), not while it waits for the pools' workers (a batch
    queue's, for as long as ``cluster.startup_timeout``): ``stopping()`` true then (a stop
    signal came) ends the start, and the cluster is closed."""
    level = quiet_dask(verbose)
    c = recipe.cluster
    # glibc's malloc settings for every worker a Nanny in this process spawns (see PRE_SPAWN_ENV),
    # and no spilling or pausing for memory (WORKER_MEMORY): a Nanny hands its config to its worker
    dask.config.set({f"distributed.nanny.pre-spawn-environ.{k}": v for k, v in PRE_SPAWN_ENV.items()})
    dask.config.set(WORKER_MEMORY)
    dask.config.update_defaults(WATCHERS)  # (Dask's watchers at a long task's pace; a user's setting wins)
    cluster: Cluster | None = None
    client: Client | None = None
    try:
        if c.address:
            check_scheduler_address(c.address, c.connect_timeout)
            try:
                client = Client(c.address, timeout=c.connect_timeout)
            except OSError as exc:
                raise UserError(f"cluster.address: cannot reach scheduler {c.address} ({exc})") from None
            except Exception as exc:  # (the check passed, but what answered is no scheduler after all)
                raise UserError(f"cluster.address: {c.address} did not answer as a Dask scheduler "
                                f"({type(exc).__name__}: {str(exc)[:200]}); {EXPECTED_SCHEDULER}") from None
            try:
                claim(client, recipe)
            except BaseException:
                client.close()  # (not stop(): what is on the cluster belongs to the run that has it)
                client = None
                raise
        elif c.factory:
            from streamrl.cluster import factories  # imports the factory's library only now

            with spawning():
                cluster = factories.create(recipe)
                labelled = factories.labellable(cluster)
                if labelled:
                    factories.label(cluster, recipe)
            client = Client(cluster)
            # (side learners' workers: waited for only where streamrl starts them; elsewhere
            # placing a learner says at once which worker is missing and how to start it)
            wait_for_pools(client, recipe, "" if labelled else
                           f" (cluster.factory {c.factory}: streamrl cannot label this cluster's workers, so they "
                           "must offer the pools' resources themselves; see docs/deploy.md)", learners=labelled,
                           stopping=stopping)
        else:
            host = c.host
            warm_start.begin(recipe)  # (started already by the command, as early as it could)
            RunCluster.starting = None
            cluster = RunCluster(
                workers=worker_spec(recipe, level),
                # (without the dashboard the scheduler still serves its health routes: on a free port)
                scheduler={"cls": Scheduler, "options": {
                    "host": host, "dashboard": c.dashboard,
                    "dashboard_address": f"{host}:{c.dashboard_port if c.dashboard else 0}"}},
                silence_logs=level, name="streamrl",
            )
            RunCluster.starting = None  # (returned: ``cluster`` has it now)
            client = Client(cluster)
            try:
                client.wait_for_workers(len(cluster.worker_spec), timeout=c.startup_timeout)
            except TimeoutError:
                raise UserError(f"cluster.startup_timeout: workers did not start within "
                                f"{c.startup_timeout}s") from None
        pools = check_pools(client, recipe)
        keep_replicas(client)
        if c.address or c.factory:
            # workers that may run elsewhere, from another environment: before anything of the
            # run is sent there, each must load what its pool will build
            check_worker_imports(client, recipe, pools)
            name_pins(client)
        if cluster is not None:  # only on workers we started ourselves
            client.register_plugin(QuickExit())
            client.register_plugin(QuietShutdown())
            if not verbose:
                client.register_plugin(QuietTaskErrors())
    except BaseException:
        # a cluster streamrl started must not outlive the failure (SLURM jobs would keep running);
        # one interrupted while it started (a second Ctrl-C) was never returned to us
        cluster = cluster if cluster is not None else RunCluster.starting
        if client is not None or cluster is not None:
            try:
                stop(cluster, client)
            except Exception:  # the start's own error is the one to report
                pass
        raise
    return cluster, client


class RunCluster(SpecCluster):
    """The embedded cluster: Dask's ``SpecCluster``, remembered before it starts its processes.
    A ``KeyboardInterrupt`` raised while its constructor waits for them (the second Ctrl-C)
    would leave the caller without the object to close, and its scheduler and workers to Dask's
    exit hook, which closes them late or not at all."""

    #: the cluster whose constructor is running in this process (None once it returned)
    starting: RunCluster | None = None

    def __init__(self, *args, **kwargs):
        RunCluster.starting = self
        super().__init__(*args, **kwargs)


#: Clients (by id) that stopped the Active Memory Manager of a cluster they did not start, which
#: :func:`stop` starts again.
_AMM_STOPPED: set[str] = set()


def keep_replicas(client: Client) -> None:
    """Stop the scheduler's Active Memory Manager for the run. Each cycle it drops the copies of a
    result that no task waits for, keeping one, and it drops from the worker using the most
    memory: the train worker, for the published weights, once the generate workers have loaded
    them. A generate worker killed then takes the last copy with it, and the one that restarts
    finds its catch-up waiting on a recomputation that needs the whole step again (seen in CI).
    streamrl places its data itself (pins), so nothing needs the AMM; retiring a worker (an
    elastic pool shrinking) starts one of its own for the retirement."""
    try:
        if client.amm.running():
            client.amm.stop()
            _AMM_STOPPED.add(client.id)
    except Exception:  # a scheduler without the extension has no AMM to stop
        pass


#: Seconds a run waits for the cluster it started to close, after its workers were retired: a
#: close with no bound was one place a run could hang at its very end.
CLOSE_TIMEOUT = 60.0


def stop(cluster: Cluster | None, client: Client | None, timeout: float = 10.0) -> None:
    """End the run's use of the cluster: shut down a cluster streamrl started, workers first;
    take the run's state off one it did not (:func:`release`) and leave that one running.

    Closing the scheduler while workers still run makes each worker log a heartbeat traceback
    on its way out; retiring them first keeps the end of a run quiet.
    """
    if cluster is None:
        if client is not None:
            release(client)
            if client.id in _AMM_STOPPED:  # the cluster stays up: as it was before the run
                _AMM_STOPPED.discard(client.id)
                try:
                    client.amm.start()
                except Exception:
                    pass
            client.close()
        return
    # Results the controller still holds (the last optimizer step) go with their workers;
    # that is the point of stopping, so the scheduler need not warn about it.
    logging.getLogger("distributed.scheduler").setLevel(logging.ERROR)
    # A nanny may be restarting a worker that was killed (a lost train rank is why the run
    # stops); closing it cuts the start short, which it logs with a traceback, above the run's
    # own one-line error. Nothing is lost by then: the cluster is going away on purpose.
    logging.getLogger("distributed.nanny").addFilter(drop_cut_short_restart)
    if isinstance(cluster, SpecCluster):
        try:
            cluster.scale(0)
            deadline = time.monotonic() + timeout
            # Wait for the Nanny processes themselves (SpecCluster drops them once closed), not
            # only for the scheduler to forget them: a worker still closing when the scheduler
            # goes away logs a heartbeat traceback (seen about one run in four before this).
            while (cluster.workers or (client is not None and workers(client))) and time.monotonic() < deadline:
                time.sleep(0.1)
        except Exception:  # shutting down anyway; never hide the run's real error behind this
            pass
    if client is not None:
        client.close()
    try:
        cluster.close(timeout=CLOSE_TIMEOUT)
    except TimeoutError:  # (a process that does not answer ends with this one: its nanny's child)
        log.warning("the cluster did not close within %.0f s; its processes end with this one", CLOSE_TIMEOUT)


#: Seconds the end of a run waits for its clean-up of the cluster (:func:`stop_meanwhile`): a
#: cluster someone else runs answers the removal of streamrl's plugins from every worker, and one
#: whose worker hangs in its plugin's teardown (a step that hung) never does.
STOP_TIMEOUT = CLOSE_TIMEOUT + 60.0


def stop_meanwhile(cluster: Cluster | None, client: Client | None,
                   timeout: float | None = None) -> Callable[[], None]:
    """Start :func:`stop` in a thread and return what waits for it to be done (at most
    ``timeout`` seconds, :data:`STOP_TIMEOUT` by default: then it is said, and the command
    ends without it).

    At a run's end the workers' exits take about as long as the report takes to draw, and
    neither needs the other, so they overlap; an error of the shutdown is raised by the wait, in
    the caller's thread, as it would be by :func:`stop` itself."""
    if cluster is None and client is None:
        return lambda: None
    failed: list[BaseException] = []

    def shut_down():
        try:
            stop(cluster, client)
        except BaseException as exc:  # re-raised in the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=shut_down, name="streamrl-cluster-stop", daemon=True)
    thread.start()

    def wait():
        limit = STOP_TIMEOUT if timeout is None else timeout
        thread.join(limit)
        if thread.is_alive():
            log.warning("the cluster's clean-up did not finish within %.0f s; the command ends without it "
                        "(a worker may hold streamrl's engine or trainer until it restarts)", limit)
            return
        if failed:
            raise failed[0]

    return wait


def wait_for_pools(client: Client, recipe: Recipe, why: str = "", learners: bool = False,
                   stopping: Callable[[], bool] = lambda: False) -> None:
    """Wait up to ``cluster.startup_timeout`` until every pool has the workers its
    ``[pools.<name>] workers`` asks for, and with ``learners`` every side learner its worker (a
    factory's workers come up in their own time: a batch job waits in its queue); ``why`` ends
    the timeout's message. ``stopping()`` true (a stop signal came): ``KeyboardInterrupt`` at
    once -- a batch system sends one SIGTERM, then SIGKILL."""
    want = {pool: getattr(recipe.pools, pool).workers for pool in [*REQUIRED_POOLS, "rank", "agent"]
            if getattr(recipe.pools, pool) is not None}
    side = side_learner_names(recipe) if learners else []
    if side:
        want[LEARN] = len(side)
    deadline = time.monotonic() + recipe.cluster.startup_timeout
    while True:
        have = pool_workers(client)
        short = {p: len(have.get(p, {})) for p, n in want.items() if len(have.get(p, {})) < n}
        if not short:
            return
        if stopping():
            raise KeyboardInterrupt
        if time.monotonic() > deadline:
            counts = ", ".join(f"{'learner workers (learner-<name>)' if p == LEARN else p} {n} of {want[p]}"
                               for p, n in short.items())
            raise UserError(f"cluster.startup_timeout: after {recipe.cluster.startup_timeout:g}s the pools still "
                            f"lack workers ({counts}){why}")
        time.sleep(0.2)


def pool_workers(client: Client) -> dict[str, dict[str, str]]:
    """``{pool: {worker name: address}}`` from the resources each worker offers."""
    pools: dict[str, dict[str, str]] = {p: {} for p in REQUIRED_POOLS}
    for addr, info in workers(client).items():
        for res in info.get("resources", {}):
            if not res.startswith(PIN):
                pools.setdefault(res, {})[str(info.get("name", addr))] = addr
    return pools


def worker_pins(client: Client) -> dict[str, dict]:
    """``{worker name: submit() keywords that run a task on that worker}``: its ``worker:<name>``
    resource when it offers one (the embedded cluster's workers do), else its name."""
    out = {}
    for addr, info in workers(client).items():
        name = str(info.get("name", addr))
        if PIN + name in info.get("resources", {}):
            out[name] = {"resources": {PIN + name: 1}}
        else:  # an external worker started without it: pinned by name (not restart-proof)
            out[name] = {"workers": [name], "allow_other_workers": False}
    return out


def with_resources(pin: dict, **resources: int) -> dict:
    """``pin`` with more resources required (e.g. ``train=1``)."""
    return {**pin, "resources": {**pin.get("resources", {}), **resources}}


def check_pools(client: Client, recipe: Recipe | None = None) -> dict[str, dict[str, str]]:
    """Every pool the run uses must have a worker, or its tasks would wait forever; the message
    says how to start one (with the pool's threads when ``recipe`` is given)."""
    pools = pool_workers(client)
    address = client.scheduler.address
    for pool, what in REQUIRED_POOLS.items():
        if not pools.get(pool):
            cfg = getattr(recipe.pools, pool) if recipe is not None else None
            n = cfg.threads if cfg is not None else 1
            raise UserError(
                f"pools.{pool}: no worker of cluster {address} offers resource {pool!r} (this pool {what}); "
                f"start one with: dask worker {address} --name {pool}-0 --nthreads {n} --resources \"{pool}={n}\"")
    return pools
