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
