"""Pools as Dask worker resources: the embedded local cluster, one from a factory, or an existing one.

A pool is a label on workers: a worker of pool ``generate`` offers the resource ``generate``
(one unit per task slot) and is named ``generate-<i>``. Tasks ask for the resource, so the
scheduler sends them only there. The embedded cluster is a ``SpecCluster`` of ``Nanny`` worker
processes bound to ``cluster.host`` (127.0.0.1 by default: nothing listens outside the machine).
``cluster.factory`` names a callable that returns a cluster (``dask_jobqueue.SLURMCluster``,
``distributed.LocalCluster``, your own); ``streamrl/factories.py`` labels its workers.
``cluster.address`` connects to a cluster someone started (``dask scheduler`` and, per worker,
``dask worker tcp://SCHED:8786 --name generate-0 --nthreads 16 --resources "generate=16"``);
streamrl leaves that one running and takes the run's state off it when the run ends
(``docs/deploy.md``).
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import time
import warnings
from pathlib import Path

import dask
from distributed import Client, Scheduler, SchedulerPlugin, SpecCluster, Variable, WorkerPlugin
from distributed.deploy import Cluster

from streamrl.errors import UserError
from streamrl.pool_workers import PIN, PIN_SLOTS, PRE_SPAWN_ENV, worker_spec
from streamrl.recipe import REQUIRED_POOLS, Recipe

class QuickExit(WorkerPlugin):
    """After a clean close, end the worker process without the interpreter's slow finalization.

    A worker that imported torch and transformers spends seconds in C-level teardown after its
    last line of Python (measured: >2.5 s under load, past the Nanny's 4 s grace period), so
    the Nanny kills it and warns "Worker process still alive after 4.0 seconds, killing" at the
    end of every run. Once the worker has closed cleanly there is nothing left to finalize: an
    ``atexit`` hook registered last runs first, flushes, and calls ``os._exit(0)``. A worker
    that dies any other way (an error, a kill) exits normally, with its own exit code.
    """

    name = "streamrl-quick-exit"

    def setup(self, worker) -> None:
        import atexit

        self.closed = False
        atexit.register(self._exit)

    def teardown(self, worker) -> None:
        self.closed = True

    def _exit(self) -> None:
        if self.closed:
            import sys

            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


class QuietTaskErrors(WorkerPlugin):
    """A failed task is reported once, by the ``streamrl`` process, in one line or with its
    traceback; the worker's own "Compute Failed" log of the same error (a second traceback in
    the user's terminal) is kept out unless ``--verbose``. So is the traceback of a fetch from
    a worker that died ("Worker stream died during communication"): Dask recovers on its own
    (another holder, or the task again), and a loss that ends the run is streamrl's one line."""

    name = "streamrl-quiet-task-errors"

    def setup(self, worker) -> None:
        logging.getLogger("distributed.worker").addFilter(_drop_compute_failed)
        logging.getLogger("distributed.worker").addFilter(_drop_lost_peer_fetch)


class QuietShutdown(WorkerPlugin):
    """A worker whose own connections are closing (the run is over, or it failed and is being
    shut down) may have a heartbeat in flight; it fails with "ConnectionPool closing" and the
    worker logs it with a traceback in the user's terminal, under the run's real error. Only
    that record is dropped: a heartbeat failing while the worker runs is still logged."""

    name = "streamrl-quiet-shutdown"

    def setup(self, worker) -> None:
        from distributed.core import Status

        def keep(record: logging.LogRecord) -> bool:
            if not str(record.msg).startswith("Failed to communicate with scheduler during heartbeat"):
                return True
            exc = record.exc_info[1] if record.exc_info else None
            return worker.status == Status.running and "ConnectionPool closing" not in str(exc)

        logging.getLogger("distributed.worker").addFilter(keep)

        def keep_cancelled(record: logging.LogRecord) -> bool:
            # a task cancelled because the worker is closing (the run stopped) is no news
            return worker.status == Status.running or not (
                str(record.msg).startswith("Async instruction for") and "CancelledError" in record.getMessage())

        logging.getLogger("distributed.worker.state_machine").addFilter(keep_cancelled)


def quiet_train_losses(train: dict[str, str]) -> None:
    """In the ``streamrl`` process (unless ``--verbose``): Dask's own lines about a lost worker
    of the train pool (``train``: ``{name: address}``) are left out -- the scheduler's failed
    broadcast to it and the tasks it held, its nanny restarting it. A lost rank ends the run,
    and streamrl says so in one line naming the rank and the resume command; Dask's lines above
    it only told the same story in its own words. A lost generate worker is still reported."""
    addresses = tuple(train.values())
    names = set(train)

    def keep(record: logging.LogRecord) -> bool:
        text = str(record.msg)
        if text.startswith(("Removing worker", "broadcast to")):
            return not any(a in record.getMessage() for a in addresses)
        if text.startswith("Restarting worker"):
            return _logging_nanny() not in names
        return True

    logging.getLogger("distributed.scheduler").addFilter(keep)
    logging.getLogger("distributed.nanny").addFilter(keep)


def _logging_nanny() -> str | None:
    """The name of the nanny whose method is logging now (its record names no worker), found
    up the calling frames; None if there is none."""
    import sys

    from distributed import Nanny

    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Nanny):
            return str(owner.name)
        frame = frame.f_back
    return None


