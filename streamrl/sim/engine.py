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

from functools import partial
import random
import threading
import time
from concurrent.futures import Future

from pydantic import BaseModel, ConfigDict, Field

from streamrl.api import Engine
from streamrl.sample import Group, Prompt, Sample
from streamrl.sim import latency
from streamrl.sim.batching import ContinuousBatch
from streamrl.sim.capabilities import SimEngineCapabilities
from streamrl.sim.latency import Profile
from streamrl.sim.workload import sample_length


#: Real seconds an instance may fall behind its simulated clock and still catch up (by not
#: sleeping) rather than lose the time. On a busy machine a sleeping decode loop wakes late,
#: often by milliseconds; losing that on every chunk would run the simulated cluster slower
#: than its cost model says (measured: ~20% slower generation on 2 cores with 8 instances).
CATCH_UP_S = 0.25


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


class SimEngine(Engine):
    """A simulated inference instance (built on a generate worker)."""

    @classmethod
    def capabilities(cls, config: SimEngineConfig) -> SimEngineCapabilities:
        """No model; the cost model (everything this engine reports is simulated), and its batch
        limits as ``streamrl plan`` models them."""
        return SimEngineCapabilities(profile=config.profile, time_scale=config.time_scale, seed=config.seed,
                                     max_running=config.max_running,
                                     kv_capacity_tokens=latency.kv_capacity_tokens(config.profile))

    def __init__(self, config: SimEngineConfig):
        self.config = config
        self.profile = config.profile
        self.capacity = latency.kv_capacity_tokens(self.profile)
        self.version = 0
        self.batch = ContinuousBatch(*latency.decode_coefficients(self.profile),
                                     latency.prefill_time(self.profile, 1), self.capacity, config.max_running)
        self.cv = threading.Condition()
        self.paused = threading.Lock()  # held while weights load: decoding stops, as on a real engine
        self.closed = threading.Event()
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
        return self.generate_samples(prompt, list(range(n)), priority)

    def generate_samples(self, prompt: Prompt, samples: list[int], priority: float = 0.0) -> Group:
        """Simulate the samples numbered ``samples`` of ``prompt``'s group (each one's length
        depends on its number, so a chunk of a group gets the lengths the whole group would)."""
        start = time.time()
        version = self.version
        with self.cv:
            reqs = [self.batch.add(prompt.answer["prompt_tokens"],
                                   sample_length(prompt, random.Random(f"{self.config.seed}-{prompt.uid}-{k}")),
                                   priority, Future()) for k in samples]
            self.cv.notify()
        group = []
        for k, r in zip(samples, reqs):
            end = r.payload.result()
            group.append(Sample(
                uid=f"{prompt.uid}-{k}", prompt=prompt, prompt_ids=range(r.prompt_tokens), response_ids=range(r.length),
                logprobs=[], response_text=f"[simulated: {r.length} tokens]", policy_version=version,
                times={"gen_start": start, "gen_end": end}))
        return group

    def _loop(self) -> None:
        scale, batch = self.config.time_scale, self.batch
        prev_end = 0.0
        while not self.closed.is_set():
            with self.cv:
                prefill = batch.admit()
                if not batch.running:
                    self.cv.wait(0.05)
                    prev_end = 0.0
                    continue
                steps = min(batch.steps_to_next_finish(), max(1, batch.steps_within(self.config.quantum_s / scale)))
                sim_s = batch.prefill_time(prefill) + batch.decode_time(steps)
            with self.paused:
                now = time.time()
                # continue from the previous chunk's end (a late wake-up is caught up by
                # sleeping less next time) unless the loop was idle or fell far behind
                begin = prev_end if prev_end and now - prev_end < CATCH_UP_S else now
                prev_end = begin + sim_s * scale
                time.sleep(max(0.0, prev_end - now))
            self.busy_sim_s += sim_s
            done_at = time.time()
            with self.cv:
                finished = batch.advance(steps)
            for r in finished:
                r.payload.set_result(done_at)

    def load_weights(self, named_tensors, version: int) -> None:
        """Simulate receiving the weights: decoding pauses for the broadcast time."""
        with self.paused:
            time.sleep(latency.weight_sync_time(self.profile) * self.config.time_scale)
            self.version = version

    def close(self) -> None:
        """Stop the decode loop."""
        self.closed.set()
