"""Predict a split's samples/s and bubbles: the controller's run replayed in virtual time.

An event simulation of what ``run/controller.py`` and ``flow/modes.py`` do, on a
:class:`~streamrl.planning.profile.StageProfile` instead of a cluster:

* ``generate`` instances decode with continuous batching (all running requests advance one token
  per step; a step costs ``c0 + per_context_token * context``; new requests join at once, while
  the KV cache and ``max_running`` allow, after their prefill). Each prompt group goes, when
  submitted, to the instance with the fewest unfinished groups, as Dask places generate tasks.
* the trainer (``train`` devices, data parallel) trains the step's groups: in ``batch`` mode
  once all are generated, in ``stream`` / ``async`` whatever is ready whenever it runs dry;
  then one optimizer step, then every instance pauses ``weight_sync_s`` to load the policy.
* admission: ``batch`` and ``stream`` submit step ``s`` once every instance holds version
  ``s``; ``async`` runs ``flow/admission.py``'s rule (submit up to ``max_staleness`` steps
  ahead once the versions the bound requires are loaded).

Throughput and idle shares are measured as ``streamrl bench modes`` measures a real run: from
the end of the warm-up steps to the end of the last measured step (async generates
``max_staleness`` more steps that are not measured). What it leaves out: Dask's and the
controller's per-task costs, sampling noise in lengths beyond the observed groups.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass

from streamrl.flow import admission
from streamrl.planning.profile import StageProfile
from streamrl.sim.batching import ContinuousBatch, Request


@dataclass
class Prediction:
    """A split's predicted steady state."""

    generate: int
    train: int
    mode: str
    max_staleness: int
    samples_per_s: float
    step_s: float
    idle_generate: float
    idle_train: float
    weight_sync_share: float
    """Weight loading as a share of the step (per instance)."""
    generate_makespan_s: float = 0.0
    """Mean over measured steps: submission of a step's groups to its last group generated."""


@dataclass
class _Group:
    step: int
    prompt_tokens: int
    lengths: list[int]
    left: int
    done_at: float = 0.0


class _Instance:
    """One engine instance: the sim engine's batch (``sim/batching.py``) with a virtual clock that
    only moves when something happens to it."""

    def __init__(self, p: StageProfile):
        self.batch = ContinuousBatch(p.decode_c0_s, p.decode_per_context_token_s, p.prefill_per_token_s,
                                     p.kv_capacity_tokens, p.max_running)
        self.t = 0.0
        self.unfinished = 0  # groups assigned and not done (the busy clock of a generate worker)
        self.busy_since = 0.0
        self.busy: list[tuple[float, float]] = []
        self.stamp = 0

    def advance(self, until: float) -> list[Request]:
        """Decode up to time ``until`` (never past the next finish); returns the requests that
        finished exactly at the new clock."""
        b = self.batch
        if b.running and b.steps_to_next_finish() == 0:  # (an empty response: it ends where it starts)
            return b.advance(0)
        if not b.running or until <= self.t:
            self.t = max(self.t, until)
            return []
        k = b.steps_to_next_finish()
        dt = b.decode_time(k)
        if self.t + dt <= until + 1e-12:
            self.t += dt
            return b.advance(k)
        b.advance(min(b.steps_within(until - self.t), k - 1))
        self.t = until
        return []

    def next_finish(self) -> float:
        """Clock time of the next request to finish (inf when idle)."""
        b = self.batch
        return self.t + b.decode_time(b.steps_to_next_finish()) if b.running else math.inf

    def admit(self) -> None:
        """Waiting requests join the batch while they fit; their prefill delays decoding."""
        self.t += self.batch.prefill_time(self.batch.admit())

    def hold(self, now: float, delta: int) -> None:
        """One more (or one fewer) thing keeps the worker busy."""
        if self.unfinished == 0 and delta > 0:
            self.busy_since = now
        self.unfinished += delta
        if self.unfinished == 0:
            self.busy.append((self.busy_since, now))


def _overlap(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in intervals)