#: What a nanny logs (with a traceback) when the worker process it is starting is stopped.
CUT_SHORT = ("Failed to start process", "Failed to restart worker after its process exited",
             "Nanny failed to start process")


def _drop_cut_short_restart(record: logging.LogRecord) -> bool:
    """Logging filter, set while streamrl stops its cluster: False for a nanny's record of a
    worker start cut short (:data:`CUT_SHORT`); everything else stays."""
    return not str(record.msg).startswith(CUT_SHORT)


def _drop_lost_peer_fetch(record: logging.LogRecord) -> bool:
    """Logging filter: False for a worker's "Worker stream died during communication" record
    (a fetch from a peer that died; Dask handles it); everything else the worker logs stays."""
    return not str(record.msg).startswith("Worker stream died during communication")


def _drop_compute_failed(record: logging.LogRecord) -> bool:
    """Logging filter: False for the worker's "Compute Failed" record (the error reaches the
    client anyway); everything else the worker logs stays."""
    return not str(record.msg).startswith("Compute Failed")


def quiet_dask(verbose: bool) -> int:
    """Dask logs at INFO by default; keep the user's terminal for streamrl unless ``--verbose``."""
    level = logging.INFO if verbose else logging.WARNING
    for name in ("distributed", "distributed.scheduler", "distributed.nanny", "distributed.worker",
                 "distributed.core", "distributed.http.proxy", "bokeh"):
        logging.getLogger(name).setLevel(level)
    # bokeh warns that its dashboard allows any Host header; the dashboard binds to
    # cluster.host (loopback by default), and streamrl refuses foreign Host headers in front of
    # it (telemetry/dashboard_app.guard_host), so the warning is noise for the user
    logging.getLogger("bokeh.server.util").setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return level


