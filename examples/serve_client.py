"""Users of a served policy: they ask sums, check the answers, and say which were right.

    streamrl serve recipes/serve.toml          # in one terminal
    python examples/serve_client.py            # in another (--help for the options)

    streamrl serve recipes/smollm2-serve.toml  # a real instruct model, asked in words
    python examples/serve_client.py --chat --window 60

Each user asks ``a+b=`` for ``--n`` answers (one request, streamed), rewards each answer 1 when
it is the sum and 0 when not (``POST /v1/feedback``), and goes on until ``--seconds`` have
passed. Every ``--window`` seconds it prints the share of right answers in that window: it
rises as the endpoint's learners train on the feedback.

``--chat`` asks an instruct model as a person would, through the chat route and the model's own
chat template ("What is 59 + 63? Reply with just the number."), and an answer is right when its
last integer is the sum (an answer that explains first and ends on the sum counts).

``--models`` splits the users between several served policies (the variants of a recipe with
``[[learners]]``, ``GET /v1/models``), and the accuracy is printed for each: an A/B comparison.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import threading
import time
import urllib.request
from pathlib import Path

from openai import OpenAI


#: Seconds a user waits after a failed request before the next (doubling, up to 10 s).
PAUSE_S = 0.5

#: Failed requests by the kind of error, over the whole run.
errors: dict[str, int] = {}


def endpoint(args) -> tuple[str, str]:
    """The base URL and model: from the flags, or the newest run folder's ``serve.json``."""
    if args.url:
        return args.url, args.model
    found = sorted(Path(args.runs).glob("*/serve.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"no serve.json under {args.runs}/: start `streamrl serve recipes/serve.toml` or pass --url")
    info = json.loads(found[-1].read_text())
    return info["url"], args.model or info["model"]


def feedback(url: str, key: str, completion_id: str, index: int, reward: float) -> None:
    """``POST /v1/feedback`` (the ``openai`` client has no method for streamrl's own route)."""
    body = json.dumps({"id": completion_id, "index": index, "reward": reward}).encode()
    req = urllib.request.Request(f"{url}/feedback", data=body, method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    urllib.request.urlopen(req, timeout=30).read()


def ask(client: OpenAI, model: str, a: int, b: int, args) -> tuple[str, list[str]]:
    """One request, streamed: the completion's id and its ``n`` answers."""
    texts, cid = [""] * args.n, None
    if args.chat:
        question = [{"role": "user", "content": f"What is {a} + {b}? Reply with just the number."}]
        for chunk in client.chat.completions.create(model=model, messages=question, n=args.n,
                                                    max_tokens=args.max_tokens, stream=True):
            cid = chunk.id
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
    else:
        for chunk in client.completions.create(model=model, prompt=f"{a}+{b}=", n=args.n,
                                               max_tokens=args.max_tokens, stream=True):
            cid = chunk.id
            for c in chunk.choices:
                texts[c.index] += c.text
    return cid, texts


def is_right(text: str, total: int, chat: bool) -> bool:
    """A completion is right when it is the sum; a chat reply when its last integer is."""
    if not chat:
        return text.strip() == str(total)
    found = re.findall(r"-?\d+", text.replace(",", ""))
    return bool(found) and int(found[-1]) == total


def user(client: OpenAI, url: str, key: str, model: str, args, tally: list, stop: threading.Event, seed: int):
    """One user: ask, read the stream, reward each answer, repeat. A request that fails (the
    endpoint still starting, a refusal, a dropped connection) is counted as failed and tried
    again after a pause: one error never ends a user."""
    rng = random.Random(seed)
    pause = PAUSE_S
    while not stop.is_set():
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        try:
            cid, texts = ask(client, model, a, b, args)
            for k, text in enumerate(texts):
                right = is_right(text, a + b, args.chat)
                feedback(url, key, cid, k, 1.0 if right else 0.0)
                tally.append((time.time(), right, model))
            pause = PAUSE_S
        except Exception as e:  # noqa: BLE001 -- counted and shown; the user goes on
            tally.append((time.time(), None, model))
            errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
            stop.wait(pause)
            pause = min(2 * pause, 10.0)


def main() -> None:
    """Parse the flags, run the users, print the accuracy every 10 seconds."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="", help="the endpoint's base URL (default: the newest runs/*/serve.json)")
    ap.add_argument("--model", default="", help="the served model's name (default: serve.json's)")
    ap.add_argument("--models", default="", help="comma-separated models to split the users between (A/B), "
                                                 "e.g. serve-ab/grpo,serve-ab/ppo")
    ap.add_argument("--api-key", default="none", help="serve.api_key, when the endpoint has one")
    ap.add_argument("--runs", default="runs", help="where run folders are")
    ap.add_argument("--users", type=int, default=4, help="concurrent users")
    ap.add_argument("--n", type=int, default=8, help="answers per question (one GRPO group)")
    ap.add_argument("--seconds", type=float, default=300, help="how long the users keep asking")
    ap.add_argument("--chat", action="store_true", help="ask in words through the chat route (an instruct model)")
    ap.add_argument("--max-tokens", type=int, default=0, help="tokens per answer (default: 8, 16 with --chat)")
    ap.add_argument("--window", type=float, default=10, help="seconds of answers each printed accuracy covers")
    args = ap.parse_args()
    args.max_tokens = args.max_tokens or (16 if args.chat else 8)
    url, model = endpoint(args)
    models = [m.strip() for m in args.models.split(",") if m.strip()] or [model]
    client = OpenAI(base_url=url, api_key=args.api_key, max_retries=5)
    tally: list[tuple[float, bool, str]] = []
    stop = threading.Event()
    threads = [threading.Thread(target=user, args=(client, url, args.api_key, models[i % len(models)], args, tally,
                                                   stop, i), daemon=True)
               for i in range(args.users)]
    for t in threads:
        t.start()
    t0 = time.time()
    while time.time() - t0 < args.seconds:
        time.sleep(args.window)
        now = time.time()
        parts = []
        for m in models:
            window = [right for t, right, by in list(tally) if now - t <= args.window and by == m]
            answers = [right for right in window if right is not None]
            failed = len(window) - len(answers)
            name = f"{m} " if len(models) > 1 else ""
            if answers:
                parts.append(f"{name}accuracy {sum(answers) / len(answers):.3f}  "
                             f"({len(answers)} answers in {args.window:g} s"
                             + (f", {failed} requests failed)" if failed else ")"))
            elif failed:
                parts.append(f"{name}{failed} requests failed in {args.window:g} s")
        if parts:
            print(f"{now - t0:5.0f} s  " + "   ".join(parts), flush=True)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    if errors:
        print("failed requests: " + ", ".join(f"{n} {kind}" for kind, n in sorted(errors.items())), flush=True)


if __name__ == "__main__":
    main()