def predict(p: StageProfile, generate: int, train: int, mode: str = "async", max_staleness: int = 1,
            steps: int = 8, warmup: int = 1, seed: int = 0) -> Prediction:
    """Replay ``warmup + steps`` steps (plus ``max_staleness`` drain steps in async) of the
    recipe on ``generate`` instances and ``train`` training devices; see the module docstring."""
    k = max_staleness if mode == "async" else 0
    total = warmup + steps + k
    workload = p.draw_steps(total, seed)
    inst = [_Instance(p) for _ in range(generate)]
    events: list = []  # (time, seq, kind, payload)
    seq = itertools.count()
    ready: dict[int, list[_Group]] = {s: [] for s in range(total)}
    left_in_step = {s: p.prompts_per_step for s in range(total)}
    loaded_at: dict[int, float] = {0: 0.0}  # version -> time every instance holds it
    train_busy: list[tuple[float, float]] = []
    ends: list[float] = []
    rr = itertools.count()
    submitted_at: dict[int, float] = {}

    def schedule(i: int) -> None:
        it = inst[i]
        it.stamp += 1
        t = it.next_finish()
        if t < math.inf:
            heapq.heappush(events, (t, next(seq), "finish", (i, it.stamp)))

    def submit(step: int, now: float) -> float:
        """The controller submits the step's groups one after another from ``now`` (each costs it
        ``submit_per_group_s``); returns when it is done."""
        submitted_at[step] = now
        for g in workload[step]:
            now += p.submit_per_group_s
            run_until(lambda: not events or events[0][0] > now)
            grp = _Group(step, g.prompt_tokens, g.lengths, len(g.lengths))
            n0 = next(rr)
            i = min(range(generate), key=lambda j: (inst[j].unfinished, (j - n0) % generate))
            it = inst[i]
            for r in it.advance(now):
                finish(i, r)
            it.hold(now, +1)
            for length in g.lengths:
                it.batch.add(g.prompt_tokens, length, 0.0, grp)
            it.admit()
            schedule(i)
        return now

    def publish(version: int, now: float) -> float:
        """Every instance pauses to load ``version``; returns when all hold it."""
        done = now
        for i, it in enumerate(inst):
            for r in it.advance(now):  # finishes exactly at ``now`` still count
                finish(i, r)
            it.hold(now, +1)
            it.t = max(it.t, now) + p.weight_sync_s
            it.hold(it.t, -1)
            done = max(done, it.t)
            schedule(i)
        loaded_at[version] = done
        return done

    def finish(i: int, r: Request) -> None:
        g = r.payload
        g.left -= 1
        if g.left == 0:
            g.done_at = inst[i].t
            inst[i].hold(inst[i].t, -1)
            ready[g.step].append(g)
            left_in_step[g.step] -= 1

    def run_until(cond) -> float:
        """Process generation events until ``cond()`` holds; returns the clock."""
        now = 0.0
        while not cond():
            if not events:
                raise RuntimeError("plan: the replay ran out of events (a group never finished)")
            t, _, _kind, (i, stamp) = heapq.heappop(events)
            it = inst[i]
            if stamp != it.stamp:
                continue
            now = t
            for r in it.advance(t):
                finish(i, r)
            it.admit()
            schedule(i)
        return now

    def train_step(step: int, start: float) -> float:
        """Train the step's groups from ``start``, whatever is ready each time the trainer runs
        dry (in batch mode all are ready by ``start``); returns when the optimizer step ends."""
        t, taken = start, 0
        while taken < p.prompts_per_step:
            run_until(lambda: not events or events[0][0] > t)  # everything finished by ``t``
            if len(ready[step]) == taken:  # nothing ready: the trainer waits for the next group
                run_until(lambda: len(ready[step]) > taken)
                t = max(t, ready[step][taken].done_at)
                continue
            avail = ready[step][taken:]
            tokens = sum(g.prompt_tokens * len(g.lengths) + sum(g.lengths) for g in avail)
            dt = tokens * p.train_per_token_s / train
            train_busy.append((t, t + dt))
            t += dt
            taken += len(avail)
        dt = p.optimizer_step_s / train
        train_busy.append((t, t + dt))
        return t + dt

    # -- the controller's loop ----------------------------------------------------------
    now = 0.0
    next_to_admit = 0
    loaded_version = 0
    for step in range(total):
        if mode == "async":
            plan = admission.plan(step, k, total - 1, next_to_admit, loaded_version)
            start = max(now + p.step_overhead_s, loaded_at[plan.wait_for_version])
            loaded_version = max(loaded_version, plan.wait_for_version)
            run_until(lambda: not events or events[0][0] > start)
            for g in plan.admit:
                start = submit(g, start)
                next_to_admit = g + 1
        else:
            start = max(now, loaded_at[step]) + p.step_overhead_s
            run_until(lambda: not events or events[0][0] > start)
            start = submit(step, start)
        if mode == "batch":
            t_gen = run_until(lambda: left_in_step[step] == 0)
            end = train_step(step, max(start, t_gen))
        else:
            end = train_step(step, start)
        run_until(lambda: not events or events[0][0] > end)
        done = publish(step + 1, end)
        now = done if mode != "async" else end
        ends.append(now)

    lo, hi = ends[warmup - 1] if warmup else 0.0, ends[warmup + steps - 1]
    window = max(hi - lo, 1e-12)
    gen_busy = sum(_overlap(it.busy + ([(it.busy_since, hi)] if it.unfinished else []), lo, hi) for it in inst)
    return Prediction(
        generate=generate, train=train, mode=mode, max_staleness=k,
        samples_per_s=steps * p.prompts_per_step * p.samples_per_prompt / window,
        step_s=window / steps,
        idle_generate=1.0 - gen_busy / (window * generate),
        idle_train=1.0 - _overlap(train_busy, lo, hi) / window,
        weight_sync_share=p.weight_sync_s / (window / steps),
        generate_makespan_s=sum(max(g.done_at for g in ready[s]) - submitted_at[s]
                                for s in range(warmup, warmup + steps)) / steps)

