"""Scoring a group with a reward, with failures contained (used by reward tasks and by the
reference loop)."""

from __future__ import annotations

import itertools
import math
import queue
import sys
import threading
import time
from typing import Any, Callable

from streamrl.api import Reward
from streamrl.sample import Group
from streamrl.telemetry.names import REWARD_NAMES_KEPT, clean_name
from streamrl.telemetry.text import error_line, printable

#: The default of ``reward.limit``: the largest reward magnitude a run trains on. A reward is a
#: number a user's function, an agent or a client sends; one huge value among a batch's (1e308)
#: makes its advantages and loss overflow, so anything past the limit is refused where it enters
#: (an error counted for that sample, or a 400 to the client), never trained.
REWARD_LIMIT = 1e6

#: The most named values a reward's dict may add beside its score (per response; a step keeps
#: as many over all its responses, ``telemetry/names.py``), and the longest name each may have:
#: each becomes a field of every step's record (``reward/<name>/mean``) and of every tracker's
#: chart, so a reward that names thousands or a page of text fills neither; past them the rest
#: are left out.
MAX_REWARD_INFO = REWARD_NAMES_KEPT
MAX_REWARD_INFO_NAME = 64


def reward_value(value: Any, limit: float = REWARD_LIMIT) -> tuple[float, dict[str, float]]:
    """The score and the named values of what a reward gave for one response: a number, or a
    dict with ``"score"`` and other named values (those that are not numbers are left out, as
    verl's dicts carry strings such as the extracted answer). Raises on anything else, on a
    score that is not a finite number, or on one past ``limit`` (``reward.limit``) either way.

    The named values are at most :data:`MAX_REWARD_INFO`, their names printable and cut to
    :data:`MAX_REWARD_INFO_NAME` characters; a name a tracker would read as nothing (``""``,
    ``"/"``: ``reward//mean`` is the main reward's ``reward/mean`` there) or as one kept already is left out."""
    info: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            keys = ", ".join(map(str, itertools.islice(value, MAX_REWARD_INFO))) or "none"
            raise ValueError(f"a dict without 'score' (keys: {keys[:300]})")
        for key, extra in value.items():
            if len(info) >= MAX_REWARD_INFO:
                break
            if key == "score" or isinstance(extra, (str, bytes, bytearray)):
                continue
            try:
                number = float(extra)
            except Exception:  # (not a number, or an int past float's range: left out, as a string is)
                continue
            name = printable(str(key)[:MAX_REWARD_INFO_NAME])[:MAX_REWARD_INFO_NAME]  # (escapes lengthen it)
            if math.isfinite(number) and clean_name(name) and name not in info:
                info[name] = number
        value = value["score"]
    if value is None:
        raise TypeError("got None; expected a number or a dict with 'score'")
    if isinstance(value, (str, bytes, bytearray)):  # (float() reads "0.5" and b"1": text is not a reward)
        raise TypeError(f"got {type(value).__name__} {_shown_text(value)}; expected a number or a dict with 'score'")
    try:
        score = float(value)
    except OverflowError:  # an int past float's range (10**400): a value, not a crash
        raise ValueError(f"reward is past a float's range (a value of type {type(value).__name__})") from None
    if not math.isfinite(score):
        raise ValueError(f"reward is {score}")
    if abs(score) > limit:
        raise ValueError(f"reward is {score:g}; rewards must lie within [-{limit:g}, {limit:g}] (reward.limit)")
    return score, info


class RewardTimeout(TimeoutError):
    """A reward call did not return within ``reward.score_timeout_s``; it was abandoned."""


class _Runner:
    """A daemon thread that runs reward calls handed to it one at a time, and offers itself
    again when one returns. A call that never returns keeps its runner: that one thread, not the
    next call, is what a hung reward costs."""

    idle: list[_Runner] = []
    lock = threading.Lock()

    def __init__(self) -> None:
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, daemon=True, name="streamrl-reward-call").start()

    @classmethod
    def take(cls) -> _Runner:
        """An idle runner, or a new one when every runner is busy (or hung)."""
        with cls.lock:
            return cls.idle.pop() if cls.idle else cls()

    def _loop(self) -> None:
        while True:
            call = self.calls.get()
            call()
            with _Runner.lock:
                _Runner.idle.append(self)


