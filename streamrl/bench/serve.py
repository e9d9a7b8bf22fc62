"""``streamrl bench serve``: the endpoint's latency under a bounded load, with learning off and on,
side by side on one endpoint.

    streamrl bench serve recipes/serve.toml --clients 8 --seconds 30 --repeats 2

It starts ``streamrl serve`` (a port of its own, on loopback), then runs phases of ``--seconds``
each, alternating: **off**, the clients ask and send no feedback (no step trains, no weights
load); **on**, the same clients reward every answer (steps train and the engine loads each new
policy between decode steps). Each client streams its requests with the ``openai`` client, one
at a time. Per phase: time to first token and time between two tokens of one choice (p50, p99
over every request), generated tokens/s, requests answered, refused (429) and failed, and the
host's CPU per streamed token in the serving process (its HTTP thread, its decode loop, the loop's
hand-over of tokens: :func:`per_token`). The ratio on/off of the median inter-token latency is the
cost learning adds to serving.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from rich.console import Console
from rich.table import Table

from streamrl.errors import UserError
from streamrl.recipe.recipe import load_recipe


def percentile(xs: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``xs`` (nearest rank); None when empty."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Load:
    """``clients`` threads streaming requests at the endpoint until ``seconds`` pass, in this
    process or spread over ``processes`` of their own."""

    def __init__(self, url: str, model: str | list[str], key: str, clients: int, seconds: float, n: int,
                 feedback: bool, processes: int = 1, first_seed: int = 0):
        self.processes = max(1, min(processes, clients))
        """Processes the clients run in. One process's threads share its interpreter lock: on a
        GPU the engine answers faster than 64 threads of one process read their streams, and the
        latencies measured are then the clients' own (``--client-processes``)."""
        self.first_seed = first_seed
        self.url, self.key = url, key
        self.models = [model] if isinstance(model, str) else list(model)
        """The models asked, in turn (the served policy and, with ``--all-models``, every variant)."""
        self.by_model: dict[str, list[float]] = {m: [] for m in self.models}  # time to first token
        self.clients, self.seconds, self.n, self.feedback = clients, seconds, n, feedback
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.tokens = 0
        self.answered = self.refused = self.failed = 0
        self._lock = threading.Lock()

    def run(self) -> dict:
        """Run the clients; the phase's figures."""
        if self.processes > 1:
            hung, wall = self._in_processes()
        else:
            found = self.measure()
            hung, wall = found["hung"], found["wall"]
        ms = lambda x: None if x is None else round(1000 * x, 2)  # noqa: E731
        row = {"requests": self.answered, "refused": self.refused, "failed": self.failed,
               "hung": hung, "tokens": self.tokens, "tokens_per_s": round(self.tokens / wall, 1),
               "ttft_p50_ms": ms(percentile(self.ttft, 0.5)), "ttft_p99_ms": ms(percentile(self.ttft, 0.99)),
               "itl_p50_ms": ms(percentile(self.itl, 0.5)), "itl_p99_ms": ms(percentile(self.itl, 0.99))}
        if len(self.models) > 1:
            row["models"] = {m: {"requests": len(xs), "ttft_p50_ms": ms(percentile(xs, 0.5)),
                                 "ttft_p99_ms": ms(percentile(xs, 0.99))} for m, xs in self.by_model.items()}
        return row

    def measure(self) -> dict:
        """Run this process's clients; what they measured, raw (merged by :meth:`run`)."""
        from openai import OpenAI

        stop = time.time() + self.seconds
        client = OpenAI(base_url=self.url, api_key=self.key or "none", max_retries=0, timeout=60)
        threads = [threading.Thread(target=self._client, args=(client, stop, self.first_seed + i), daemon=True)
                   for i in range(self.clients)]
        t0 = time.time()
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.seconds + 120)  # a request past its phase is allowed to finish, bounded
        with self._lock:
            return {"wall": time.time() - t0, "hung": sum(t.is_alive() for t in threads), "ttft": list(self.ttft),
                    "itl": list(self.itl), "tokens": self.tokens, "answered": self.answered,
                    "refused": self.refused, "failed": self.failed, "by_model": dict(self.by_model)}

    def _in_processes(self) -> tuple[int, float]:
        # the clients split over processes started afresh (spawned: no threads or sockets
        # inherited), each measuring its share; their lists merged here
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        shares = [self.clients // self.processes + (k < self.clients % self.processes) for k in range(self.processes)]
        seeds = [self.first_seed + sum(shares[:k]) for k in range(self.processes)]
        with ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn")) as pool:
            parts = list(pool.map(_measure_part, [(self.url, self.models, self.key, c, self.seconds, self.n,
                                                   self.feedback, seed) for c, seed in zip(shares, seeds)]))
        for part in parts:
            self.ttft += part["ttft"]
            self.itl += part["itl"]
            self.tokens += part["tokens"]
            self.answered += part["answered"]
            self.refused += part["refused"]
            self.failed += part["failed"]
            for m, xs in part["by_model"].items():
                self.by_model[m] += xs
        return sum(p["hung"] for p in parts), max(p["wall"] for p in parts)

    def _client(self, client, stop: float, seed: int) -> None:
        import httpx
        import openai

        rng = random.Random(seed)
        turn = seed
        while time.time() < stop:
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            model = self.models[turn % len(self.models)]
            turn += 1
            sent = time.perf_counter()
            last: dict[int, float] = {}  # each choice's last token: inter-token times are per choice
            first, cid = None, None
            try:
                for chunk in client.completions.create(model=model, prompt=f"{a}+{b}=", n=self.n, stream=True):
                    cid = chunk.id
                    extra = (chunk.model_extra or {}).get("streamrl", {})
                    got = len(extra.get("token_ids") or [])
                    if not got:
                        continue
                    now, k = time.perf_counter(), extra.get("index", 0)
                    with self._lock:
                        if first is None:
                            first = now - sent
                            self.ttft.append(first)
                            self.by_model[model].append(first)
                        if k in last:
                            self.itl.append(now - last[k])
                        self.tokens += got
                    last[k] = now
            except openai.RateLimitError:
                with self._lock:
                    self.refused += 1
                time.sleep(0.2)
                continue
            except (openai.APIError, httpx.HTTPError, OSError):  # (a stream cut mid-way is httpx's own error)
                with self._lock:
                    self.failed += 1
                continue
            with self._lock:
                self.answered += 1
            if self.feedback and cid:
                self._reward(cid, rng.random())

    def _reward(self, cid: str, reward: float) -> None:
        body = json.dumps({"id": cid, "reward": reward}).encode()
        req = urllib.request.Request(f"{self.url}/feedback", data=body, method="POST",
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {self.key or 'none'}"})
        try:
            urllib.request.urlopen(req, timeout=30).read()
        except OSError:
            with self._lock:
                self.failed += 1


def _kill_group(proc: subprocess.Popen) -> None:
    """``kill -9`` the endpoint's process group (its cluster's workers too: they write in the
    folder about to be removed), and wait for it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)


def _measure_part(args: tuple) -> dict:
    """One client process's share of a phase (:meth:`Load.measure`)."""
    url, models, key, clients, seconds, n, feedback, first_seed = args
    return Load(url, models, key, clients, seconds, n, feedback, first_seed=first_seed).measure()


def _stop_with_parent() -> None:
    """In the endpoint's process before it starts (Linux): when this bench's process ends however
    it ends -- killed for its time by a GPU check -- the endpoint gets SIGINT and stops its run,
    as at a Ctrl-C. In a session of its own, nothing else would stop it, and it held the GPU and
    its port for good."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGINT)  # (1: PR_SET_PDEATHSIG)
    except (OSError, AttributeError):  # (no prctl: not Linux)
        pass


def _steps(metrics: Path) -> int:
    """Steps the endpoint's run has trained so far (lines of its ``metrics.jsonl``)."""
    try:
        return len(metrics.read_text().splitlines())
    except OSError:
        return 0


#: Seconds without a step that say the endpoint's trainer is idle (at least; 1.5 x its slowest
#: recent step where that is longer), and the most a phase waits for it.
QUIET_S, QUIET_LIMIT_S = 3.0, 120.0


def _quiet_window(metrics: Path) -> float:
    """How long no step must come to call the trainer idle: :data:`QUIET_S`, or 1.5 x the
    slowest of its last few steps (a GPU step with a weight sync takes longer than 3 s)."""
    try:
        recent = [json.loads(line).get("step_s") for line in metrics.read_text().splitlines()[-3:]]
    except (OSError, ValueError):
        recent = []
    slowest = max((s for s in recent if isinstance(s, (int, float))), default=0.0)
    return max(QUIET_S, 1.5 * slowest)


def _quiet(metrics: Path, proc) -> None:
    """Wait until the run trains no more steps (what the last phase's feedback asked for is
    done), :data:`QUIET_LIMIT_S` at most; an "off" phase measures an endpoint that does not learn."""
    def size() -> int:  # (a step appends a line: its size says so without reading megabytes of records)
        try:
            return metrics.stat().st_size
        except OSError:
            return 0
    t0 = last = time.monotonic()
    seen, window = size(), _quiet_window(metrics)
    while time.monotonic() - last < window and time.monotonic() - t0 < QUIET_LIMIT_S and proc.poll() is None:
        time.sleep(0.25)
        now = size()
        if now != seen:
            seen, last = now, time.monotonic()


def bench(file: str, overrides: list[str], clients: int, seconds: float, repeats: int, n: int,
          out: str | None, all_models: bool = False, client_processes: int = 1) -> dict:
    """Start the endpoint, run the phases (off, on, alternating), print the table; the rows
    and the median on/off ratios. ``all_models``: the clients ask every model ``GET /v1/models``
    lists in turn (the served policy and each learner's variant), and each model's time to first
    token is reported with its ratio to the served policy's."""
    if clients < 1 or seconds <= 0 or repeats < 1 or n < 1 or client_processes < 1:
        raise UserError("--clients, --seconds, --repeats, --n and --client-processes must be positive")
    # (bounded: a thread per client, and n past the endpoint's 64 fails every request, counted as
    # "failed", which reads as a slow endpoint rather than a mistake)
    if clients > 4096 or client_processes > 256 or n > 64 or repeats > 100:
        raise UserError("--clients must be at most 4096, --client-processes 256, --n 64 (the endpoint's limit) and "
                        "--repeats 100")
    recipe = load_recipe(file, overrides).recipe
    key = recipe.serve.api_key if recipe.serve else ""
    console = Console()
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        runs = Path(tmp) / "runs"
        cmd = [sys.executable, "-m", "streamrl", "serve", file, "--plain", "--no-report", "--set", "serve.port=0",
               "--set", f'run.out_dir="{runs}"', "--set", "run.steps=100000", "--set", "run.step_timeout_s=0",
               *[x for o in overrides for x in ("--set", o)]]
        log = open(Path(tmp) / "serve.log", "w")
        # (a session of its own: a Ctrl-C at the terminal reaches this command alone, which stops
        # the endpoint with one signal -- a second one, the terminal's, means "stop at once")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                start_new_session=True, preexec_fn=_stop_with_parent)
        try:
            info = _wait_for_endpoint(runs, proc, Path(tmp) / "serve.log")
            console.print(f"endpoint {info['url']} ({clients} clients in {client_processes} process(es) x "
                          f"{seconds:.0f} s a phase, n = {n})")
            models = _models(info["url"], key) if all_models else info["model"]
            rows = []
            metrics = Path(info["run_dir"]) / "metrics.jsonl"
            for i in range(repeats):
                for learning in ((False, True) if i % 2 == 0 else (True, False)):
                    if not learning:  # (the feedback an "on" phase left still trains: off means none does)
                        _quiet(metrics, proc)
                    before, steps_before = _host(info["url"], key), _steps(metrics)
                    row = {"pass": i + 1, "learning": "on" if learning else "off",
                           **Load(info["url"], models, key, clients, seconds, n, learning,
                                  processes=client_processes).run()}
                    row.update(per_token(before, _host(info["url"], key), row["tokens"]))
                    row["steps_trained"] = _steps(metrics) - steps_before
                    rows.append(row)
                    console.print(row)
            steps = _steps(metrics)
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
            except BaseException:  # (a second Ctrl-C: in a session of its own, nothing else would stop it)
                _kill_group(proc)
                raise
            finally:
                log.close()
    ratios = {}
    for what in ("itl_p50_ms", "ttft_p50_ms", "itl_p99_ms"):
        pairs = [(on[what], off[what]) for on, off in _pairs(rows) if on[what] and off[what]]
        ratios[what] = round(statistics.median(a / b for a, b in pairs), 3) if pairs else None
    table = Table(title=f"bench serve: {file}")
    for col in ("pass", "learning", "requests", "refused", "failed", "hung", "tokens/s", "TTFT p50 ms", "TTFT p99 ms",
                "ITL p50 ms", "ITL p99 ms", "HTTP CPU us/token", "loop CPU us/token", "emit us/token"):
        table.add_column(col)
    for r in rows:
        table.add_row(*[str(x) for x in (r["pass"], r["learning"], r["requests"], r["refused"], r["failed"], r["hung"],
                                         r["tokens_per_s"], r["ttft_p50_ms"], r["ttft_p99_ms"], r["itl_p50_ms"],
                                         r["itl_p99_ms"], r["http_cpu_us"], r["loop_cpu_us"], r["emit_us"])])
    console.print(table)
    console.print(f"learning on / off (median over passes): inter-token p50 {ratios['itl_p50_ms']}, "
                  f"time to first token p50 {ratios['ttft_p50_ms']}, inter-token p99 {ratios['itl_p99_ms']}; "
                  f"{steps} training steps ran")
    result = {"rows": rows, "ratios": ratios, "training_steps": steps}
    if all_models and all("models" in r for r in rows):  # each variant's time to first token over the
        # served policy's, median over phases (one model listed: no rows by model, nothing to compare)
        served = info["model"]
        per = {}
        for m in models:
            pairs = [r["models"][m]["ttft_p50_ms"] / r["models"][served]["ttft_p50_ms"] for r in rows
                     if r["models"][m]["ttft_p50_ms"] and r["models"][served]["ttft_p50_ms"]]
            per[m] = {"ttft_p50_ms": round(statistics.median([r["models"][m]["ttft_p50_ms"] for r in rows
                                                              if r["models"][m]["ttft_p50_ms"]] or [0]), 1),
                      "ttft_over_served": round(statistics.median(pairs), 3) if pairs else None}
        result["models"] = per
        console.print("time to first token p50 by model (median over phases; x the served policy's): "
                      + ", ".join(f"{m} {v['ttft_p50_ms']} ms ({v['ttft_over_served']}x)" for m, v in per.items()))
    if out:
        Path(out).write_text(json.dumps(result, indent=1))
    return result


def _pairs(rows: list[dict]):
    by_pass: dict[int, dict[str, dict]] = {}
    for r in rows:
        by_pass.setdefault(r["pass"], {})[r["learning"]] = r
    return [(p["on"], p["off"]) for p in by_pass.values() if "on" in p and "off" in p]


def per_token(before: dict, after: dict, tokens: int) -> dict:
    """Host microseconds per streamed token over a phase, from the endpoint's host counts before
    and after it: the HTTP server's thread (``http_cpu_us``), the engine's decode loop
    (``loop_cpu_us``: decoding itself on a CPU, launching on a GPU) and the loop's hand-over of
    tokens to the served requests (``emit_us``, wall time within the loop). None where the
    endpoint could not say."""
    def us(key: str) -> float | None:
        a, b = before.get(key), after.get(key)
        return None if a is None or b is None or not tokens else round(1e6 * (b - a) / tokens, 1)

    return {"http_cpu_us": us("http_cpu_s"), "loop_cpu_us": us("decode_loop_cpu_s"), "emit_us": us("decode_loop_emit_s")}


def _host(url: str, key: str) -> dict:
    """The endpoint's host counts (``GET /v1/serve/stats``'s ``host``); empty if it cannot say."""
    req = urllib.request.Request(f"{url}/serve/stats", headers={"Authorization": f"Bearer {key or 'none'}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read()).get("host") or {}
    except (OSError, ValueError):
        return {}


def _models(url: str, key: str) -> list[str]:
    """What ``GET /v1/models`` lists."""
    req = urllib.request.Request(f"{url}/models", headers={"Authorization": f"Bearer {key or 'none'}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return [m["id"] for m in json.loads(r.read())["data"]]


def _wait_for_endpoint(runs: Path, proc: subprocess.Popen, log: Path) -> dict:
    deadline = time.time() + 300
    while time.time() < deadline:
        found = list(runs.glob("*/serve.json"))
        if found:
            return {**json.loads(found[0].read_text()), "run_dir": str(found[0].parent)}
        if proc.poll() is not None:
            raise UserError("bench serve: streamrl serve ended before serving: "
                            + " ".join(log.read_text().strip().splitlines()[-1:]))
        time.sleep(0.5)
    raise UserError("bench serve: the endpoint did not start within 300 s")
