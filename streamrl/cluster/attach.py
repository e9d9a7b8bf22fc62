"""A cluster streamrl did not start (``cluster.address``) or did not label (``cluster.factory``):
check that the address is a Dask scheduler before Dask's client tries it, make the run the
cluster's one streamrl run (:func:`claim`) and take the run's state off it at the end
(:func:`release`), check that each worker can load what its pool builds, and give every worker a
``worker:<name>`` resource so that work pinned to it follows it through a restart
(:func:`name_pins`). ``lifecycle.start`` and ``lifecycle.stop`` call these.
"""

from __future__ import annotations

import pickle
import sys
import time
import warnings
from pathlib import Path

from distributed import Client, SchedulerPlugin, Variable, WorkerPlugin

from streamrl.errors import UserError
from streamrl.cluster.pool_workers import PIN, PIN_SLOTS, workers
from streamrl.recipe.recipe import Recipe


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
    if scheme == "tls":  # (the server waits for our TLS hello; Dask's client checks the rest -- given a certificate)
        _check_tls_config(address)
    if scheme != "tcp":
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


#: A Dask ``Variable`` on the scheduler naming the client of the streamrl run that uses a cluster
#: streamrl did not start (:func:`claim`).
OWNER = "streamrl-run"


def _check_tls_config(address: str) -> None:
    """One line naming what is missing when ``tls://`` is asked for and Dask's config gives this
    process no certificate (Dask's own message blames the scheduler: "TLS expects a ssl_context")."""
    from distributed.security import Security

    try:
        context = Security().get_connection_args("client").get("ssl_context")
    except Exception as exc:  # (a certificate file named in the config that is missing or not one)
        raise UserError(f"cluster.address: {address} needs this machine's TLS certificate, and Dask's config "
                        f"names one that cannot be used ({type(exc).__name__}: {str(exc)[:200]}); expected "
                        "distributed.comm.tls.ca-file and .client.cert/.client.key to be readable PEM files") from None
    if context is None:
        raise UserError(f"cluster.address: {address} is a TLS address but Dask's config gives this process no "
                        "certificate; expected distributed.comm.tls.ca-file and distributed.comm.tls.client.cert/.key "
                        "set (~/.config/dask/*.yaml, or DASK_DISTRIBUTED__COMM__TLS__CA_FILE and its kin), or a "
                        "tcp:// address on a trusted network")


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
            "reward": ("reward",), "rank": ("ranker",), "agent": ()}


def check_worker_imports(client: Client, recipe: Recipe, pools: dict[str, dict[str, str]]) -> None:
    """Every worker must be able to load the components its pool will build (``pools``:
    ``{pool: {worker name: address}}``, ``lifecycle.pool_workers``): each is sent to the pool's
    workers pickled, as the run sends it, and unpickled there now. A package missing
    on a worker (a plugin installed only where ``streamrl`` runs, or streamrl itself) is one
    line naming the worker, the module and the component, instead of a failure mid-run."""
    components = _recipe_components(recipe)
    for pool, names in pools.items():
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
    from streamrl.plugins.registry import Registry, build_registry
    from streamrl.recipe.recipe import SECTIONS

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
