"""The ``sim`` engine: continuous batching on a latency model, in scaled real time.

One instance per generate worker, like a real engine on one GPU. Requests wait in a queue
(highest ``priority`` first, then arrival order), are admitted into the running batch while the
KV cache has room (and at most ``max_running`` run at once), and all running requests advance
one token per decode step, each step costing :func:`streamrl.sim.latency.step_latency`. Rather
than sleeping per token, the loop jumps a whole *chunk* of decode steps -- up to the next
finishing request, or ``quantum_s`` of real time so new arrivals get in soon -- and sleeps the
chunk's cost times ``time_scale``. Output lengths come from the task (``sample_length``).

Simplification, said plainly: the KV check happens at admission on the current context; a batch
may outgrow the cache afterwards (a real engine would preempt). Everything it reports is
*simulated*.
"""

from __future__ import annotations

import itertools
from functools import partial
import random
import threading
import time
from concurrent.futures import Future

from pydantic import BaseModel, ConfigDict, Field

from streamrl.api import Engine
from streamrl.sample import Group, Prompt, Sample
from streamrl.sim import latency
from streamrl.sim.latency import Profile
from streamrl.sim.workload import sample_length


class SimEngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    profile: Profile = Profile()
    """The simulated model and device (``[engine.profile]``); defaults: 7B-class on H800-class."""
    time_scale: float = Field(0.01, gt=0)
    """Real seconds per simulated second (0.01: a simulated minute takes 0.6 s)."""
    max_running: int = Field(0, ge=0)
    """Most requests decoding at once on an instance (0: only the KV cache limits it)."""
    quantum_s: float = Field(0.02, gt=0)
    """Real seconds between scheduling decisions of the decode loop (new requests join then)."""
    seed: int = 0
    """Seed of the sampled output lengths (a sample's length depends only on it and its id)."""


class _Request:
    __slots__ = ("rid", "prompt_tokens", "remaining", "context", "priority", "order", "future")

    def __init__(self, rid, prompt_tokens, length, priority, order):
        self.rid, self.prompt_tokens, self.remaining = rid, prompt_tokens, length
        self.context, self.priority, self.order = prompt_tokens, priority, order
        self.future: Future = Future()


class SimEngine(Engine):
    """A simulated inference instance (built on a generate worker)."""

    needs_model = False

    @classmethod
    def simulated_time_scale(cls, config: SimEngineConfig) -> float:
        """``time_scale``: everything this engine reports is simulated."""
        return config.time_scale

    def __init__(self, config: SimEngineConfig):
        self.config = config
        self.profile = config.profile
        self.capacity = latency.kv_capacity_tokens(self.profile)
        self.version = 0
        self.waiting: list[_Request] = []
        self.running: list[_Request] = []
        self.cv = threading.Condition()
        self.paused = threading.Lock()  # held while weights load: decoding stops, as on a real engine
        self.closed = threading.Event()
        self.counter = itertools.count()
        self.busy_sim_s = 0.0
        """Simulated seconds this instance spent decoding or prefilling."""

    def load(self, model_path: str | None = None) -> None:
        """Start the decode loop (there is no model to load)."""
        self.thread = threading.Thread(target=self._loop, name="streamrl-sim-engine", daemon=True)
        self.thread.start()

    def decode_latency(self):
        """Seconds of one decode step as a function of the batch's total context tokens (what
        the skew scheduler uses to estimate makespans): the cost model itself."""
        return partial(latency.step_latency, self.profile)

    def generate(self, prompt: Prompt, n: int, priority: float = 0.0) -> Group:
        """Simulate ``n`` samples of ``prompt``; blocks until all finish."""
        start = time.time()
        version = self.version
        reqs = []
        for k in range(n):
            rid = f"{prompt.uid}-{k}"
            length = sample_length(prompt, random.Random(f"{self.config.seed}-{rid}"))
            reqs.append(_Request(rid, prompt.answer["prompt_tokens"], length, priority, next(self.counter)))
        with self.cv:
            self.waiting.extend(reqs)
            self.waiting.sort(key=lambda r: (-r.priority, r.order))
            self.cv.notify()
        group = []
        for r in reqs:
            end = r.future.result()
            length = r.context - r.prompt_tokens
            group.append(Sample(
                uid=r.rid, prompt=prompt, prompt_ids=range(r.prompt_tokens), response_ids=range(length),
                logprobs=[], response_text=f"[simulated: {length} tokens]", policy_version=version,
                times={"gen_start": start, "gen_end": end}))
        return group

    def _admit(self) -> int:
        """Move waiting requests into the batch while they fit; returns prompt tokens to prefill."""
        limit = self.config.max_running or 1 << 30
        context = sum(r.context for r in self.running)
        prefill = 0
        while self.waiting and len(self.running) < limit:
            r = self.waiting[0]
            if self.running and context + r.prompt_tokens > self.capacity:
                break
            self.waiting.pop(0)
            self.running.append(r)
            context += r.prompt_tokens
            prefill += r.prompt_tokens
        return prefill

    def _loop(self) -> None:
        p, scale = self.profile, self.config.time_scale
        prev_end = 0.0
        while not self.closed.is_set():
            with self.cv:
                prefill = self._admit()
                if not self.running:
                    self.cv.wait(0.05)
                    prev_end = 0.0
                    continue
                batch = list(self.running)
            n = len(batch)
            context = sum(r.context for r in batch)
            steps = min(min(r.remaining for r in batch),
                        max(1, latency.steps_within(p, context, n, self.config.quantum_s / scale)))
            sim_s = latency.prefill_time(p, prefill) + latency.decode_time(p, context, n, steps)
            with self.paused:
                now = time.time()
                # continue from the previous chunk's end unless we fell behind: keeps sleep
                # overshoot from accumulating into the simulated clock
                begin = prev_end if prev_end and now - prev_end < 0.005 else now
                prev_end = begin + sim_s * scale
                time.sleep(max(0.0, prev_end - now))
            self.busy_sim_s += sim_s
            done_at = time.time()
            with self.cv:
                for r in batch:
                    r.remaining -= steps
                    r.context += steps
                finished = [r for r in batch if r.remaining <= 0]
                self.running = [r for r in self.running if r.remaining > 0]
            for r in finished:
                r.future.set_result(done_at)

    def load_weights(self, named_tensors, version: int) -> None:
        """Simulate receiving the weights: decoding pauses for the broadcast time."""
        with self.paused:
            time.sleep(latency.weight_sync_time(self.profile) * self.config.time_scale)
            self.version = version

    def close(self) -> None:
        """Stop the decode loop."""
        self.closed.set()
