"""A side learner's failure as the run shows it (``learners/fanout.Fanout.fail``); the learners
themselves are tests/test_learners.py's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from streamrl.errors import RunWarning
from streamrl.learners.fanout import Fanout


def test_a_learners_failure_is_its_first_line_printable_and_bounded():
    fanout = SimpleNamespace(client=SimpleNamespace(cancel=lambda futures: None))
    lr = SimpleNamespace(name="a", state="training", failure=None, inflight=[], evaluator=None)
    exc = RuntimeError("\x1b[2Jthe reward's text \x1b]0;owned\x07" + "x" * 1000 + "\nsecond line")
    with pytest.warns(RunWarning):
        Fanout.fail(fanout, lr, 4, exc)
    assert lr.state == "failed" and lr.failure.startswith("step 4: RuntimeError: \\x1b[2Jthe reward's text \\x1b]0;")
    assert lr.failure.isprintable() and len(lr.failure) <= 300 and "second line" not in lr.failure