def start(recipe: Recipe, verbose: bool = False) -> tuple[Cluster | None, Client]:
    """Start the run's cluster (the embedded one, or ``cluster.factory``'s) or connect to
    ``cluster.address``; wait for every pool and check that its workers can load what the recipe
    runs there. Returns the cluster streamrl started (None for one it did not) and a client."""
    level = quiet_dask(verbose)
    c = recipe.cluster
    # glibc's malloc settings for every worker a Nanny in this process spawns (see PRE_SPAWN_ENV)
    dask.config.set({f"distributed.nanny.pre-spawn-environ.{k}": v for k, v in PRE_SPAWN_ENV.items()})
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
            from streamrl import factories  # imports the factory's library only now

            if recipe.pools.generate is not None and recipe.pools.generate.elastic is not None:
                raise UserError("pools.generate.elastic: grows the embedded cluster only; with cluster.factory, "
                                "set pools.generate.workers instead")
            cluster = factories.create(recipe)
            labelled = factories.labellable(cluster)
            if labelled:
                factories.label(cluster, recipe)
            client = Client(cluster)
            wait_for_pools(client, recipe, "" if labelled else
                           f" (cluster.factory {c.factory}: streamrl cannot label this cluster's workers, so they "
                           "must offer the pools' resources themselves; see docs/deploy.md)")
        else:
            host = c.host
            cluster = SpecCluster(
                workers=worker_spec(recipe, level),
                scheduler={"cls": Scheduler, "options": {
                    "host": host, "dashboard_address": f"{host}:{c.dashboard_port}"}},
                silence_logs=level, name="streamrl",
            )
            client = Client(cluster)
            try:
                client.wait_for_workers(len(cluster.worker_spec), timeout=c.startup_timeout)
            except TimeoutError:
                raise UserError(f"cluster.startup_timeout: workers did not start within "
                                f"{c.startup_timeout}s") from None
        check_pools(client, recipe)
        keep_replicas(client)
        if c.address or c.factory:
            # workers that may run elsewhere, from another environment: before anything of the
            # run is sent there, each must load what its pool will build
            check_worker_imports(client, recipe)
            name_pins(client)
        if cluster is not None:  # only on workers we started ourselves
            client.register_plugin(QuickExit())
            client.register_plugin(QuietShutdown())
            if not verbose:
                client.register_plugin(QuietTaskErrors())
    except BaseException:
        # a cluster streamrl started must not outlive the failure (SLURM jobs would keep running)
        if client is not None or cluster is not None:
            try:
                stop(cluster, client)
            except Exception:  # the start's own error is the one to report
                pass
        raise
    return cluster, client


EXPECTED_SCHEDULER = ("expected the address of a Dask scheduler (`dask scheduler` listens on tcp://HOST:8786; "
                      "8787 is its dashboard, a web page)")

#: The most a Dask scheduler's first message (its handshake, a few hundred bytes) can say it
#: holds; more is what the first bytes of another protocol (a banner, a greeting) read as.
HANDSHAKE_MAX_BYTES = 1 << 20


def check_scheduler_address(address: str, timeout: float) -> None:
    """Raise :class:`UserError` (one line naming ``cluster.address``) unless ``address`` can be
    a Dask scheduler, within ``timeout`` seconds.

    Dask's own client, pointed at another service, fails in ways that say nothing of the
    address: a web server waits for a request line that never comes and the client waits with
    it (past its own timeout); a service that speaks first (an SSH or SMTP banner) has its
    greeting read as a message length (a MemoryError for exabytes); a scheme whose backend is
    not installed (``ucx://`` without distributed-ucxx) is a TypeError. So before the client,
    with a deadline of our own: the scheme must have a working Dask backend, and on ``tcp://``
    the service must send what a Dask scheduler sends first -- its handshake, an 8-byte length
    and then that many bytes -- as soon as a connection is accepted."""
    import socket
    import struct

    from distributed.comm.addressing import parse_address, parse_host_port
    from distributed.comm.registry import get_backend

    try:
        scheme, location = parse_address(address)
        get_backend(scheme).get_connector()
    except Exception as exc:
        raise UserError(f"cluster.address: Dask cannot connect to {address} from here ({type(exc).__name__}: "
                        f"{exc}); expected tcp://HOST:PORT or tls://HOST:PORT (ucx:// needs the distributed-ucxx "
                        "package, where streamrl runs and on the cluster)") from None
    if scheme != "tcp":  # (tls: the server waits for our TLS hello; Dask's client checks the rest)
        return
    host, port = parse_host_port(location)
    deadline = time.monotonic() + timeout

    def read(sock: socket.socket, n: int) -> bytes:
        out = b""
        while len(out) < n:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            chunk = sock.recv(n - len(out))
            if not chunk:
                break
            out += chunk
        return out

    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise UserError(f"cluster.address: cannot reach scheduler {address} ({exc})") from None
    with sock:
        try:
            head = read(sock, 8)
            if len(head) < 8:
                raise UserError(f"cluster.address: {address} accepted the connection and closed it without a "
                                f"word; {EXPECTED_SCHEDULER}")
            (size,) = struct.unpack("<Q", head)
            if size > HANDSHAKE_MAX_BYTES:
                sock.settimeout(0.2)  # what else it said, to name the service (best effort)
                try:
                    head += sock.recv(120)
                except OSError:
                    pass
                said = head.decode("utf-8", "replace").splitlines()[0].strip()[:80] or repr(head[:40])
                raise UserError(f"cluster.address: {address} is not a Dask scheduler: it sent {said!r}; "
                                f"{EXPECTED_SCHEDULER}")
            if len(read(sock, size)) < size:
                raise UserError(f"cluster.address: {address} stopped in the middle of its first message; "
                                f"{EXPECTED_SCHEDULER}")
        except TimeoutError:
            raise UserError(f"cluster.address: {address} accepted the connection but sent nothing within "
                            f"{timeout:g}s (cluster.connect_timeout), as a web server or another service "
                            f"waiting for its own protocol does; {EXPECTED_SCHEDULER}") from None
        except OSError as exc:
            raise UserError(f"cluster.address: {address} broke the connection ({exc}); {EXPECTED_SCHEDULER}") from None


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
    logging.getLogger("distributed.nanny").addFilter(_drop_cut_short_restart)
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
    cluster.close()


