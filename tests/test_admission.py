"""Async admission control as a pure function, checked over random timings (hypothesis).

A small discrete-event model of the async pipeline drives :func:`streamrl.flow.admission.plan`
the way the controller does: per step, wait for the loads the plan asks for, submit what it
admits, train once the step's samples are generated, publish the next version (which lands on
each generate worker after its own random delay). Each sample is stamped with the newest version
its worker holds when its generation starts.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl.flow.admission import plan, required_version


@st.composite
def pipelines(draw):
    steps = draw(st.integers(1, 8))
    k = draw(st.integers(0, 3))
    workers = draw(st.integers(1, 3))
    dur = st.floats(0.0, 10.0, allow_nan=False)
    return {
        "steps": steps, "k": k, "workers": workers,
        "gen": [[draw(dur) for _ in range(workers)] for _ in range(steps)],        # per step, per worker
        "queue": [[draw(dur) for _ in range(workers)] for _ in range(steps)],      # wait before gen starts
        "train": [draw(dur) for _ in range(steps)],
        "load": [[draw(dur) for _ in range(workers)] for _ in range(steps + 1)],   # per version, per worker
    }


def simulate(p):
    """Run the model; returns {step: [versions of its samples]} and the admission order."""
    k, n, w = p["k"], p["steps"], p["workers"]
    land = {0: [0.0] * w}  # version -> time it is loaded on each worker
    t, next_to_admit, loaded = 0.0, 0, 0
    versions, gen_end, admitted = {}, {}, []
    for s in range(n):
        pl = plan(s, k, n - 1, next_to_admit, loaded)
        assert pl.wait_for_version <= s, "would wait for a version not yet published (deadlock)"
        for v in range(loaded + 1, pl.wait_for_version + 1):
            t = max([t] + land[v])
        loaded = max(loaded, pl.wait_for_version)
        for g in pl.admit:
            admitted.append(g)
            next_to_admit = g + 1
            versions[g], ends = [], []
            for j in range(w):
                start = t + p["queue"][g][j]
                # newest version already landed on worker j (later publications land after t,
                # so ignoring them can only make the sample look older: a conservative check)
                versions[g].append(max(v for v, times in land.items() if times[j] <= start))
                ends.append(start + p["gen"][g][j])
            gen_end[g] = max(ends)
        assert s in versions, f"step {s} trained before its generation was admitted"
        t = max(t, gen_end[s]) + p["train"][s]
        land[s + 1] = [t + d for d in p["load"][s + 1]]
    return versions, admitted


@settings(max_examples=300, deadline=None)
@given(pipelines())
def test_staleness_bound_is_never_exceeded(p):
    versions, admitted = simulate(p)
    for step, vs in versions.items():
        assert step - min(vs) <= p["k"], (step, vs)
    # every step admitted exactly once, in order: nothing dropped, nothing generated twice
    assert admitted == list(range(p["steps"]))


@settings(max_examples=100, deadline=None)
@given(pipelines())
def test_generation_runs_ahead_when_allowed(p):
    # with k >= 1, step 1 is admitted before step 0 trains (otherwise async would be stream)
    first = plan(0, p["k"], p["steps"] - 1, 0, 0)
    assert first.admit == tuple(range(min(p["k"], p["steps"] - 1) + 1))
    assert first.wait_for_version == 0


def test_required_version():
    assert [required_version(g, 1) for g in range(4)] == [0, 0, 1, 2]
    assert [required_version(g, 0) for g in range(3)] == [0, 1, 2]


# -- dynamic micro-batches (on_worker/microbatch.py) ------------------------------------------------

from streamrl.on_worker.microbatch import pack  # noqa: E402


def test_pack_respects_the_budget_and_keeps_order():
    assert pack([30, 30, 30, 50, 10], budget=64) == [[0, 1], [2], [3, 4]]
    assert pack([100, 5], budget=64) == [[0], [1]]  # an oversized group is alone, never split
    assert pack([1, 1, 1], budget=0, max_items=2) == [[0, 1], [2]]
    assert pack([], budget=64) == []


@given(st.lists(st.integers(1, 200), max_size=40), st.integers(0, 300), st.integers(0, 5))
def test_pack_uses_every_item_once_in_order(sizes, budget, max_items):
    cuts = pack(sizes, budget, max_items)
    assert [i for c in cuts for i in c] == list(range(len(sizes)))
    for c in cuts:
        assert c, "no empty micro-batch"
        if budget and len(c) > 1:
            assert sum(sizes[i] for i in c) <= budget
        if max_items:
            assert len(c) <= max_items
