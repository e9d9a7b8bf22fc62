"""Samples moved between engine instances mid-response (what the ``longtail`` scheduler's
straggler moves do): taken out with their tokens so far, finished on another instance that
re-prefills them, nothing lost or generated twice, each token keeping the version that made it."""

from __future__ import annotations

import random
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from streamrl.engines.hf import HFEngine, HFEngineConfig
from streamrl.recipe.recipe import load_recipe
from streamrl.run import runner
from streamrl.sample import Prompt
from streamrl.sim.engine import SimEngine, SimEngineConfig
from streamrl.training.trainer import pad_batch, token_logprobs
from tests.helpers import (ROOT, check_every_sample_trained_once, kill_worker, last_error_line, read_records, run_recipe,
                           sets, start_run, stop, streamrl, until, wait_for_steps, with_plugin, write_tiny_recipe)


def slot_engine(path, **config):
    engine = HFEngine(HFEngineConfig(batching="slots", profile=False, **config))
    engine.load(str(path))
    return engine


def trainer_logprobs(model, sample, pad_id):
    ids, attn, resp, _ = pad_batch([sample], pad_id)
    return token_logprobs(model, ids, attn, 1.0)[resp.bool()]


def test_a_sample_moved_mid_response_is_finished_by_the_other_engine_with_its_tokens_and_versions(tiny_model):
    source = slot_engine(tiny_model, max_new_tokens=40, slots=4)
    target = slot_engine(tiny_model, max_new_tokens=40, slots=4)
    pool = ThreadPoolExecutor(2)
    try:
        for e in (source, target):
            e.decoder.stop_ids.fill_(-1)  # every response runs to 40 tokens: the move lands mid-way
        with torch.no_grad():  # the target holds a newer policy
            target.load_weights({n: p * 1.5 for n, p in target.model.named_parameters()}, 1)
        handed = []

        def on_moved(partial):
            handed.append(partial)
            return pool.submit(target.continue_sample, partial, 0.0)
        prompt = Prompt(uid="m", text="12+34=", answer="")
        out = []
        asker = threading.Thread(target=lambda: out.append(source.generate_movable(prompt, [0, 1, 2], 0.0, on_moved)))
        asker.start()
        until(lambda: len(source.requests_now().running) == 3 and
              min(n for _, n, _, _ in source.requests_now().running) >= 5, every=0.002)
        assert not source.move_out("nobody") and source.move_out("m-1")
        asker.join(60)
        (group,) = out
        (partial,) = handed
        k = len(partial.response_ids)
        assert [s.uid for s in group] == ["m-0", "m-1", "m-2"] and 5 <= k < 40
        moved = group[1]
        assert len(moved.response_ids) == 40 and moved.response_ids[:k] == partial.response_ids
        assert moved.token_versions == [0] * k + [1] * (40 - k) and moved.policy_version == 0
        assert "moved" in moved.times and all(len(s.response_ids) == 40 and not s.token_versions for s in group[::2])
        # its first k tokens are the source's policy, the rest the target's, continuing the same text
        pad = source.tokenizer.pad_token_id
        assert torch.allclose(trainer_logprobs(source.model, moved, pad)[:k], torch.tensor(moved.logprobs[:k]), atol=1e-4)
        assert torch.allclose(trainer_logprobs(target.model, moved, pad)[k:], torch.tensor(moved.logprobs[k:]), atol=1e-4)
        assert sorted(source.requests_now().finished) == [("m-0", 40), ("m-2", 40)]
        assert target.requests_now().finished == [("m-1", 40)]
        assert source.requests_in_flight() == (0, 0) and target.requests_in_flight() == (0, 0)
    finally:
        pool.shutdown()
        source.close()
        target.close()


def test_a_sample_that_ends_before_it_is_taken_out_stays_where_it_is(tiny_model):
    engine = slot_engine(tiny_model, max_new_tokens=3, slots=2)
    try:
        group = engine.generate_movable(Prompt(uid="s", text="1+2=", answer=""), [0], 0.0,
                                        lambda partial: pytest.fail("nothing was moved"))
        assert not engine.move_out("s-0")  # ended: not running any more
        assert len(group) == 1 and not group[0].token_versions and "moved" not in group[0].times
        engine.cancel("s-0")  # asked to stop after it ended: the next turn forgets the ask
        until(lambda: not engine.streams.pending(), every=0.01)
        assert not engine._requests and not engine.table.running  # nothing of it is left
    finally:
        engine.close()