def wait_for_pools(client: Client, recipe: Recipe, why: str = "") -> None:
    """Wait up to ``cluster.startup_timeout`` until every pool has the workers its
    ``[pools.<name>] workers`` asks for (a factory's workers come up in their own time: a
    batch job waits in its queue); ``why`` ends the timeout's message."""
    want = {pool: getattr(recipe.pools, pool).workers for pool in [*REQUIRED_POOLS, "rank"]
            if getattr(recipe.pools, pool) is not None}
    deadline = time.monotonic() + recipe.cluster.startup_timeout
    while True:
        have = pool_workers(client)
        short = {p: len(have.get(p, {})) for p, n in want.items() if len(have.get(p, {})) < n}
        if not short:
            return
        if time.monotonic() > deadline:
            counts = ", ".join(f"{p} {n} of {want[p]}" for p, n in short.items())
            raise UserError(f"cluster.startup_timeout: after {recipe.cluster.startup_timeout:g}s the pools still "
                            f"lack workers ({counts}){why}")
        time.sleep(0.2)


#: A Dask ``Variable`` on the scheduler naming the client of the streamrl run that uses a cluster
#: streamrl did not start (:func:`claim`).
OWNER = "streamrl-run"


def claim(client: Client, recipe: Recipe) -> None:
    """Make this run the one streamrl run on a cluster it did not start, after taking off what an
    earlier run left there (:func:`release`).

    Two runs on one cluster would replace each other's engines and trainer (worker plugins of
    one name) and share task keys; a run that ended without :func:`stop` (killed) leaves its
    engines in the workers' memory and its last weights on the scheduler, under keys the next
    run asks for again -- which Dask answers with the *old* result. So: another live run is a
    one-line error; a dead one's leftovers are removed.
    """
    try:
        owner = Variable(OWNER, client=client).get(timeout=0)
    except TimeoutError:  # (no run has claimed it, or the last one released it)
        owner = None

    def client_ids(dask_scheduler) -> list[str]:  # (nested: sent by value, see release())
        return list(dask_scheduler.clients)

    if owner and owner.get("client") in client.run_on_scheduler(client_ids):
        raise UserError(f"cluster.address: streamrl run {owner.get('run')!r} (started {owner.get('since')}) is still "
                        f"using the cluster at {client.scheduler.address}; one run at a time per cluster")
    release(client)
    Variable(OWNER, client=client).set({"client": client.id, "run": recipe.run.name,
                                        "since": time.strftime("%Y-%m-%d %H:%M:%S")})


