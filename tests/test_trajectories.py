"""The store of agents' rollouts on an endpoint, alone (the calculator model's tokenizer and chat
template, no server): a refused call leaves no count behind, a rollout's calls and segments are
bounded, an agent that makes up rollout ids cannot fill it, and one call's rendering does not
hold up the others'."""

from __future__ import annotations

import threading

import pytest
from transformers import AutoTokenizer

from streamrl.chat import content_as_text
from streamrl.serve import trajectories as store
from streamrl.serve.trajectories import RolloutLimit, Trajectories
from tests.helpers import ROOT

TOK = AutoTokenizer.from_pretrained(ROOT / "models" / "tiny-calculator")


def fresh(encode=None) -> Trajectories:
    return Trajectories(TOK, encode or (lambda text, contents: content_as_text.encode(TOK, text, contents)))


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def one_call(t: Trajectories, rid: str, messages: list[dict]) -> None:
    ids, seg = t.prompt(rid, messages, None)
    t.add(rid, seg, messages, ids, [5, 6], [-0.1, -0.2], [0, 0], {"role": "assistant", "content": "7"})


def test_a_call_refused_while_rendered_counts_no_call_nor_split_and_keeps_no_rollout():
    def refuses(text, contents):
        if "refused" in text:
            raise ValueError("the prompt is too long")
        return content_as_text.encode(TOK, text, contents)
    t = fresh(refuses)
    with pytest.raises(ValueError, match="too long"):
        t.prompt("alone", user("refused"), None)
    assert t.in_flight() == 0  # (its only call refused: nothing of it kept)
    one_call(t, "r", user("1+1="))
    with pytest.raises(ValueError, match="too long"):
        t.prompt("r", user("refused, a rewritten history"), None)
    one_call(t, "r", user("2+2="))  # a rewritten history: one split, counted once
    traj = t.finish("r")
    assert (traj["calls"], traj["splits"], len(traj["segments"])) == (2, 1, 2)


def test_a_rollouts_calls_and_segments_are_bounded_and_made_up_rollouts_drop_the_oldest(monkeypatch):
    monkeypatch.setattr(store, "MAX_CALLS", 3)
    t = fresh()
    for k in range(3):
        one_call(t, "loop", user(f"{k}+1="))
    with pytest.raises(RolloutLimit, match="3 calls"):
        t.prompt("loop", user("9+9="), None)
    assert t.finish("loop")["calls"] == 3
    monkeypatch.setattr(store, "MAX_CALLS", 1024)
    monkeypatch.setattr(store, "MAX_SEGMENTS", 2)
    one_call(t, "forks", user("1+1="))
    one_call(t, "forks", user("2+2="))
    with pytest.raises(RolloutLimit, match="2 segments"):
        t.prompt("forks", user("3+3="), None)
    assert t.finish("forks")["calls"] == 2  # (the refused one not counted)
    monkeypatch.setattr(store, "MAX_ROLLOUTS", 2)
    for rid in ("a", "b", "c"):
        one_call(t, rid, user("1+1="))
    assert t.in_flight() == 2 and t.dropped_stale == 1  # the oldest went, and says why when finished
    with pytest.raises(ValueError, match=r"rollout 'a' is finished: dropped, 2 rollouts being in flight"):
        t.finish("a")


def test_a_call_being_rendered_does_not_hold_the_store_for_the_others(monkeypatch):
    # a call that continues its conversation renders it around the reply (twice) and tokenizes
    # what follows: seconds for a long one, while the server's event loop ends other calls
    rendering, go_on = threading.Event(), threading.Event()
    render = store.render

    def slow(tokenizer, messages, *args, **kwargs):
        if any("slow" in m["content"] for m in messages if isinstance(m.get("content"), str)):
            rendering.set()
            assert go_on.wait(10)
        return render(tokenizer, messages, *args, **kwargs)
    monkeypatch.setattr(store, "render", slow)
    t = fresh()
    one_call(t, "agent", user("1+1="))
    then = user("1+1=") + [{"role": "assistant", "content": "7"}, {"role": "user", "content": "slow: and 2+2?"}]
    got = []
    caller = threading.Thread(target=lambda: got.append(t.prompt("agent", then, None)))
    caller.start()
    try:
        assert rendering.wait(10)
        # meanwhile: a call ends, another begins, the count is read -- none waits on that render
        ids, seg = t.prompt("r", user("3+3="), None)
        t.add("r", seg, user("3+3="), ids, [5], [-0.1], [0], {"role": "assistant", "content": "6"})
        assert t.in_flight() == 2
    finally:
        go_on.set()
        caller.join(10)
    (ids, seg), = got
    assert t.finish("agent")["splits"] == 0 and seg.busy  # it continued the first call's segment


def test_a_call_of_a_rollout_dropped_as_stale_or_crowded_out_is_refused_not_begun_anew(monkeypatch):
    # begun anew, its first turns were gone and its tail alone was trained with the whole
    # rollout's reward, without a word
    import time

    t = fresh()
    one_call(t, "slow", user("1+1="))
    monkeypatch.setattr(store, "STALE_ROLLOUT_S", 0.05)
    time.sleep(0.1)
    one_call(t, "other", user("2+2="))  # (its call sweeps the stale one)
    with pytest.raises(ValueError, match=r"rollout 'slow' is finished: dropped after 0 s without a call"):
        t.prompt("slow", user("1+1=2. And 3+3="), None)
    monkeypatch.setattr(store, "STALE_ROLLOUT_S", 3600.0)
    monkeypatch.setattr(store, "MAX_ROLLOUTS", 1)
    one_call(t, "newer", user("5+5="))  # (crowds "other" out)
    with pytest.raises(ValueError, match=r"rollout 'other' is finished: dropped, 1 rollouts being in flight"):
        t.prompt("other", user("2+2=4. And 1+1="), None)
    # (its trajectory is not an empty one, which would read as an agent that never called the model)
    with pytest.raises(ValueError, match=r"rollout 'slow' is finished: dropped after 0 s without a call"):
        t.finish("slow")
    assert t.finish("never-called") == t.finish("never-called") == {"segments": [], "calls": 0, "tool_calls": 0,
                                                                      "splits": 0}


def test_a_first_segment_whose_only_call_failed_leaves_the_parallel_one_standing_alone_not_a_split():
    # a rollout's first call opens a segment, a parallel call another (a split); the first call
    # fails (a tool parser's 500, a cancel): one segment is left, and no split with it
    t = fresh()
    _, first = t.prompt("par", user("1+1="), None)
    ids, second = t.prompt("par", user("2+2="), None)  # (the first still decoding: opened beside it)
    t.abandon("par", first)
    t.add("par", second, user("2+2="), ids, [5, 6], [-0.1, -0.2], [0, 0], {"role": "assistant", "content": "4"})
    traj = t.finish("par")
    assert (traj["calls"], traj["splits"], len(traj["segments"])) == (1, 0, 1)
