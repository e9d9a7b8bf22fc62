"""Engines on other workers behind the one endpoint: the endpoint decodes a request on an engine
in its own process, or on one of these through a token server on that engine's worker.

Two kinds of engine are reached so:

- **the generate pool's other workers** (replicas): the endpoint listens on the first generate
  worker and spreads the served policy's requests over every generate worker's engine, each
  loading every new policy as it is published;
- **a side learner's engine** (a variant, ``learners/served.py``): the learner keeps an engine
  beside its trainer (the resident its held-out evaluation uses), which takes the trainer's
  weights in the same process after each of its steps (:func:`refresh`), and answers the requests
  whose ``model`` names the learner.

A token server (:func:`start`) has one route: it decodes a prompt's tokens and streams each
decode step's tokens, log-probs and policy version back as newline-delimited JSON. The endpoint
drives it through :class:`RemoteEngine`, which has the slot engine's ``stream`` / ``cancel`` face,
so a request decoded elsewhere goes through everything any request goes through (the checks,
stop sequences, tool calls, streaming, feedback, the traffic the learners take): only where its
tokens are decoded differs. A token server listens on its worker's own address, on a free port,
and takes only requests that carry the key made for it at start, which only the endpoint knows.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from concurrent.futures import Future
from dataclasses import dataclass

from distributed import get_worker

from streamrl.engines.stop_tokens import of_engine
from streamrl.on_worker.resident import resident
from streamrl.serve.http_server import start_in_thread
from streamrl.telemetry import bubbles

#: Seconds a token server lets pass without a line: while a request waits for a slot (or between
#: slow decode steps) it sends an empty one, so the endpoint can tell a waiting replica from one
#: that went silent (its host stopped, its process frozen) without a timeout of many minutes.
HEARTBEAT_S = 5.0

#: Seconds the endpoint waits for a line before it fails the request and passes the replica over
#: for a while: a few heartbeats missed.
SILENT_S = 6 * HEARTBEAT_S

# the token servers of this worker process: engine resident name -> (uvicorn server, thread)
_SERVERS: dict[str, tuple] = {}


def variant_model(model_name: str, learner: str) -> str:
    """The ``model`` a request gives to be answered by learner ``learner``'s policy."""
    return f"{model_name}/{learner}"


# -- the engine's worker -----------------------------------------------------------------------


def refresh(engine: str, trainer: str, version: int, after=None) -> int:
    """Learner worker: the engine ``engine`` takes trainer ``trainer``'s weights when it has
    trained since the last time (``after``: the step's futures, which Dask runs first), and serves
    them as ``version``: the stream's steps this policy has trained through (the last step it
    trained, plus one), so that its tokens' versions count steps as the served policy's do and the
    staleness bound means the same for both, whatever steps the learner skipped or joined after.
    Returns the version served."""
    eng, held = resident(engine), resident(trainer)
    # (its held-out evaluation loads the trainer's weights too, numbering them the same way)
    eng.version_offset = version - held.version
    if getattr(eng, "trainer_version", None) != held.version:
        eng.load_weights(held.named_weights(), version)
        eng.trainer_version = held.version
    else:
        eng.version = version
    return eng.version


def start(engine: str, trainer: str | None = None, version: int = 0) -> tuple[str, str]:
    """The engine's worker: serve engine ``engine`` on a token server at this worker's address;
    returns its base URL and the key requests must carry. ``trainer``: a side learner's, whose
    current weights the engine takes first, as ``version`` (:func:`refresh`); None for a generate
    worker's engine, which loads each published policy itself. Raises naming the setting when
    the engine cannot stream (not the slot decoder)."""
    stop(engine)
    eng = resident(engine)
    if not hasattr(eng, "stream"):
        raise ValueError('streamrl serve needs engine.batching = "slots" (the engine that streams each '
                         f"decode step's tokens); this engine is {type(eng).__name__}")
    if trainer is not None:
        refresh(engine, trainer, version)
    # (Starlette, imported here: one route needs no more, and the run's driver imports this
    # module for the functions it submits, without serving anything)
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    key = secrets.token_hex(16)

    async def generate(request):
        if not secrets.compare_digest(request.headers.get("authorization", "").encode(), f"Bearer {key}".encode()):
            return JSONResponse({"error": "wrong key"}, status_code=401)
        body = await request.json()
        return StreamingResponse(_decode(eng, body), media_type="application/x-ndjson")

    app = Starlette(routes=[Route("/generate", generate, methods=["POST"])])

    host = get_worker().address.split("://")[-1].rsplit(":", 1)[0].strip("[]")
    netloc = f"[{host}]" if ":" in host else host  # (an IPv6 address in a URL is bracketed)
    started = start_in_thread(app, host, 0, f"streamrl-variant-{engine}")
    if started is None:
        raise RuntimeError(f"the token server of {engine} could not listen on {host}")
    server, thread, port = started
    _SERVERS[engine] = (server, thread)
    bubbles.takes_requests(True)
    return f"http://{netloc}:{port}", key


