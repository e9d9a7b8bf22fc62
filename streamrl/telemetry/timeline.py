"""Who was busy when: per-worker busy intervals rebuilt from ``metrics.jsonl``'s ``sample_log``.

The report's bubble picture (one row per worker, a bar while it worked) is drawn from these.
Each sample's log line carries epoch-second times; what they prove about each worker:

* **generate** (exact): the sample's worker (``worker``) had it in its engine from ``gen_start``
  to ``gen_end``. Overlapping samples merge into one bar (a batch of requests in flight).
* **reward** (an upper bound): no reward worker is logged, only when each group was scored
  (``reward_end``, one value per scoring call). A group could not be scored before its last
  sample was generated, so the bar runs from that ``gen_end`` to ``reward_end``; it includes the
  transfer and any wait in the reward queue. The pool is one row.
* **train** (an upper bound, tight on a one-thread worker): the samples of one train task share
  ``trained_on`` and ``trained`` (when the task ended). It could not start before its last sample
  was scored, nor, on a worker running one task at a time, before that worker's previous task
  or optimizer step ended; the bar runs from the later of those to ``trained``.
* **optimizer step** (an upper bound): after a step's last train task (the optimizer step takes
  them all as inputs) until the controller heard it was done (``time - weight_sync_s``), on
  every train worker of the step.

Weight loads on the generate workers and the controller's own work are not in the log: they
show as gaps.
"""

from __future__ import annotations

from dataclasses import dataclass

GENERATE, REWARD, TRAIN, OPTIMIZER = "generate", "reward", "train", "optimizer step"
KINDS = (GENERATE, REWARD, TRAIN, OPTIMIZER)
REWARD_ROW = "reward pool"


@dataclass(frozen=True)
class Bar:
    """One busy interval of a worker, in epoch seconds."""

    start: float
    end: float
    kind: str
    """One of :data:`KINDS`."""


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` intervals, sorted and non-overlapping (touching ones join)."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def busy_bars(records: list[dict], serial_train: bool = True) -> dict[str, list[Bar]]:
    """Every worker's busy bars over ``records`` (consecutive ``metrics.jsonl`` records, oldest
    first), keyed by row: each generate worker, :data:`REWARD_ROW`, each train worker (in that
    order; a colocated worker's generate bars are on its train row). ``serial_train``: train
    workers run one task at a time (``pools.train.threads = 1``), so a task starts no earlier
    than the worker's previous one ended. See the module docstring for what each bar is drawn
    from."""
    gen: dict[str, list[tuple[float, float]]] = {}
    reward: list[tuple[float, float]] = []
    train: dict[str, list[Bar]] = {}
    prev_end: dict[str, float] = {}  # per train worker: its last task's or optimizer step's end
    for rec in records:
        # one scoring call per reward_end value; one train task per (trained_on, trained)
        scored: dict[float, float] = {}
        tasks: dict[tuple[str, float], float] = {}
        for s in rec.get("sample_log", ()):
            g0, g1 = s.get("gen_start"), s.get("gen_end")
            if g0 is not None and g1 is not None and s.get("worker") is not None:
                gen.setdefault(str(s["worker"]), []).append((g0, g1))
            r1 = s.get("reward_end")
            if r1 is not None and g1 is not None:
                scored[r1] = max(scored.get(r1, g1), g1)
            t1, on = s.get("trained"), s.get("trained_on")
            if t1 is not None and on is not None:
                ready = r1 if r1 is not None else g1
                key = (str(on), t1)
                tasks[key] = max(tasks.get(key, ready), ready) if ready is not None else tasks.get(key, t1)
        reward += [(min(g1, r1), r1) for r1, g1 in scored.items()]
        for (worker, t1), ready in sorted(tasks.items(), key=lambda kv: kv[0][1]):
            start = max(ready, prev_end.get(worker, ready)) if serial_train else ready
            train.setdefault(worker, []).append(Bar(min(start, t1), t1, TRAIN))
            prev_end[worker] = t1
        if tasks and "time" in rec:
            last_trained = max(t1 for _, t1 in tasks)
            stepped = rec["time"] - rec.get("weight_sync_s", 0.0)
            for worker in {w for w, _ in tasks}:
                train[worker].append(Bar(last_trained, max(last_trained, stepped), OPTIMIZER))
                prev_end[worker] = max(last_trained, stepped)
    # one row per worker: one that generates and trains (colocated) has both kinds of bar
    rows: dict[str, list[Bar]] = {}
    for worker in sorted(set(gen) - set(train)):
        rows[worker] = [Bar(a, b, GENERATE) for a, b in merge(gen[worker])]
    if reward:
        rows[REWARD_ROW] = [Bar(a, b, REWARD) for a, b in merge(reward)]
    for worker in sorted(train):
        rows[worker] = [Bar(a, b, GENERATE) for a, b in merge(gen.get(worker, []))] + train[worker]
    return rows


def busy_fraction(bars: list[Bar], start: float, end: float) -> float:
    """Share of ``[start, end]`` covered by ``bars`` (their union, clipped to the window)."""
    span = end - start
    if span <= 0:
        return 0.0
    clipped = [(max(b.start, start), min(b.end, end)) for b in bars if b.end > start and b.start < end]
    return sum(b - a for a, b in merge(clipped)) / span