def call_with_deadline(fn: Callable[..., Any], *args: Any, timeout_s: float | None, what: str = "score") -> Any:
    """``fn(*args)``, or :class:`RewardTimeout` when it has not returned after ``timeout_s``
    seconds (None or 0: wait for ever, on this thread).

    The call runs on another thread, since Python cannot interrupt a function: a late call is
    abandoned, not stopped -- it runs on until it returns (its result is dropped), on a daemon
    thread that never keeps the worker process from exiting. Threads are reused from call to
    call (starting one per call cost ~135 us per sample); a hung call holds its thread and the
    next call gets another. Whatever the call raises, ``SystemExit`` included, is raised here."""
    if not timeout_s:
        return fn(*args)
    box: dict[str, Any] = {}
    done = threading.Event()
    # torch's thread count is per thread (see on_worker/resident.py): a reward model scored on the
    # runner computes with the count this task's thread was given
    torch_threads = sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None

    def call() -> None:
        try:
            if torch_threads is not None:
                sys.modules["torch"].set_num_threads(torch_threads)
            box["value"] = fn(*args)
        except BaseException as exc:  # handed to the caller, whatever it is
            box["error"] = exc
        finally:
            done.set()

    _Runner.take().calls.put(call)
    if not done.wait(timeout_s):
        raise RewardTimeout(f"reward.score_timeout_s: the reward's {what} call did not return within {timeout_s:g}s "
                            "(abandoned; the sample scored 0)")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _failure(exc: BaseException) -> Exception:
    """What a sample's failed score is recorded as: the exception itself, except that a reward
    calling ``sys.exit()`` (a script's grader, ``argparse`` reading the worker's command line)
    must not end a worker thread with Dask's traceback: it is a failed score like any other. So
    is any other exception that is not an :class:`Exception` (``asyncio.CancelledError`` from a
    reward's own event loop, ``func_timeout``'s ``FunctionTimedOut``); only a
    ``KeyboardInterrupt`` is the user's, and its callers let it through."""
    if isinstance(exc, SystemExit):
        return RuntimeError(f"the reward raised SystemExit({exc.code!r}) (sys.exit() called while scoring)")
    if not isinstance(exc, Exception):
        return RuntimeError(f"the reward raised {error_line(exc, 300)}")
    return exc


def score_group(reward: Reward, group: Group, timeout_s: float | None = None, limit: float = REWARD_LIMIT) -> Group:
    """Score every sample in place, with one :meth:`Reward.score_group` call. A reward that
    raises (``SystemExit`` too), gives no finite number, or has not returned within
    ``timeout_s`` seconds per response (``reward.score_timeout_s``; None or 0: no limit;
    :func:`call_with_deadline`), or past ``limit`` (``reward.limit``), for a sample is contained: reward 0, the sample flagged
    (``times["reward_error"]``, counted in ``reward_errors``), the error kept in
    ``Sample.reward_error`` and appended to its text. Returns the group."""
    prompts, responses = [s.prompt for s in group], [s.response_text for s in group]
    values = None
    # the default score_group is score() on each: one hung response would hold the whole
    # group's allowance, so with a limit each response is scored alone, with its own
    # (a reward that does not subclass Reward may have score() only: scored one by one)
    if isinstance(reward, Reward) and (not timeout_s or reward.scores_groups()):
        try:
            # (listed within the deadline: a score_group that returns a generator scores as it is read)
            values = call_with_deadline(lambda p, r: list(reward.score_group(p, r)), prompts, responses,
                                        timeout_s=timeout_s and timeout_s * len(group), what="score_group")
            if len(values) != len(group):
                raise ValueError(f"score_group gave {len(values)} scores for {len(group)} responses")
        except KeyboardInterrupt:
            raise
        except BaseException:  # (the batch as a whole failed) each response alone, so one bad one fails alone
            values = None
    if values is None:
        values = []
        for prompt, response in zip(prompts, responses):
            try:
                values.append(call_with_deadline(reward.score, prompt, response, timeout_s=timeout_s))
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # (SystemExit, CancelledError: a failed score too, see _failure)
                values.append(_failure(exc))
    end = time.time()
    for s, value in zip(group, values):
        try:
            if isinstance(value, BaseException):
                raise _failure(value)
            s.reward, s.reward_info = reward_value(value, limit)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # one bad sample must not fail the step
            s.reward, s.reward_info = 0.0, {}
            s.times["reward_error"] = 1.0
            # (the step's first goes into its record and the console: the exception's text may
            # hold the model's output, with newlines and terminal escapes)
            s.reward_error = error_line(_failure(exc), 500)
            s.response_text += f"\n[reward error: {s.reward_error}]"
        s.times["reward_end"] = end
    return group


def _shown_text(value: str | bytes | bytearray) -> str:
    # (a reward's text in an error line: short, and printable)
    return printable(repr(value[:40]))[:80]
