"""The endpoint's life on its generate worker: the Dask tasks that start it, take its rewarded
traffic for a training step, read its counters and stop it.

The HTTP server (uvicorn, in a thread of the worker process) shares the process with the
engine, so each decode step's tokens reach the client without leaving the process; the learners
get the finished, rewarded requests through :func:`take`, a task the controller submits to this
worker like any other.
"""

from __future__ import annotations

import threading
import time

from distributed import get_worker, rejoin, secede

from streamrl.on_worker.resident import ENGINE, ResidentLost, resident
from streamrl.sample import Group
from streamrl.rewards.scoring import REWARD_LIMIT
from streamrl.recipe.serve import ServeConfig
from streamrl.serve.http_server import start_in_thread
from streamrl.serve.kept_groups import as_json, from_json
from streamrl.serve.traffic import Traffic

# the one endpoint of this worker process: (uvicorn server, its thread, the traffic store)
_RUNNING: dict[str, tuple] = {}


def ship(tool_parser) -> bytes | None:
    """The built tool parser, pickled by value for :func:`start`: a parser whose class lives in a
    recipe-local file (``[plugins] modules``) cannot be imported on the worker by name."""
    import cloudpickle

    return cloudpickle.dumps(tool_parser) if tool_parser is not None else None


def start(config: dict, model_name: str, tool_parser: bytes | None = None, rollout_key: str = "",
          ready: bool = True, reward_limit: float = REWARD_LIMIT, min_version: int = 0) -> str:
    """Generate worker: serve the engine at ``serve.host:serve.port``; returns the base URL.
    ``tool_parser``: the built ``serve.tool_parser`` (:func:`ship`); ``rollout_key``: the secret
    the run's agent rollouts send (empty: no agent calls are taken); ``ready`` False: the API
    answers 503 until :func:`go_live` (the run adds the models it will list first);
    ``reward_limit``: the run's ``reward.limit``, past which feedback is refused; ``min_version``:
    the policy every engine of the run holds by now (a worker its nanny restarted holds the base
    weights: it loads the newest published ones first, so it never answers with an older
    policy). Raises naming
    the setting when the engine cannot stream (not the slot decoder) or the port cannot be bound."""
    from streamrl.serve.openai_api import Endpoint
    from streamrl.serve.routes import make_app

    stop()  # a run that starts over on this worker serves anew
    cfg = ServeConfig.model_validate(config)
    if isinstance(tool_parser, bytes):
        import cloudpickle

        try:
            tool_parser = cloudpickle.loads(tool_parser)
        except Exception as e:  # noqa: BLE001 -- its module, or one it imports, is missing here
            raise ValueError(f"serve.tool_parser: the parser cannot be loaded on worker {get_worker().name} "
                             f"({type(e).__name__}: {e}); install its package on every generate worker") from None
    engine = resident(ENGINE)
    if getattr(engine, "version", min_version) < min_version:
        from streamrl.on_worker.weight_tasks import catch_up

        catch_up(engine, min_version)
    if not hasattr(engine, "stream"):
        raise ValueError('streamrl serve needs engine.batching = "slots" (the engine that streams each decode '
                         f"step's tokens); this engine is {type(engine).__name__}")
    traffic = Traffic(cfg.feedback_timeout_s)
    api = Endpoint(engine, cfg, traffic, model_name, tool_parser, rollout_key=rollout_key, reward_limit=reward_limit)
    api.worker = str(get_worker().name)
    api.ready = ready
    app = make_app(api)
    started = start_in_thread(app, cfg.host, cfg.port, "streamrl-serve")
    if started is None:
        raise ValueError(f"serve: could not listen on {cfg.host}:{cfg.port} (serve.host, serve.port: the port may be "
                         "in use)")
    server, thread, port = started
    _RUNNING["endpoint"] = (server, thread, traffic, api)
    return f"http://{cfg.host}:{port}/v1"


