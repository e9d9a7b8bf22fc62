"""Users of a served policy: they ask sums, check the answers, and say which were right.

    streamrl serve recipes/serve.toml          # in one terminal
    python examples/serve_client.py            # in another (--help for the options)

Each user asks ``a+b=`` for ``--n`` answers (one request, streamed), rewards each answer 1 when
it is the sum and 0 when not (``POST /v1/feedback``), and goes on until ``--seconds`` have
passed. Every 10 seconds it prints the share of right answers in that window: it rises as the
endpoint's learners train on the feedback.

``--models`` splits the users between several served policies (the variants of a recipe with
``[[learners]]``, ``GET /v1/models``), and the accuracy is printed for each: an A/B comparison.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
import urllib.request
from pathlib import Path

from openai import OpenAI


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


def user(client: OpenAI, url: str, key: str, model: str, args, tally: list, stop: threading.Event, seed: int):
    """One user: ask, read the stream, reward each answer, repeat."""
    rng = random.Random(seed)
    while not stop.is_set():
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        texts, cid = [""] * args.n, None
        for chunk in client.completions.create(model=model, prompt=f"{a}+{b}=", n=args.n, max_tokens=8,
                                               stream=True):
            cid = chunk.id
            for c in chunk.choices:
                texts[c.index] += c.text
        for k, text in enumerate(texts):
            right = text.strip() == str(a + b)
            feedback(url, key, cid, k, 1.0 if right else 0.0)
            tally.append((time.time(), right, model))


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
    args = ap.parse_args()
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
        time.sleep(10)
        now = time.time()
        parts = []
        for m in models:
            window = [right for t, right, by in tally if now - t <= 10 and by == m]
            if window:
                name = f"{m} " if len(models) > 1 else ""
                parts.append(f"{name}accuracy {sum(window) / len(window):.3f}  ({len(window)} answers in 10 s)")
        if parts:
            print(f"{now - t0:5.0f} s  " + "   ".join(parts), flush=True)
    stop.set()
    for t in threads:
        t.join(timeout=30)


if __name__ == "__main__":
    main()
