"""``math``: 1.0 when the response's final answer equals the ground truth by value, checked
with math-verify (``pip install 'streamrl[math]'``): ``1/2``, ``0.5`` and ``\\frac{1}{2}`` are
one answer; the response's answer is its ``\\boxed{}`` or, without one, its last number or
expression.

math-verify bounds its own work with ``signal.alarm``, which only works in a process's main
thread; called from a Dask worker thread it raises, and a reward that catches the error (verl's
and TRL's did) scores every response 0 without a word. So here it runs with those timeouts off,
in a few processes of its own (``rewards/math_check.py``), one check at a time each; a check that
runs past ``timeout_s`` has its process killed (a new one starts for the next check) and scores
0. Those are plain ``subprocess`` processes: a Dask worker is a daemonic process, which
``multiprocessing`` (and the process pools built on it) may not start children from.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from streamrl.api import Reward
from streamrl.errors import UserError
from streamrl.sample import Prompt

#: seconds a check process may take to start (import sympy and math-verify); measured about 0.5 s
STARTUP_S = 60.0

#: CPU seconds a check may use beyond ``timeout_s`` before the check process ends itself (only
#: reached when nothing killed it: the reward's own process died mid-check)
CPU_GRACE_S = 5.0


def require_math_verify() -> None:
    """Raise a one-line :class:`UserError` when math-verify cannot be imported here."""
    try:
        import math_verify  # noqa: F401
    except ImportError as exc:
        raise UserError(f"reward.name = \"math\": needs math-verify ({exc}); "
                        "install it with: pip install 'streamrl[math]'") from None


class MathRewardConfig(BaseModel):
    """``[reward] name = "math"``."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    timeout_s: float = Field(5.0, gt=0, le=1e6)  # (bounded: a timer of 1e300 s cannot be armed)
    """Wall-clock seconds one response's check may take (reading both answers and comparing
    them); past it the check is killed and the response scores 0 (logged as
    ``reward/timeout/mean``, the fraction of responses cut off)."""
    processes: int = Field(2, ge=1)
    """Check processes per reward worker, each checking one response at a time (more reward
    threads than this wait their turn)."""
    format_score: float = 0.0
    """Score of a response whose answer was read but is wrong (a right one scores 1.0; one with
    no answer, or cut off, 0.0)."""

    @model_validator(mode="before")
    @classmethod
    def _installed(cls, data: Any) -> Any:
        require_math_verify()
        return data


def ground_truth(prompt: Prompt) -> str:
    """The expected answer: ``prompt.answer``, else verl's ``reward_model.ground_truth`` column."""
    gold = prompt.answer
    if gold is None:
        reward_model = prompt.columns.get("reward_model")
        gold = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    if gold is None:
        raise ValueError("no ground truth: the prompt has no answer and no reward_model.ground_truth")
    return str(gold)


class _Checker:
    """One check process (``rewards/math_check.py``) and the pipes to it."""

    def __init__(self):
        # the child finds streamrl where this process did, installed or not
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen([sys.executable, "-m", "streamrl.rewards.math_check"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, bufsize=0)
        self.buffer = b""
        try:
            ready = self._line(time.monotonic() + STARTUP_S)
        except EOFError:
            ready = None
        if ready != b"ready":
            self.kill()
            raise RuntimeError(f"the math-verify check process did not start within {STARTUP_S:.0f} s "
                               f"(exit code {self.proc.returncode})")

    def _line(self, deadline: float) -> bytes | None:
        """The next reply line, or None when ``deadline`` (monotonic) passes first; EOFError
        when the process ended."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line

    def ask(self, gold: str, response: str, timeout: float) -> dict | None:
        """The reply to one check, or None when it took longer than ``timeout`` seconds (the
        caller kills this process then)."""
        request = {"gold": gold, "response": response, "cpu_s": timeout + CPU_GRACE_S}
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            line = self._line(time.monotonic() + timeout)
        except (EOFError, BrokenPipeError):
            code = self.proc.wait()
            if code == -signal.SIGXCPU:  # it ended itself at its CPU limit: a timeout too
                return None
            raise RuntimeError(f"the math-verify check process ended (exit code {code})") from None
        return None if line is None else json.loads(line)

    def kill(self) -> None:
        """End the process and close its pipes."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            pipe.close()


class CheckPool:
    """Up to ``size`` check processes shared by a reward worker's threads, started when first
    needed; each thread takes an idle one (or waits for one) for a check."""

    def __init__(self, size: int):
        self.size = size
        self._idle: list[_Checker] = []
        self._live = 0
        self._closed = False
        self._cond = threading.Condition()

    def check(self, gold: str, response: str, timeout: float) -> dict | None:
        """math-verify's reply for ``response`` against ``gold``; None when it took longer than
        ``timeout`` seconds (its process is killed)."""
        checker = self._take()
        try:
            reply = checker.ask(gold, response, timeout)
        except BaseException:
            self._drop(checker)
            raise
        if reply is None:
            self._drop(checker)  # it may still be computing: only a kill stops it
        else:
            self._give(checker)
        return reply

    def _take(self) -> _Checker:
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("the math reward is closed")
                if self._idle:
                    return self._idle.pop()
                if self._live < self.size:
                    self._live += 1
                    break
                self._cond.wait()
        try:  # (started outside the lock: the others' checks go on meanwhile)
            return _Checker()
        except BaseException:
            with self._cond:
                self._live -= 1
                self._cond.notify()
            raise

    def _drop(self, checker: _Checker) -> None:
        checker.kill()
        with self._cond:
            self._live -= 1
            self._cond.notify()

    def _give(self, checker: _Checker) -> None:
        with self._cond:
            if not self._closed:
                self._idle.append(checker)
                self._cond.notify()
                return
            self._live -= 1
        checker.kill()

    def close(self) -> None:
        """End the idle processes now and the busy ones when their check returns."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._live -= len(idle)
            self._cond.notify_all()
        for checker in idle:
            checker.kill()


class MathReward(Reward):
    """Compares the response's final answer with the ground truth by value (math-verify).
    Thread-safe: each check runs in a process of the shared :class:`CheckPool`."""

    def __init__(self, config: MathRewardConfig):
        require_math_verify()  # (on the worker too: it may lack what the controller has)
        self.config = config
        self.pool = CheckPool(config.processes)

    def __reduce__(self):
        # rebuilt from the config wherever it lands: processes and locks stay where they are
        return MathReward, (self.config,)

    def score(self, prompt: Prompt, response: str) -> dict[str, float]:
        """1.0 for a right answer, ``format_score`` for a wrong one, 0.0 for none (or a check
        cut off), with ``answered`` and ``timeout`` (1.0 or 0.0) beside the score."""
        reply = self.pool.check(ground_truth(prompt), response, self.config.timeout_s)
        if reply is None:
            return {"score": 0.0, "answered": 0.0, "timeout": 1.0}
        if "error" in reply:
            raise ValueError(reply["error"])
        score = 1.0 if reply["correct"] else self.config.format_score if reply["answered"] else 0.0
        return {"score": score, "answered": float(reply["answered"]), "timeout": 0.0}

    def close(self) -> None:
        """End the check processes."""
        self.pool.close()