def restart(engine: str, min_version: int) -> tuple[str, str]:
    """A generate worker whose nanny restarted it: its fresh engine, at the base weights, first
    loads the newest published policy (when the run has published one: ``min_version`` > 0), so
    that it never answers with a policy older than the others'; then it serves on a new token
    server (:func:`start`). Returns its base URL and key."""
    from streamrl.on_worker.weight_tasks import catch_up

    eng = resident(engine)
    if eng.version < min_version:
        catch_up(eng, min_version)
    return start(engine)


async def _decode(eng, body: dict):
    """One request's decode steps as JSON lines: ``{"tokens", "logprobs", "version"}`` per step,
    then ``{"done": tokens}`` (or ``{"error": message}``). A client that goes away cancels it."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    rid = str(body["rid"])

    def on_tokens(tokens, logprobs, version):  # (the engine's loop thread)
        loop.call_soon_threadsafe(queue.put_nowait, {"tokens": tokens, "logprobs": logprobs, "version": version})

    def done(future):
        exc = future.exception()
        end = {"error": str(exc) or type(exc).__name__} if exc is not None else {"done": list(future.result().tokens)}
        loop.call_soon_threadsafe(queue.put_nowait, end)

    try:
        adapter = {"adapter": str(body["adapter"])} if body.get("adapter") else {}  # (a learner's LoRA variant)
        eng.stream(rid, list(body["ids"]), int(body["max_new_tokens"]), on_tokens=on_tokens,
                   greedy=bool(body.get("greedy")), **adapter).add_done_callback(done)
    except ValueError as e:
        yield json.dumps({"error": str(e)}) + "\n"
        return
    ended = False
    work = bubbles.begin_work()  # (busy, and not retired under the request, until it ends)
    try:
        while not ended:
            try:
                item = await asyncio.wait_for(queue.get(), HEARTBEAT_S)
            except TimeoutError:
                yield "\n"  # (waiting, not gone: the endpoint skips empty lines)
                continue
            ended = "done" in item or "error" in item
            yield json.dumps(item, separators=(",", ":")) + "\n"
    finally:
        bubbles.end_work(work)
        if not ended:  # the endpoint went away (its client did, or a stop sequence was found)
            eng.cancel(rid)


def serving(engine: str) -> bool:
    """The engine's worker: whether a token server of ``engine`` runs in this process (a worker
    its nanny restarted at the same address has none)."""
    return engine in _SERVERS


def stop(engine: str) -> bool:
    """Learner worker: stop the token server of ``engine`` if one runs here."""
    running = _SERVERS.pop(engine, None)
    bubbles.takes_requests(bool(_SERVERS))
    if running is None:
        return False
    server, thread = running
    server.should_exit = True
    thread.join(timeout=5)
    return True


# -- the endpoint's side -----------------------------------------------------------------------


@dataclass
class Reply:
    """What a remote request ended with (the slot engine's ``Response`` as far as the endpoint
    reads it)."""

    tokens: list[int]


class RemoteEngine:
    """An engine on another worker as the endpoint sees it: ``stream`` and ``cancel`` against its
    token server, the local engine's tokenizer and settings (every engine of a run has the same
    model and ``[engine]`` table)."""

    def __init__(self, local, url: str, key: str, worker: str, what: str = ""):
        self.config, self.tokenizer, self.encode = local.config, local.tokenizer, local.encode
        self.stop_ids = of_engine(local)
        """The tokens that end its responses (the same model's as the local engine's)."""
        self.url, self.key = url, key
        self.worker = worker
        """The worker it decodes on (its samples say they were made there)."""
        self.what = what or f"worker {worker!r}"
        """How errors name it (``learner 'b'``)."""
        self.version = local.version
        """The newest version its tokens came with."""
        self.failed_at = 0.0
        """When a request last failed to reach it (the endpoint passes it over for a while)."""
        self.closed = False
        """No longer served (:meth:`close`): requests fail at once."""
        self._tasks: dict[str, asyncio.Task] = {}
        self._client = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the endpoint's, where the client lives

    def stream(self, rid: str, ids: list[int], max_new_tokens: int, on_tokens=None, greedy: bool = False,
               prompt=None, adapter: str | None = None) -> Future:
        """Decode one request on the engine's worker (called on the endpoint's event loop):
        ``on_tokens`` gets each step's tokens as they come; the future its :class:`Reply`.
        ``adapter``: the LoRA adapter it decodes with there (a learner's variant; None: the
        served policy). (``prompt``, for a reward that stops a response early, is not sent: a
        remote engine's responses decode to their end.)"""
        future: Future = Future()
        task = asyncio.get_running_loop().create_task(
            self._run(rid, ids, max_new_tokens, greedy, on_tokens, future, adapter))
        self._tasks[rid] = task
        task.add_done_callback(lambda _: self._tasks.pop(rid, None))
        return future

    def _http(self):
        import httpx

        if self._client is None:
            # no limit on connections: every choice running here holds one (serve.max_pending
            # bounds them); a token server sends a line at least every HEARTBEAT_S, so one whose
            # host went silent fails its requests after SILENT_S instead of holding them
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(connect=10.0, read=SILENT_S, write=30.0, pool=None),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
            self._loop = asyncio.get_running_loop()
        return self._client

    async def _run(self, rid, ids, max_new_tokens, greedy, on_tokens, future: Future, adapter=None) -> None:
        got: list[int] = []
        try:
            if self.closed:
                raise RuntimeError(f"{self.what} is no longer served")
            client = self._http()
            async with client.stream("POST", f"{self.url}/generate", headers={"Authorization": f"Bearer {self.key}"},
                                     json={"rid": rid, "ids": ids, "max_new_tokens": max_new_tokens,
                                           "greedy": greedy, "adapter": adapter}) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line:
                        continue
                    item = json.loads(line)
                    if "error" in item:
                        raise RuntimeError(f"{self.what}: {item['error']}")
                    if "done" in item:
                        future.set_result(Reply(item["done"]))
                        return
                    self.version = max(self.version, item["version"])
                    got += item["tokens"]
                    if on_tokens is not None:
                        on_tokens(item["tokens"], item["logprobs"], item["version"])
            self.failed_at = time.time()
            raise RuntimeError(f"{self.what}: its token server ended the response early")
        except asyncio.CancelledError:
            if future.done():  # (cancelled while the finished response's connection closed)
                return
            if self.closed:  # no longer served: a failure, not a response cut short by its client
                future.set_exception(RuntimeError(f"{self.what} is no longer served"))
            else:  # cancelled by the endpoint: what was decoded so far, as the slot engine answers
                future.set_result(Reply(got))
        except Exception as e:  # noqa: BLE001 -- the request fails (a 500 to its client); the endpoint goes on
            if not isinstance(e, RuntimeError) or not str(e).startswith(self.what):
                self.failed_at = time.time()
                e = RuntimeError(f"{self.what} could not be reached: {type(e).__name__}: {e}")
            if not future.done():
                future.set_exception(e)

    def cancel(self, rid: str) -> None:
        """Stop request ``rid`` (its future gets the tokens so far); nothing if it ended."""
        task = self._tasks.get(rid)
        if task is not None:
            task.get_loop().call_soon_threadsafe(task.cancel)

    def retire(self, drain_s: float = 120.0) -> None:
        """No longer sent requests (called from any thread, once it is out of the endpoint's
        lists): those running end as they would have, then it closes (:meth:`close`; those
        still running after ``drain_s`` fail)."""
        if self._loop is None or not self._tasks:
            self.close()
            return

        async def when_idle():
            deadline = time.time() + drain_s
            while self._tasks and time.time() < deadline:
                await asyncio.sleep(0.1)
            self.close()

        asyncio.run_coroutine_threadsafe(when_idle(), self._loop)

    def close(self) -> None:
        """No longer served (called from any thread): its requests in flight fail, and its HTTP
        client closes once they have."""
        self.closed = True
        tasks = list(self._tasks.values())
        for task in tasks:
            task.get_loop().call_soon_threadsafe(task.cancel)
        if self._loop is not None and self._client is not None:
            async def shut(client=self._client):
                await asyncio.gather(*tasks, return_exceptions=True)
                await client.aclose()
            asyncio.run_coroutine_threadsafe(shut(), self._loop)
