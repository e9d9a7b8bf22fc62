"""Agent workers: a prompt group's rollouts, run concurrently, each in a thread of its own with
its own event loop, then read back from the endpoint as token-faithful samples.

A rollout gets an ``openai.AsyncOpenAI`` whose every request carries the ``X-Streamrl-Rollout``
header, so the endpoint joins its calls into one trajectory (``serve/trajectories.py``); when the
rollout returns, ``POST /v1/streamrl/rollouts/<id>/finish`` hands the trajectory over. Each
rollout runs in its own thread: agent code that blocks (a synchronous tool that hangs) holds
only that thread, and is abandoned at ``task.rollout_timeout_s`` while the others go on.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import secrets
import ssl
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
from distributed import get_worker

from streamrl.recipe.user_files import exec_user_source
from streamrl.rewards.scoring import REWARD_LIMIT, reward_value
from streamrl.sample import Group, Prompt, Sample
from streamrl.serve.trajectories import ROLLOUT_HEADER, ROLLOUT_KEY_HEADER
from streamrl.telemetry.text import error_line, one_line

#: The Dask event topic of each group's rollout counts (``agents/extension.py`` reads it).
EVENT_TOPIC = "streamrl-agent"

#: Seconds to wait for the endpoint to hand over a trajectory.
FINISH_TIMEOUT_S = 30.0

# One TLS context for every client of this worker. httpx builds one per client otherwise, loading
# the CA bundle each time: a hundred rollout threads doing that at once held the worker for
# minutes (OpenSSL's loading contends badly), long enough for Dask to restart it. The endpoints
# are plain HTTP; the context is only ever read.
_TLS = ssl.create_default_context()
_HTTP = httpx.Client(verify=_TLS, timeout=FINISH_TIMEOUT_S)  # thread-safe: the groups' trajectory reads

# the user's file, imported once per worker and version of its text (the group tasks of a
# worker's threads ask at once)
_MODULES: dict[tuple[str, int], Any] = {}
_MODULES_LOCK = threading.Lock()


@dataclass
class Outcome:
    """How one rollout ended."""

    reward: float = 0.0
    info: dict[str, float] = field(default_factory=dict)
    error: str = ""
    """``"TypeError: ..."`` when the agent raised, ``"RolloutTimeout: ..."`` when it was abandoned."""
    seconds: float = 0.0
    transient: bool = False
    """The failure was its surroundings', not the agent's: it ran past its timeout, or its
    endpoint could not be reached or answered with a server error (an overloaded worker, a lost
    one). A step whose every rollout failed so goes on (:func:`transient_failure`)."""


#: Threads a rollout's blocking calls (``asyncio.to_thread``) may hold at once.
TOOL_THREADS = 8

#: Trajectories of one group asked for at once.
FINISH_THREADS = 16


class RolloutThread(threading.Thread):
    """One rollout: the agent's coroutine on an event loop of its own."""

    def __init__(self, make_coroutine):
        super().__init__(daemon=True, name="streamrl-rollout")
        self.make_coroutine = make_coroutine
        self.result: Any = None
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None

    def run(self) -> None:
        """Run the coroutine to its end (or its cancellation)."""
        loop = self._loop = asyncio.new_event_loop()
        # the rollout's own threads for blocking calls (``asyncio.to_thread``, run_in_executor):
        # a tool that blocks past the timeout keeps one, and it is counted as stuck, as this
        # thread would be (the loop's shared default pool would hide it)
        tools: set[threading.Thread] = set()
        tools_lock = threading.Lock()  # (a tool thread adds itself while this one may read the set)

        def mark() -> None:
            with tools_lock:
                tools.add(threading.current_thread())

        executor = ThreadPoolExecutor(max_workers=TOOL_THREADS, thread_name_prefix="streamrl-rollout-tool",
                                      initializer=mark)
        loop.set_default_executor(executor)
        try:
            self._task = loop.create_task(self._guarded())
            self.result = loop.run_until_complete(self._task)
        except BaseException as e:  # noqa: BLE001 -- the agent's failure, reported by the group
            self.error = e
        finally:
            executor.shutdown(wait=False, cancel_futures=True)
            loop.close()
            with tools_lock:
                held = list(tools)
            until = time.monotonic() + 0.1  # (idle ones end at the shutdown's wake-up: not stuck, only not gone yet)
            for t in held:
                t.join(timeout=max(0.0, until - time.monotonic()))
            left = [t for t in held if t.is_alive()]
            if left:
                with _STUCK_LOCK:
                    _STUCK.update(left)

    async def _guarded(self):
        # An agent's SystemExit or KeyboardInterrupt (sys.exit() in user code) ends its rollout
        # only: caught inside the task, so asyncio neither stops the loop with it nor prints
        # "Task exception was never retrieved" with a traceback for each one
        try:
            return await self.make_coroutine()
        except asyncio.CancelledError:
            raise  # (abandoned after its timeout)
        except BaseException as e:  # noqa: BLE001 -- the agent's failure, reported by the group
            self.error = e

    def abandon(self) -> None:
        """Cancel the coroutine (it gets ``CancelledError`` at its next await; code that never
        awaits keeps only this thread)."""
        loop, task = self._loop, self._task
        if loop is not None and task is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # (the loop closed meanwhile)
                pass