def test_a_sample_ended_but_not_yet_handed_back_is_not_moved(tiny_model):
    # finished_every > 1: an ended response keeps its slot until the flags are read, and looks
    # running meanwhile; taken out then, it was continued past its end (or failed at its limit)
    engine = slot_engine(tiny_model, max_new_tokens=3, slots=2, finished_every=10_000)
    try:
        engine.decoder.stop_ids.fill_(-1)  # (it ends at its limit, 3 tokens)
        out = []
        asker = threading.Thread(target=lambda: out.append(engine.generate_movable(
            Prompt(uid="e", text="1+2=", answer=""), [0], 0.0, lambda partial: pytest.fail("an ended sample moved"))))
        asker.start()
        until(lambda: engine.requests_now().running and engine.loop_counts["steps"] >= 5, every=0.002)
        assert engine.move_out("e-0")  # (still in its slot: the ask is taken)
        asker.join(60)
        (group,) = out
        assert len(group[0].response_ids) == 3 and "moved" not in group[0].times
    finally:
        engine.close()


def test_a_simulated_sample_moved_keeps_its_whole_length_and_the_versions_of_both_instances():
    task = runner.resolve(load_recipe(str(ROOT / "recipes/paper-7b-20k.toml"), [])).task.build()
    prompt = task.prompts(0, 1)[0]
    source, target = SimEngine(SimEngineConfig(time_scale=0.01)), SimEngine(SimEngineConfig(time_scale=0.01))
    pool = ThreadPoolExecutor(2)
    try:
        source.load()
        target.load()
        target.version = 3
        lengths = {k: source._length(prompt, k) for k in range(4)}
        longest = max(lengths, key=lengths.get)
        asked = pool.submit(source.generate_movable, prompt, list(range(4)), 0.0,
                            lambda partial: pool.submit(target.continue_sample, partial, 1.0))
        until(lambda: any(n > 200 for _, n, _, _ in source.requests_now().running), every=0.005)
        assert source.move_out(f"{prompt.uid}-{longest}")
        group = asked.result(60)
        assert [len(s.response_ids) for s in group] == [lengths[k] for k in range(4)]
        moved = group[longest]
        k = moved.token_versions.count(0)
        assert 200 < k < lengths[longest] and moved.token_versions == [0] * k + [3] * (lengths[longest] - k)
        assert moved.policy_version == 0 and all(not s.token_versions for i, s in enumerate(group) if i != longest)
        assert target.requests_now().finished == [(moved.uid, lengths[longest])]
    finally:
        pool.shutdown()
        source.close()
        target.close()


MOVING = ('scheduler={name="longtail", migrate=true, straggler_ratio=0.3, gain=0.0, move_every_s=0.05, '
          'max_moves=4}')


def test_readers_in_several_threads_share_the_ended_samples_without_an_error_or_a_sample_seen_twice(tiny_model):
    # the mover asks from its thread while the loop hands samples back and another caller (a
    # second mover, a test) may ask too: every ended sample goes to exactly one of them
    import sys

    from streamrl.engines.slot_requests import Request

    engine = slot_engine(tiny_model, slots=4, max_new_tokens=8)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # (threads take turns every few bytecodes: the race, if any, shows)
    try:
        for round_ in range(3):
            n, done = 8000, threading.Event()  # (fewer than FINISHED_KEPT: none is dropped unread)

            def hand_back():
                for i in range(n):
                    engine.moves.ended(Request(rid=f"{round_}-{i}", limit=8, task=True), 3)
                done.set()

            def read():
                got = []
                while not done.is_set():
                    got += engine.requests_now().finished
                return got + engine.requests_now().finished

            with ThreadPoolExecutor(5) as pool:
                readers = [pool.submit(read) for _ in range(4)]
                pool.submit(hand_back).result(timeout=120)
                parts = [f.result(timeout=60) for f in readers]
            seen = [uid for part in parts for uid, _ in part]
            assert len(seen) == n and set(seen) == {f"{round_}-{i}" for i in range(n)}
    finally:
        sys.setswitchinterval(interval)
        engine.close()


