"""The hf engine in-process (the dataflow tests drive it on real workers)."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from streamrl.engines.hf import HFEngine, HFEngineConfig
from streamrl.sample import Prompt


def test_hf_engine_generates_and_closing_it_fails_waiting_requests(tiny_model):
    engine = HFEngine(HFEngineConfig(max_new_tokens=4))
    engine.load(str(tiny_model))
    group = engine.generate(Prompt(uid="p0", text="1+2=", answer="3"), 2)
    assert [len(s.response_ids) == len(s.logprobs) for s in group] == [True, True]
    # a request the loop will never finish (as when a new engine replaces this one mid-step):
    # closing must fail it, or the task waiting on it would hang its worker thread for good
    stuck = Future()
    engine._waiting["never"] = stuck
    engine.close()
    with pytest.raises(RuntimeError, match="closed before request never finished"):
        stuck.result(timeout=5)


def test_hf_engine_admits_by_priority_under_max_running(tiny_model):
    import threading
    import time

    engine = HFEngine(HFEngineConfig(max_new_tokens=3, max_running=1))
    engine.load(str(tiny_model))
    done: dict[str, float] = {}

    def ask(uid, priority):
        group = engine.generate(Prompt(uid=uid, text="1+2=", answer="3"), 1, priority=priority)
        done[uid] = group[0].times["gen_end"]

    def until(cond):
        deadline = time.time() + 10
        while not cond():
            assert time.time() < deadline
            time.sleep(0.01)

    threads = []
    try:
        with engine.manager.pause():  # nothing finishes while the queue fills up
            for uid, priority in [("first", 0.0), ("low", 1.0), ("high", 9.0), ("mid", 5.0)]:
                threads.append(threading.Thread(target=ask, args=(uid, priority)))
                threads[-1].start()
                until(lambda: engine._running + len(engine._queue) == len(threads))
            assert engine._running == 1 and len(engine._queue) == 3  # the cap holds the rest back
        for t in threads:
            t.join(timeout=30)
        assert sorted(done, key=done.get) == ["first", "high", "mid", "low"]
    finally:
        engine.close()
