"""A side learner's failure as the run shows it (``learners/fanout.Fanout.fail``); the learners
themselves are tests/test_learners.py's."""

from __future__ import annotations

import time
from pathlib import Path
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


def test_a_learner_whose_worker_is_gone_for_good_is_failed_not_waited_for(monkeypatch):
    # its tasks are pinned to its worker: gone (a cluster that took it back, a nanny that could
    # not restart it), they wait for ever, and so did a pacing stream, a checkpoint's drain and
    # the removal of another learner
    from distributed import Client, LocalCluster

    from streamrl.learners import fanout as module
    from streamrl.learners.fanout import InFlight, SideLearner

    monkeypatch.setattr(module, "LOST_AFTER_S", 0.5)
    monkeypatch.setattr(module, "LOOK_EVERY_S", 0.1)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, protocol="tcp://", host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster) as client:
        never = client.submit(lambda: 1, resources={"worker:learner-gone": 1}, pure=False)  # (no such worker)
        plan = SimpleNamespace(name="gone", worker="learner-gone", queue=1, when_full="pace")
        lr = SideLearner(plan=plan, view=None, inflight=[InFlight(3, [never], [], 0.0)])
        here = client.submit(lambda: 2, pure=False)
        fan = module.Fanout(client, SimpleNamespace(), [lr])
        with pytest.warns(RunWarning, match="learner 'gone' failed at step 4: RuntimeError: its worker learner-gone "
                                            "has been gone for"):
            fan.hand_over(4, [here])  # (a pacing learner whose queue is full: waited for, until found gone)
        assert lr.state == "failed" and not lr.inflight and never.cancelled()
        # nothing is asked of that worker again: its policy is not waited for at the end
        with pytest.warns(RunWarning, match="learner 'gone': policy not saved \\(its worker learner-gone is gone"):
            assert fan.save_policies(Path("/nonexistent"), only=["gone"]) == {}
        # one whose worker is up is left training, however long it looks
        (up,) = [str(w["name"]) for w in client.scheduler_info()["workers"].values()]
        kept = SideLearner(plan=SimpleNamespace(name="kept", worker=up, queue=2, when_full="pace"), view=None)
        fan.add(kept)
        fan.look(4)
        time.sleep(0.6)
        fan.look(5)
        assert kept.state == "training" and kept.gone_since is None
        # a checkpoint's drain: no longer waits for it either
        lr2 = SideLearner(plan=SimpleNamespace(name="gone2", worker="learner-gone", queue=2, when_full="skip"),
                          view=None, inflight=[InFlight(5, [client.submit(lambda: 1, resources={"worker:learner-gone": 1},
                                                                          pure=False)], [], 0.0)])
        fan.add(lr2)
        with pytest.warns(RunWarning, match="learner 'gone2' failed"):
            fan.drain(timeout=30)
        assert lr2.state == "failed"


def test_a_step_its_starting_weights_already_hold_is_not_handed_to_a_learner_added_from_them():
    # ``learners add`` from the served policy in async mode: the next step's training may have
    # run before the policy was saved, and the learner joins after it (steps before its
    # joined_at are in its weights: trained again, they would count twice)
    from streamrl.learners.fanout import SideLearner

    fan = Fanout(SimpleNamespace(), SimpleNamespace())  # (no scheduler to ask: the look is skipped)
    lr = SideLearner(plan=SimpleNamespace(name="late", worker="learner-late", queue=2, when_full="skip"),
                     view=None, joined_at=5)
    fan.add(lr)
    fan.hand_over(4, [object()])
    assert not lr.inflight and lr.skipped_steps == 0
    with pytest.raises(AttributeError):  # (step 5 is its: submitted, here to a learner with no view)
        fan.hand_over(5, [object()])


def test_a_learner_added_again_under_its_name_reports_what_the_one_before_trained_since_the_last_record():
    # (`learners add --resume` of a failed learner between two records): its rows of steps
    # trained and its evaluations not recorded yet went with the entry it replaced
    from streamrl.learners.fanout import SideLearner

    def learner(**fields):
        return SideLearner(plan=SimpleNamespace(name="b", worker="learner-b", queue=2, when_full="skip",
                                                served=False, algorithm=SimpleNamespace(
                                                    component=SimpleNamespace(name="rloo"))),
                           view=None, **fields)

    fan = Fanout(SimpleNamespace(), SimpleNamespace())
    fan.add(learner(state="failed", trained=[[3, 16, 123]], unrecorded=[{"eval/pass@1": 0.5}]))
    fan.add(learner())
    (row,) = fan.harvest()["b"]["trained"]
    assert row == [3, 16, 123] and fan.learners["b"].state == "training"