@pytest.mark.slow
def test_a_simulated_run_moves_stragglers_and_trains_every_sample_once_at_its_whole_length(tmp_path):
    from streamrl.sim.workload import sample_length

    prompts, n = 8, 8
    run = run_recipe(ROOT / "recipes/paper-7b-20k.toml", MOVING, "pools.generate.workers=3", "run.steps=3",
                     f"trainer.prompts_per_step={prompts}", f"trainer.samples_per_prompt={n}",
                     "cluster.dashboard_port=0", out=tmp_path, args=("--no-report",))
    records = run.records
    check_every_sample_trained_once(records, prompts, n)
    task = runner.resolve(load_recipe(str(ROOT / "recipes/paper-7b-20k.toml"), [])).task.build()
    by_uid = {p.uid: p for r in records for p in task.prompts(r["step"], prompts)}
    moved = 0
    for r in records:
        for x in r["sample_log"]:
            group, k = x["uid"].rsplit("-", 1)
            # a moved sample's tokens: those before the move and after it, each once
            assert x["response_len"] == sample_length(by_uid[group], random.Random(f"0-{group}-{k}")), x
            if "moved" in x:
                moved += 1
                assert x["gen_start"] <= x["moved"] <= x["gen_end"]
        assert r["moves/looks"] > 0
    assert moved > 0 and moved == sum(r["moves/moved"] for r in records)


@pytest.mark.slow
def test_a_run_on_the_hf_slot_engine_moves_samples_and_trains_each_once(tmp_path, tiny_model):
    recipe = write_tiny_recipe(tmp_path, tiny_model)
    run = run_recipe(recipe, MOVING.replace("}", ", tail_ratio=1.0}"), "pools.generate.workers=2",
                     'engine.batching="slots"', "engine.max_new_tokens=40", "run.steps=3", out=tmp_path / "runs")
    records = run.records
    check_every_sample_trained_once(records, 4, 4)
    moved = [x for r in records for x in r["sample_log"] if "moved" in x]
    assert moved and all(1 <= x["response_len"] <= 40 and x["gen_start"] <= x["moved"] <= x["gen_end"] for x in moved)
    assert all(r["loss"] == r["loss"] for r in records)  # trained (a NaN loss is not equal to itself)
    log = run.dir / "warnings.log"  # no look at the engines met the cluster stopping
    assert not log.exists() or "broadcast" not in log.read_text()


@pytest.mark.slow
def test_moves_on_an_engine_that_cannot_hand_a_sample_over_are_refused_in_one_line(tmp_path, tiny_model, shared_cluster):
    recipe = write_tiny_recipe(tmp_path, tiny_model)
    proc = streamrl("recipe", "run", recipe, *sets(MOVING, *shared_cluster.sets))
    line = last_error_line(proc, 2)
    assert "scheduler: 'longtail' moves running samples" in line and "engine 'hf'" in line and "migrate" in line


FAILING_MOVER = '''
from pydantic import BaseModel
from streamrl.api import Assignment, Component, Scheduler, hookimpl


class Empty(BaseModel):
    pass


class FailingMover(Scheduler):
    """Places every group whole, round-robin, and fails whenever it is asked for moves."""

    moves_samples = True

    def __init__(self, config):
        pass

    def dispatch(self, prompts, scores, workers, ctx):
        return [Assignment(i, workers[i % len(workers)], 0.0, tuple(range(ctx.samples_per_prompt)))
                for i in range(len(prompts))]

    def moves(self, instances):
        raise RuntimeError("boom in moves")


@hookimpl
def register_schedulers():
    return [Component("scheduler", "failing_mover", Empty, FailingMover)]
'''