def release(client: Client) -> None:
    """Take every trace of streamrl runs off a cluster that stays up: the worker and scheduler
    plugins named ``streamrl-*`` (their teardown closes the engines and trainers, freeing their
    memory) and the ``streamrl-*`` variables (the published weights, which hold their tasks'
    results under keys a later run uses again). Best effort: it never raises."""

    def state(dask_scheduler) -> dict[str, list[str]]:
        # Nested, so Dask sends it by value: a scheduler started by hand need not have streamrl
        variables = getattr(dask_scheduler.extensions.get("variables"), "variables", {})
        return {kind: [n for n in names if str(n).startswith("streamrl-")] for kind, names in
                (("worker_plugins", dask_scheduler.worker_plugins), ("scheduler_plugins", dask_scheduler.plugins),
                 ("variables", variables))}

    try:
        names = client.run_on_scheduler(state)
    except Exception:  # a scheduler that is gone holds nothing
        return
    for name in names["worker_plugins"]:
        try:
            client.unregister_worker_plugin(name)
        except Exception:
            pass
    for name in names["scheduler_plugins"]:
        try:
            client.unregister_scheduler_plugin(name)
        except Exception:
            pass
    for name in names["variables"]:
        try:
            Variable(name, client=client).delete()
        except Exception:
            pass


#: Which component kinds each pool builds (:func:`check_worker_imports`): a generate worker its
#: engine and the receiving end of the transfer, a train worker the trainer, its algorithm and
#: the sending end; a reward worker the reward, a rank worker the ranker.
BUILT_ON = {"generate": ("engine", "transfer"), "train": ("trainer", "algorithm", "transfer"),
            "reward": ("reward",), "rank": ("ranker",)}


def check_worker_imports(client: Client, recipe: Recipe) -> None:
    """Every worker must be able to load the components its pool will build: each is sent to
    the pool's workers pickled, as the run sends it, and unpickled there now. A package missing
    on a worker (a plugin installed only where ``streamrl`` runs, or streamrl itself) is one
    line naming the worker, the module and the component, instead of a failure mid-run."""
    components = _recipe_components(recipe)
    for pool, names in pool_workers(client).items():
        for kind in BUILT_ON.get(pool, ()):
            for comp, origin in components.get(kind, []):
                blob = _pickled(comp)
                if blob is None:
                    continue
                results = client.run(pickle.loads, blob, workers=list(names.values()), on_error="return")
                by_addr = {addr: name for name, addr in names.items()}
                for addr, result in results.items():
                    if isinstance(result, BaseException):
                        missing = getattr(result, "name", None) if isinstance(result, ImportError) else None
                        what = (f"cannot import {missing!r}" if missing else
                                f"cannot load it ({type(result).__name__}: {result})")
                        raise UserError(f"pools.{pool}: worker {by_addr.get(addr, addr)} {what}, which {kind} "
                                        f"{comp.name!r} needs ({origin}); install it in that worker's Python "
                                        "environment")


def _recipe_components(recipe: Recipe) -> dict[str, list]:
    """``{kind: [(component, where it comes from)]}`` of the components the recipe names."""
    from streamrl.plugins import Registry, build_registry
    from streamrl.recipe import SECTIONS

    with warnings.catch_warnings():  # (a broken plugin was reported when the recipe was resolved)
        warnings.simplefilter("ignore")
        registry = build_registry()
        # recipe-local modules: the ones resolve() imported (importing them again would run their
        # code twice); their code travels by value, but what they import does not
        for path in recipe.plugins.modules:
            module = sys.modules.get(f"streamrl_local_{Path(path).stem}")
            if module is not None and registry.pm.get_plugin(f"local:{path}") is None:
                registry.pm.register(module, name=f"local:{path}")
                registry.origins[f"local:{path}"] = (path, "")
        registry = Registry(registry.pm, registry.origins)
    out: dict[str, list] = {}
    tables = dict(recipe)
    for section, kind in SECTIONS.items():
        table = tables.get(section)
        for comp in registry.components[kind].get(table.name, []) if table is not None else []:
            dist, version = registry.origins.get(comp.plugin, (comp.plugin, ""))
            out.setdefault(kind, []).append((comp, f"plugin {comp.plugin}, from {dist} {version}".rstrip()))
    return out


