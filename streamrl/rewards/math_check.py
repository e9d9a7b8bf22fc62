"""The process that checks math answers for the ``math`` reward (``rewards/math_reward.py``):
``python -m streamrl.rewards.math_check``, one request per line on stdin, one JSON reply per line
on stdout.

math-verify runs here, in the main thread of a process of its own, with its own ``signal.alarm``
timeouts off: those only work in a main thread, and reward tasks run in Dask worker threads. The
reward enforces the timeout from outside, by killing this process. Imports nothing from streamrl
beyond its package, so it starts in about half a second.

Request: ``{"gold": str, "response": str, "cpu_s": float}``. Reply: ``{"answered": bool,
"correct": bool}`` (``answered``: an answer was read from the response), or ``{"error": str}``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys


def _limit_cpu(seconds: float) -> None:
    """Let this request use at most ``seconds`` more CPU time; past it the kernel ends the
    process (SIGXCPU). The reward kills a slow check first (wall-clock time runs at least as fast
    as CPU time): this only ends a check left running when the reward's process died mid-call."""
    try:
        import resource
    except ImportError:  # (not posix: no backstop)
        return
    usage = resource.getrusage(resource.RUSAGE_SELF)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = math.ceil(usage.ru_utime + usage.ru_stime + seconds)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def main() -> None:
    """Answer requests until stdin closes."""
    replies = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # what a library prints goes to stderr, never between the replies
    logging.disable(logging.CRITICAL)  # math-verify warns about its disabled timeouts on first use
    from math_verify import parse, verify

    golds: dict[str, list] = {}  # a group's samples share one ground truth: parse it once
    replies.write(b"ready\n")
    for line in sys.stdin.buffer:
        request = json.loads(line)
        _limit_cpu(request.get("cpu_s", 60.0))
        try:
            gold = request["gold"]
            if gold not in golds:
                if len(golds) > 4096:
                    golds.clear()
                # a bare "1/2" or "\frac{1}{2}" parses as it is; anything else as if boxed
                golds[gold] = parse(gold, parsing_timeout=None) or parse(f"\\boxed{{{gold}}}", parsing_timeout=None)
            if not golds[gold]:
                reply = {"error": f"ground truth {gold!r} holds no answer math-verify can read"}
            else:
                answer = parse(request["response"], parsing_timeout=None)
                reply = {"answered": bool(answer),
                         "correct": bool(answer) and bool(verify(golds[gold], answer, timeout_seconds=None))}
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        replies.write(json.dumps(reply).encode() + b"\n")


if __name__ == "__main__":
    main()