#: Rollout threads abandoned at their timeout that still run: an agent stuck in code that never
#: awaits (a spin, a blocking socket, a tool in C) keeps its thread, its event loop and its row,
#: and Python cannot stop a thread. Counted per worker (``agent/stuck``); past :data:`MAX_STUCK`
#: the worker runs no more rollouts (each is that error, so the step says why) rather than
#: gather threads until it runs out of memory.
_STUCK: set[threading.Thread] = set()
_STUCK_LOCK = threading.Lock()
MAX_STUCK = 256


def stuck() -> int:
    """How many of this worker's abandoned rollout threads still run."""
    with _STUCK_LOCK:
        _STUCK.difference_update([t for t in _STUCK if not t.is_alive()])
        return len(_STUCK)


def agent_of(spec: dict):
    """The user's rollout function, or streamrl's rollout of the user's environment class."""
    key = (spec["path"], zlib.crc32(spec["source"].encode()))
    with _MODULES_LOCK:
        if key not in _MODULES:
            _MODULES[key] = exec_user_source(spec["path"], spec["source"])
        module = _MODULES[key]
    if spec["function"]:
        return getattr(module, spec["function"])
    from streamrl.agents.environment import environment_rollout

    env_class = getattr(module, spec["environment"])

    async def rollout(client, row):
        return await environment_rollout(client, row, env_class, spec["max_turns"], spec["max_tokens"])
    return rollout


#: What a rollout that returned without calling the model is reported as.
NO_CALLS = "the rollout returned without calling the model"


def first_error(kept: str, new: str) -> str:
    """The failure to quote for a step, of ``kept`` (so far; "" for none) and ``new``: a raised
    error before a timeout, a timeout before a rollout that called nothing, else the earlier one.
    A raised error's text says what went wrong; a timeout is counted apart (``agent/timeouts``)
    and says only how long it waited, so one in the same step must not hide the error."""
    def rank(error: str) -> int:
        return 2 if error == NO_CALLS else 1 if error.startswith("RolloutTimeout") else 0

    return new if not kept or rank(new) < rank(kept) else kept