def take(step: int, min_samples: int, min_version: int, wait_s: float, after=None) -> list[Group]:
    """Generate worker: step ``step``'s at least ``min_samples`` rewarded served samples (whole
    requests), none older than policy ``min_version``, waiting up to ``wait_s`` seconds (none
    when the endpoint stops first); steps asked ahead are served in step order (``after``: the
    previous step's take, which Dask runs first)."""
    traffic = _traffic()
    # out of the worker's thread pool while it waits (up to a day): the tasks that must reach
    # this worker meanwhile -- the stop's release, a checkpoint's untrained traffic, weight
    # loads, the stats -- would otherwise queue behind it on a worker of one thread
    secede()
    try:
        groups = traffic.take(step, min_samples, min_version, wait_s)
    finally:
        rejoin()
    name = str(get_worker().name)
    for s in (s for g in groups for s in g):
        s.worker = s.worker or name  # (a learner's policy made it on that learner's worker)
        s.times["submitted"] = s.times.get("gen_start", 0.0)
    return groups


def go_live() -> list[str]:
    """Generate worker: every model the run serves from the start is in place: the API answers
    (it said 503 until now); returns the models it lists."""
    api = _api()
    api.ready = True
    return list(api.engines)


#: Held while the table of served models changes: the run's step loop (variants) and its watcher
#: of the generate workers (replicas) change it from two threads, each from what it read; one
#: change made on a table another had just replaced would bring back what that one took out.
_CHANGING = threading.Lock()


def add_replica(url: str, key: str, worker: str) -> int:
    """Generate worker (the endpoint's): another generate worker's engine, behind its token
    server at ``url``, answers the served policy's requests too; returns how many engines do.
    A worker served already (restarted since, with a new token server) is served from ``url``
    from now on: its old server's requests in flight fail, and the LoRA variants no longer
    decode there (its restarted engine holds none of their adapters)."""
    from streamrl.serve.remote_engines import RemoteEngine

    api = _api()
    with _CHANGING:
        engines = _drop_replica(api, worker)
        engines.append(RemoteEngine(api.engine, url, key, worker))
        return len(engines)


def failing_replicas(within_s: float) -> list[str]:
    """Generate worker (the endpoint's): the workers whose token server a request failed to
    reach in the last ``within_s`` seconds."""
    from streamrl.serve.remote_engines import RemoteEngine

    api = _api()
    now = time.time()
    return sorted({e.worker for e in api.engines[api.model_name]
                   if isinstance(e, RemoteEngine) and now - e.failed_at < within_s})


def remove_replica(worker: str) -> int:
    """Generate worker (the endpoint's): generate worker ``worker`` is leaving the pool (an
    elastic pool retires it once it runs nothing); its engine takes no more requests, and those
    running there end as they would have. Returns how many engines still answer."""
    with _CHANGING:
        return len(_drop_replica(_api(), worker, drain=True))


def _drop_replica(api, worker: str, drain: bool = False) -> list:
    """Take ``worker``'s engine out of every model's engines (the served policy's and the LoRA
    variants' decoding there); returns the served policy's list of engines. Its requests in
    flight fail, or with ``drain`` run to their end first. (Under :data:`_CHANGING`.)"""
    from streamrl.serve.adapter_routes import OnAdapter
    from streamrl.serve.remote_engines import RemoteEngine

    engines = api.engines[api.model_name]
    old = [e for e in engines if isinstance(e, RemoteEngine) and e.worker == worker]
    if not old:
        return engines
    # (in place: the aliases share this list; one slice assignment, so a request picking an
    # engine on the event loop sees the list before or after, never half of it)
    engines[:] = [e for e in engines if e not in old]
    api.engines = {model: held if held is engines else [e for e in held if not (isinstance(e, OnAdapter)
                                                                                   and e.engine in old)]
                   for model, held in api.engines.items()}
    for engine in old:
        if drain:
            engine.retire()
        else:
            engine.close()
    return engines


def add_variant(model: str, url: str, key: str, learner: str, worker: str) -> list[str]:
    """Generate worker: requests naming ``model`` are answered from then on by learner
    ``learner``'s token server at ``url`` on worker ``worker`` (``serve/remote_engines.py``);
    returns the models served. ``model`` already served: it moves to the new server."""
    from streamrl.serve.remote_engines import RemoteEngine

    api = _api()
    remote = RemoteEngine(api.engine, url, key, worker, what=f"learner {learner!r}")
    with _CHANGING:
        old = api.engines.get(model, [])
        api.engines = {**api.engines, model: [remote]}  # (a new dict: a request looking one up sees either)
    for engine in old:
        if isinstance(engine, RemoteEngine):
            engine.close()
    return list(api.engines)


