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

from collections import deque
from dataclasses import dataclass, field
from functools import partial
import random
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from streamrl.api import Engine, RequestsNow
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

#: Finished samples an engine remembers for :meth:`SimEngine.requests_now` (a run without a
#: straggler mover never asks).
FINISHED_KEPT = 8192


@dataclass(eq=False)
class _Job:
    """One sample's request in the batch."""

    uid: str
    prompt_tokens: int
    before: int  # response tokens it brought along (continued from another instance)
    movable: bool = False
    future: Future = field(default_factory=Future)  # (end time, tokens when moved out or None)
    request: Any = None
    end: float = 0.0


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
                                     max_running=config.max_running, moves_samples=True,
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
        self.jobs: dict[str, _Job] = {}  # sample uid -> its request, while it waits or runs
        # (uid, length) of samples finished since requests_now; bounded, as nothing may ask
        self.finished: deque[tuple[str, int]] = deque(maxlen=FINISHED_KEPT)
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
        return self.generate_movable(prompt, samples, priority, None)

    def generate_movable(self, prompt: Prompt, samples: list[int], priority: float, on_moved) -> Group:
        """As :meth:`generate_samples`; a sample taken out (:meth:`move_out`) is handed to
        ``on_moved`` at once, and what it returns finishes it."""
        start, version = time.time(), self.version
        jobs = []
        with self.cv:
            for k in samples:
                job = _Job(f"{prompt.uid}-{k}", prompt.answer["prompt_tokens"], 0, movable=on_moved is not None)
                job.request = self.batch.add(job.prompt_tokens, self._length(prompt, k), priority, job)
                self.jobs[job.uid] = job
                jobs.append(job)
            self.cv.notify()
        pending = {job.future: job for job in jobs}
        handed = {}
        # wait for whichever ends first, so a moved sample goes on elsewhere at once
        while pending:
            done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
            for f in done:
                job = pending.pop(f)
                end, moved = f.result()
                if moved is not None:
                    handed[job.uid] = on_moved(self._sample(prompt, job.uid, moved, [version] * moved, start, end,
                                                            {"moved": end}))
                else:
                    job.end = end
        return [handed[job.uid].result() if job.uid in handed else
                self._sample(prompt, job.uid, job.request.length, [], start, job.end, {}, version)
                for job in jobs]

    def continue_sample(self, partial: Sample, priority: float = 0.0) -> Sample:
        """Finish a sample another instance took out: prefill its prompt and tokens so far, then
        decode the rest of the length it was always going to have. Moves once: a continued sample
        is not offered to the mover again."""
        k = int(partial.uid.rsplit("-", 1)[1])
        done = len(partial.response_ids)
        total = self._length(partial.prompt, k)
        version = self.version
        with self.cv:
            job = _Job(partial.uid, partial.prompt.answer["prompt_tokens"], done, movable=False)
            job.request = self.batch.add(job.prompt_tokens + done, max(total - done, 1), priority, job)
            self.jobs[job.uid] = job
            self.cv.notify()
        end, _ = job.future.result()
        versions = list(partial.token_versions or [partial.policy_version] * done)
        versions += [version] * (done + job.request.length - len(versions))
        return self._sample(partial.prompt, partial.uid, len(versions), versions,
                            partial.times.get("gen_start", end), end, {"moved": partial.times.get("moved", end)})

    def requests_now(self) -> RequestsNow:
        """The samples decoding now, and those finished since the last call."""
        with self.cv:
            running = [(r.payload.uid, r.payload.before + self.batch.generated(r), r.payload.prompt_tokens,
                        r.payload.movable) for r in self.batch.running]
            finished = list(self.finished)
            self.finished.clear()
        return RequestsNow(running, finished)

    def move_out(self, uid: str) -> bool:
        """Take running sample ``uid`` out now, with the tokens it has."""
        with self.cv:
            job = self.jobs.get(uid)
            if job is None or not job.movable or job.request not in self.batch.running:
                return False
            done = self.batch.remove(job.request)
            del self.jobs[uid]
            job.future.set_result((time.time(), done))
        return True

    def _length(self, prompt: Prompt, k: int) -> int:
        return sample_length(prompt, random.Random(f"{self.config.seed}-{prompt.uid}-{k}"))

    @staticmethod
    def _sample(prompt: Prompt, uid: str, length: int, versions: list[int], start: float, end: float,
                extra: dict, version: int | None = None) -> Sample:
        return Sample(uid=uid, prompt=prompt, prompt_ids=range(prompt.answer["prompt_tokens"]),
                      response_ids=range(length), logprobs=[], response_text=f"[simulated: {length} tokens]",
                      policy_version=min(versions) if versions else version, token_versions=versions,
                      times={"gen_start": start, "gen_end": end, **extra})

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
                    job = r.payload
                    self.jobs.pop(job.uid, None)
                    self.finished.append((job.uid, job.before + r.length))
            for r in finished:
                r.payload.future.set_result((done_at, None))

    def load_weights(self, named_tensors, version: int) -> None:
        """Simulate receiving the weights: decoding pauses for the broadcast time."""
        with self.paused:
            time.sleep(latency.weight_sync_time(self.profile) * self.config.time_scale)
            self.version = version

    def close(self) -> None:
        """Stop the decode loop."""
        self.closed.set()