def run_group(prompt: Prompt, n: int, urls: list[str], spec: dict, api_key: str, step: int, first: int = 0,
              rollout_key: str = "") -> list[Group]:
    """Agent worker: ``n`` rollouts of ``prompt``'s row (``Prompt.columns``), rollout ``k`` on
    endpoint ``urls[(first + k) % len(urls)]``; returns the group (a bundle of one) of their
    trajectories' samples, each with its rollout's reward. A rollout that raised or timed out
    is scored 0 with its error; one that never called the model leaves no sample. The counts go
    to the Dask event ``streamrl-agent``."""
    agent = agent_of(spec)
    with _MODULES_LOCK:  # once per worker, by one task, before any rollout thread needs it (not
        import openai  # noqa: F401 -- at the CLI's import: trackers such as wandb react to its presence)
    tag = secrets.token_hex(4)
    held = stuck()
    if held >= MAX_STUCK:  # (a new thread per rollout would only add to them)
        error = (f"AgentStuck: {held} rollouts of worker {get_worker().name} still run past task.rollout_timeout_s "
                 "(agent code that never awaits: a loop, a blocking call); restart the agent pool's workers, and "
                 "make the agent's waits awaitable")
        get_worker().log_event(EVENT_TOPIC, {"step": step, "rollouts": n, "errors": n, "timeouts": 0, "no_calls": 0,
                                             "calls": 0, "tool_calls": 0, "splits": 0, "crossed_updates": 0,
                                             "stuck": held, "first_error": error})
        return []  # (no sample: as rollouts that failed before calling the model)
    runs = []
    for k in range(n):
        rid = f"{prompt.uid}-{k}-{tag}"
        url = urls[(first + k) % len(urls)]
        # a row of its own for each rollout: they run side by side, and an agent that appends to
        # the row's messages (or pops its answer) must not change its siblings' conversations
        row = copy.deepcopy(prompt.columns)
        thread = RolloutThread(_rollout_coroutine(agent, url, api_key, rid, row, spec["timeout_s"], rollout_key,
                                                  spec.get("reward_limit", REWARD_LIMIT)))
        runs.append((k, rid, url, thread, time.time()))
        thread.start()
    deadline = time.time() + spec["timeout_s"]
    outcomes = []
    for k, rid, url, thread, started in runs:
        thread.join(max(0.0, deadline - time.time()))
        outcomes.append(_outcome(thread, started, spec["timeout_s"]))
    group: Group = []
    counts = {"step": step, "rollouts": n, "errors": 0, "timeouts": 0, "no_calls": 0, "calls": 0, "tool_calls": 0,
              "splits": 0, "crossed_updates": 0, "stuck": 0, "first_error": ""}
    # the trajectories asked for side by side: one after another, a group outlasted its rollouts'
    # timeout by up to n times a finish's own bound on an endpoint that answered slowly
    threads = max(1, min(FINISH_THREADS, len(runs)))
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="streamrl-finish") as pool:
        finishing = [pool.submit(_finish, url, api_key, rid, rollout_key) for _, rid, url, _, _ in runs]
    for (k, rid, url, thread, started), outcome, finished in zip(runs, outcomes, finishing):
        try:
            traj = finished.result()
        except RolloutDropped as e:  # the endpoint is there, and says why it has no trajectory of it
            traj = {"segments": [], "calls": 0, "tool_calls": 0, "splits": 0}
            if not outcome.error:
                outcome.error = one_line(f"RolloutDropped: {e}", 500)
                # (crowded out by other rollouts in flight: overload, as a timeout is)
                outcome.transient = "rollouts being in flight" in str(e)
        except Exception as e:  # its endpoint is gone (a restarted generate worker), or answered garbage
            traj = {"segments": [], "calls": 0, "tool_calls": 0, "splits": 0}
            if not outcome.error:
                outcome.error = one_line(f"EndpointLost: the trajectory could not be read from {url} "
                                         f"({type(e).__name__}: {e})"[:500])
                # (its surroundings' failure when the endpoint could not be reached or failed;
                # an answer it refused, or one that was not a trajectory, is not overload)
                outcome.transient = isinstance(e, httpx.TransportError) or (
                    isinstance(e, httpx.HTTPStatusError) and e.response.status_code >= 500)
        counts["calls"] += traj["calls"]
        counts["tool_calls"] += traj["tool_calls"]
        counts["splits"] += traj["splits"]
        if outcome.error:
            counts["timeouts" if outcome.error.startswith("RolloutTimeout") else "errors"] += 1
            counts["first_error"] = first_error(counts["first_error"], outcome.error)
        if not traj["segments"] and not outcome.error:
            counts["no_calls"] += 1
            counts["first_error"] = first_error(counts["first_error"], NO_CALLS)
        samples = samples_of(prompt, k, traj, outcome, started)
        # a rollout that went on across a weight update: its tokens come from several versions
        counts["crossed_updates"] += len({v for s in samples for v, m in zip(s.token_versions, s.loss_mask) if m}) > 1
        group += samples
    counts["stuck"] = stuck()
    get_worker().log_event(EVENT_TOPIC, counts)
    return [group] if group else []


class BadResult(Exception):
    """What a rollout returned is not a reward (raised in its own thread, under its timeout)."""


def _rollout_coroutine(agent, url: str, api_key: str, rid: str, row: dict, timeout_s: float, rollout_key: str,
                       limit: float = REWARD_LIMIT):
    async def main():
        import openai  # (imported already by the group's task: a lookup)

        client = openai.AsyncOpenAI(base_url=url, api_key=api_key or "streamrl", timeout=timeout_s,
                                    default_headers={ROLLOUT_HEADER: rid, ROLLOUT_KEY_HEADER: rollout_key},
                                    http_client=httpx.AsyncClient(verify=_TLS, timeout=timeout_s))
        try:
            result = agent(client, row)
            return await result if inspect.isawaitable(result) else result
        finally:
            await client.close()
    return as_reward(main, limit)


def as_reward(make_coroutine, limit: float = REWARD_LIMIT):
    """``make_coroutine``'s result read into ``(reward, info)`` at the end of the same coroutine:
    in the rollout's own thread and under its timeout, so a result whose ``__float__`` loops or
    calls ``sys.exit()`` ends that rollout, not its group's task (:class:`BadResult` when it is
    not a reward)."""
    async def main():
        result = await make_coroutine()
        try:
            return reward_value(result, limit)
        except Exception as e:
            raise BadResult(one_line(f"{type(e).__name__}: the rollout returned {_shown(result)}: {e}", 500)) from None
    return main