@pytest.mark.slow
def test_a_scheduler_plugin_that_fails_to_pick_moves_is_said_once_and_the_run_goes_on(tmp_path):
    recipe = tmp_path / "w3.toml"
    recipe.write_text((ROOT / "recipes/paper-7b-20k.toml").read_text())
    recipe = with_plugin(recipe, "failing_mover", FAILING_MOVER, extra='\n[scheduler]\nname = "failing_mover"\n')
    run = run_recipe(recipe, "pools.generate.workers=2", "run.steps=2", "trainer.prompts_per_step=4",
                     "trainer.samples_per_prompt=4", "cluster.dashboard_port=0", out=tmp_path / "runs",
                     args=("--no-report",))
    check_every_sample_trained_once(run.records, 4, 4)
    said = [line for line in run.proc.stderr.splitlines() if "sample moves" in line]
    assert len(said) == 1 and "RuntimeError: boom in moves" in said[0]
    assert all(r["moves/moved"] == 0 and r["moves/looks"] > 0 for r in run.records)


@pytest.mark.slow
def test_a_generate_worker_killed_while_samples_move_loses_and_repeats_nothing(tmp_path):
    from streamrl.sim.workload import sample_length

    prompts, n = 8, 8
    proc = start_run(ROOT / "recipes/paper-7b-20k.toml", tmp_path, MOVING, "pools.generate.workers=3",
                     f"trainer.prompts_per_step={prompts}", f"trainer.samples_per_prompt={n}",
                     "cluster.dashboard_port=0", steps=8)
    try:
        run_dir = wait_for_steps(proc, tmp_path, 2)
        kill_worker(run_dir, "generate-1")
        _, err = proc.communicate(timeout=300)
    finally:
        stop(proc)
    assert proc.returncode == 0, err[-3000:]
    records = read_records(run_dir)
    check_every_sample_trained_once(records, prompts, n)
    task = runner.resolve(load_recipe(str(ROOT / "recipes/paper-7b-20k.toml"), [])).task.build()
    by_uid = {p.uid: p for r in records for p in task.prompts(r["step"], prompts)}
    for x in (x for r in records for x in r["sample_log"]):
        group, k = x["uid"].rsplit("-", 1)
        assert x["response_len"] == sample_length(by_uid[group], random.Random(f"0-{group}-{k}")), x
    # the mover found the restarted worker again: samples still move in the last steps
    assert sum(r["moves/moved"] for r in records[-3:]) > 0


def test_a_schedulers_move_with_an_index_outside_the_engines_is_refused_not_wrapped_round():
    from streamrl.extensions.sample_moves import SampleMoves

    assert SampleMoves._checked(("g-1", 0, 1), 2) == ("g-1", 0, 1)
    for wrong, said in [(("g-1", -1, 0), "worker index -1"), (("g-1", 0, 2), "worker index 2"),
                        (("g-1", 0, True), "worker index True"), (("g-1", 0), "expected (sample uid")]:
        with pytest.raises(ValueError, match=re.escape(said)):
            SampleMoves._checked(wrong, 2)


def test_a_move_to_an_engine_that_did_not_answer_the_look_is_not_made():
    # a scheduler plugin's move to a worker that is gone or restarting: the sample sent there
    # waited on it for ever, and its step with it (a stand-in for the cluster: only the calls)
    from types import SimpleNamespace

    from streamrl.contracts.generation import RequestsNow
    from streamrl.extensions.sample_moves import SampleMoves
    from streamrl.on_worker import move_tasks

    asked = []

    class Cluster:
        def run(self, fn, *args, workers, **_):
            asked.append(fn)
            if fn is move_tasks.requests_now:  # b's answer never came
                return {"tcp://a": RequestsNow([("g-0", 900, 10, True)], []), "tcp://b": OSError("gone")}
            return {workers[0]: True}

    moves = SampleMoves()
    moves.address = {"a": "tcp://a", "b": "tcp://b", "c": "tcp://c"}
    moves.context = SimpleNamespace(
        client=Cluster(), scheduler=SimpleNamespace(moves=lambda seen: [("g-0", 0, 1), ("g-0", 0, 2)]),
        topology=SimpleNamespace(generate=["a", "b", "c"], pins={n: {"workers": [n]} for n in "abc"}))
    assert moves.look() == 0 and asked == [move_tasks.requests_now]  # (c said nothing either: no answer)