def _pickled(comp) -> bytes | None:
    """A component's factory and config class pickled as the run pickles them (cloudpickle, so a
    recipe-local module travels by value); None if it cannot be pickled here at all (the run
    then fails on it with its own message)."""
    import cloudpickle

    try:
        return cloudpickle.dumps((comp.factory, comp.config))
    except Exception:
        return None


class NamePins(WorkerPlugin):
    """Worker side of :func:`name_pins`: the worker's own ``worker:<name>`` resource in its
    state (the scheduler side adds it to the scheduler's view, :class:`NamePinsOnScheduler`)."""

    name = "streamrl-name-pins"

    def setup(self, worker) -> None:
        key = PIN + str(worker.name)
        if key not in worker.state.total_resources:
            worker.state.total_resources[key] = PIN_SLOTS
            worker.state.available_resources[key] = PIN_SLOTS


class NamePinsOnScheduler(SchedulerPlugin):
    """Scheduler side of :func:`name_pins`. ``add_worker`` runs before the scheduler hands a
    newly registered worker the tasks that waited for it, so a worker its nanny restarted gets
    back the work pinned to it; the worker side is in place before the worker reads them (it
    sets up its plugins before it listens to the scheduler)."""

    name = "streamrl-name-pins"

    async def start(self, scheduler) -> None:
        for ws in list(scheduler.workers.values()):
            self._pin(scheduler, ws)

    def add_worker(self, scheduler, worker: str) -> None:
        ws = scheduler.workers.get(worker)
        if ws is not None:
            self._pin(scheduler, ws)

    @staticmethod
    def _pin(scheduler, ws) -> None:
        key = PIN + str(ws.name)
        if key not in ws.resources:
            # Scheduler.add_resources would also zero the worker's used resources; add only this one
            ws.resources[key] = PIN_SLOTS
            ws.used_resources[key] = 0
            scheduler.resources.setdefault(key, {})[ws.address] = PIN_SLOTS


def name_pins(client: Client) -> None:
    """Give every worker of a cluster streamrl did not label a ``worker:<name>`` resource
    (:data:`PIN`), now and whenever it (re)connects: work pinned to a worker then follows it
    through a restart, even if it was started with only its pool's resource. Without it, a
    generate worker killed and restarted by its nanny left the run waiting on a weight load
    pinned to its old address (measured: a hand-started cluster, the run timed out after 600 s).
    Needs streamrl on the scheduler; without it, a worker that lacks the resource is one line."""
    try:
        client.register_plugin(NamePinsOnScheduler())
    except Exception as exc:
        lacking = [str(w.get("name")) for w in workers(client).values()
                   if PIN + str(w.get("name")) not in w.get("resources", {})]
        if lacking:
            raise UserError(f"cluster.address: workers {', '.join(lacking)} offer no 'worker:<name>' resource and the "
                            f"scheduler cannot add it ({type(exc).__name__}: {exc}); start each with --resources "
                            f"\"<pool>=<threads> worker:<name>=1000000\"") from None
        return
    client.register_plugin(NamePins())




def workers(client: Client) -> dict[str, dict]:
    """``{address: info}`` of every worker, fetched now. Not ``client.scheduler_info()``: the
    client refreshes that cache every few seconds *without* per-worker details, and a refresh that
    lands between its fetch and its return hands back no workers at all (seen in CI)."""
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]


def pool_workers(client: Client) -> dict[str, dict[str, str]]:
    """``{pool: {worker name: address}}`` from the resources each worker offers."""
    pools: dict[str, dict[str, str]] = {p: {} for p in REQUIRED_POOLS}
    for addr, info in workers(client).items():
        for res in info.get("resources", {}):
            if not res.startswith(PIN):
                pools.setdefault(res, {})[str(info.get("name", addr))] = addr
    return pools


def pins(client: Client) -> dict[str, dict]:
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


def at(pin: dict, **resources: int) -> dict:
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