def _outcome(thread: RolloutThread, started: float, timeout_s: float) -> Outcome:
    seconds = time.time() - started
    if thread.is_alive():
        thread.abandon()
        with _STUCK_LOCK:  # (until it ends: one that awaits ends at its next await)
            _STUCK.add(thread)
        return Outcome(error=f"RolloutTimeout: still running after {timeout_s:g} s (task.rollout_timeout_s)",
                       seconds=seconds, transient=True)
    if isinstance(thread.error, BadResult):  # (whatever the agent returned: its rollout's error, not the step's)
        return Outcome(error=str(thread.error), seconds=seconds)
    if thread.error is not None:
        e = thread.error
        # (an agent's error text may quote the model's output: newlines, terminal escapes)
        return Outcome(error=error_line(e, 500), seconds=seconds, transient=transient_failure(e))
    reward, info = thread.result
    return Outcome(reward, info, seconds=seconds)


def _shown(value: Any) -> str:
    # an agent's result in an error line: its repr may raise, or be an int of 10,000 digits
    # (whose repr Python refuses past 4,300 digits)
    try:
        return f"{value!r:.80}"
    except Exception:
        return f"a value of type {type(value).__name__}"


def transient_failure(e: BaseException) -> bool:
    """Whether an agent's exception is its endpoint's failure rather than its own: the model's
    client timed out or could not connect, or the endpoint answered 429 or a 5xx. Under a
    neighbour that hogs the worker (a tool result of megabytes, a CPU spin, a loop of hundreds of
    calls) every other rollout of a step can fail so; that is overload, not a broken agent. A 500
    of the recipe's tool parser (``code: "tool_parser_failed"``) is not: the same parser fails
    the same way at every step, so a step whose every rollout met it stops the run at once."""
    import openai

    if isinstance(e, (openai.APIConnectionError, httpx.TransportError)):  # (APITimeoutError is one)
        return True
    try:
        code = getattr(e, "code", None)
    except KeyboardInterrupt:
        raise
    except BaseException:  # (an agent's exception whose code is a property that raises, or exits)
        code = None
    if code == "tool_parser_failed":
        return False
    return isinstance(e, openai.APIStatusError) and (e.status_code == 429 or e.status_code >= 500)


def _finish(url: str, api_key: str, rid: str, rollout_key: str, tries: int = 3) -> dict:
    """The rollout's trajectory, taken from the endpoint that served it; asked again when the
    answer timed out on its way (the endpoint gives the same one again for a while)."""
    headers = {ROLLOUT_KEY_HEADER: rollout_key, **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    for attempt in range(tries):
        try:
            r = _HTTP.post(f"{url}/streamrl/rollouts/{rid}/finish", headers=headers)
            break
        except httpx.TimeoutException:
            if attempt == tries - 1:
                raise
    if r.status_code == 409:  # (dropped by the endpoint, or handed over and no longer kept): its reason
        try:
            said = str(r.json()["error"]["message"])
        except Exception:  # noqa: BLE001 -- an answer not in the API's shape: its text
            said = r.text
        raise RolloutDropped(one_line(said, 300))
    r.raise_for_status()
    return r.json()


class RolloutDropped(RuntimeError):
    """The endpoint has no trajectory to hand over for a rollout that called it: dropped (gone
    stale, or crowded out by others in flight) or handed over before and no longer kept."""


def samples_of(prompt: Prompt, k: int, traj: dict, outcome: Outcome, started: float) -> list[Sample]:
    """Rollout ``k``'s trajectory (each of its segments) as samples with its reward."""
    out = []
    info = {**outcome.info, "turns": float(traj["calls"]), "tool_calls": float(traj["tool_calls"])}
    for j, seg in enumerate(traj["segments"]):
        versions = seg["policy_versions"]
        s = Sample(uid=f"{prompt.uid}-{k}" + (f".{j}" if j else ""), prompt=prompt, prompt_ids=seg["prompt_ids"],
                   response_ids=seg["response_ids"], logprobs=seg["logprobs"], response_text=seg.get("text", ""),
                   policy_version=min(versions) if versions else 0, token_versions=versions,
                   loss_mask=seg["loss_mask"], reward=outcome.reward, reward_info=dict(info),
                   worker=traj.get("worker", ""), times={"submitted": started, "gen_start": started,
                                                         "gen_end": started + outcome.seconds,
                                                         "reward_end": started + outcome.seconds})
        if outcome.error:
            s.reward_error = outcome.error
            s.times["reward_error"] = 1.0
            if outcome.transient:
                s.times["reward_transient"] = 1.0
            s.response_text += f"\n[rollout error: {outcome.error}]"
        out.append(s)
    return out