def add_adapter_variant(model: str, learner: str) -> list[str]:
    """Generate worker: requests naming ``model`` are answered from then on by the served
    policy's engines (this worker's and the replicas') with learner ``learner``'s LoRA adapter,
    which the run loads into each of them (``serve/adapter_routes.py``); returns the models served."""
    from streamrl.serve.adapter_routes import OnAdapter
    from streamrl.serve.remote_engines import RemoteEngine

    api = _api()
    with _CHANGING:
        old = api.engines.get(model, [])
        api.engines = {**api.engines, model: [OnAdapter(e, learner) for e in api.engines[api.model_name]]}
    for engine in old:
        if isinstance(engine, RemoteEngine):
            engine.close()
    return list(api.engines)


def alias(model: str) -> list[str]:
    """Generate worker: requests naming ``model`` are answered by the served policy too."""
    api = _api()
    with _CHANGING:
        api.engines = {**api.engines, model: api.engines[api.model_name]}
        return list(api.engines)


def remove_variant(model: str) -> list[str]:
    """Generate worker: stop serving ``model`` (its requests in flight end with what they have);
    returns the models served."""
    from streamrl.serve.remote_engines import RemoteEngine

    api = _api()
    with _CHANGING:
        engines = dict(api.engines)
        old = engines.pop(model, [])
        api.engines = engines
    for engine in old:
        if isinstance(engine, RemoteEngine):
            engine.close()
    return list(api.engines)


def stats(trained: int | None = None) -> dict[str, int]:
    """Generate worker: the endpoint's counters (``Traffic.snapshot``). ``trained``: the step
    just trained (its record asks), whose taken groups a checkpoint need not keep any more."""
    traffic = _traffic()
    if trained is not None:
        traffic.settled(trained)
    return traffic.snapshot()


def untrained(next_step: int, final: bool = False) -> tuple[list[list[dict]], dict[str, int]]:
    """Generate worker: for a checkpoint before step ``next_step``, the rewarded groups no step
    trained yet (as JSON-ready dicts) and the counts of what it cannot keep
    (``Traffic.untrained``; ``final``: the run ends after it, feedback is refused from now on)."""
    groups, lost = _traffic().untrained(next_step, final)
    return as_json(groups), lost


def restore(groups: list[list[dict]]) -> int:
    """Generate worker: the groups a checkpoint kept (:func:`untrained`) are ready for the
    resumed run's first steps; returns how many samples."""
    kept = from_json(groups)
    _traffic().restore(kept)
    return sum(len(g) for g in kept)


def release() -> bool:
    """Generate worker: the run is stopping: every waiting :func:`take` returns what is ready
    (the endpoint goes on answering until :func:`stop`)."""
    running = _RUNNING.get("endpoint")
    if running is not None:
        running[2].stop()
    return running is not None


def stop() -> bool:
    """Generate worker: stop the endpoint if one runs here (a waiting :func:`take` returns)."""
    running = _RUNNING.pop("endpoint", None)
    if running is None:
        return False
    server, thread, traffic, api = running
    traffic.stop()
    server.should_exit = True
    thread.join(timeout=5)
    api.tokenizing.shutdown(wait=False)  # (its thread ends once a prompt in hand is done)
    return True


def _running() -> tuple:
    running = _RUNNING.get("endpoint")
    if running is None:
        # the process that served it is gone (its worker died and came back): so are its
        # connections and the rewarded traffic not yet trained on -- the run stops here, in one
        # line that names its last checkpoint (run/runner.py), as for a lost trainer
        raise ResidentLost(f"the endpoint's worker {get_worker().name} was restarted: the endpoint, its clients' "
                           "connections and the rewarded traffic not yet trained on are gone")
    return running


def _api():
    return _running()[3]


def _traffic() -> Traffic:
    return _running()[2]
