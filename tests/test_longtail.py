"""Lengths learned from a group's own samples, groups in chunks, stragglers moved: the estimator,
the placement and the simulated rollout (no cluster)."""

from __future__ import annotations

import json
import math
import random
import re
from functools import partial

import pytest

from streamrl.api import DispatchContext, Prompt
from streamrl.scheduling.estimates import GroupLengths, LengthEstimateConfig, prior_from_scores, tail_mean
from streamrl.api import RequestsNow
from streamrl.scheduling.longtail import GroupSpec, LongTail, LongTailConfig, LongTailPolicy, Running
from streamrl.sim import latency
from streamrl.sim.latency import Profile
from streamrl.sim.rollout import Rollout, SampleRecord
from streamrl.sim.rollout_run import Setup, Variant, simulate
from streamrl.sim.workload import LongTailSimConfig, LongTailSimTask
from streamrl.scheduling.schedulers import FCFS, FCFSConfig

STEP = partial(latency.step_latency, Profile())


def test_a_groups_own_finished_sample_moves_its_estimate_past_a_wrong_prior():
    est = GroupLengths(LengthEstimateConfig(sigma=0.3, tau=1.0))
    est.start("g", math.log(1000))
    before = est.estimate("g")
    est.finish("g", 8000)
    after = est.estimate("g")
    assert before < 2000 < 6000 < after  # one sample outweighs a vague prior


def test_siblings_still_running_pull_the_estimate_up():
    # the first sample to finish is the shortest: counting the running ones as censored corrects it
    plain, censored = (GroupLengths(LengthEstimateConfig(censored=c)) for c in (False, True))
    for e in (plain, censored):
        e.start("g", math.log(2000))
        e.finish("g", 2000, running=[6000] * 7)
    assert censored.mean_log("g", [6000] * 7) > plain.mean_log("g", [6000] * 7) + 0.3


def test_a_running_sample_is_expected_longer_than_it_already_is():
    assert tail_mean(math.log(1000), 0.5, 0) == pytest.approx(1000 * math.exp(0.125))
    assert tail_mean(math.log(1000), 0.5, 5000) > 5000
    assert tail_mean(math.log(1000), 0.5, 1e7) >= 1e7  # far past any belief: still finite and above


def test_spreads_are_learned_from_closed_groups():
    est = GroupLengths(LengthEstimateConfig(sigma=2.0, tau=2.0))
    rng = random.Random(0)
    for g in range(40):
        mu = rng.gauss(8, 0.1)
        est.start(str(g), 8.0)
        for _ in range(4):
            est.finish(str(g), int(math.exp(rng.gauss(mu, 0.2))))
        est.close(str(g))
    assert 0.1 < est.sigma < 0.35 and est.tau < 0.5


def test_priors_follow_the_rankers_order_and_equal_scores_are_equal():
    observed = list(range(100, 10100, 100))
    priors = prior_from_scores([0.1, 3.0, 1.0], observed)
    assert priors[1] > priors[2] > priors[0]
    assert len(set(prior_from_scores([0.0] * 4, observed))) == 1


def test_chunks_cover_every_sample_once_and_a_long_group_spreads():
    policy = LongTailPolicy(LongTailConfig(chunk=2), STEP)
    groups = [GroupSpec("long", 8, 500, math.log(16000))] + [GroupSpec(f"s{i}", 8, 500, math.log(2000)) for i in range(7)]
    chunks = policy.place(groups, 4)
    for g in groups:
        assert sorted(k for c in chunks if c.group == g.group for k in c.samples) == list(range(8))
    assert len({c.instance for c in chunks if c.group == "long"}) == 4  # not all on one instance
    first = max(chunks, key=lambda c: c.priority)
    assert first.group == "long"  # longest first


def test_the_scheduler_returns_chunk_assignments_and_with_moves_every_group_is_a_movable_chunk():
    prompts = [Prompt(uid=str(i), text=f"p{i}") for i in range(6)]
    out = LongTail(LongTailConfig(chunk=4)).dispatch(prompts, [float(i) for i in range(6)], ["a", "b", "c"],
                                                     DispatchContext(8, [1000, 5000, 9000], 300.0, STEP))
    assert len(out) == 12 and all(len(a.samples) == 4 for a in out)
    # no tail: whole groups round-robin; moving samples needs them named (a chunk task), all 8
    flat = DispatchContext(8, [1000] * 100, 300.0, STEP)
    assert all(a.samples == () for a in LongTail(LongTailConfig()).dispatch(prompts, [0.0] * 6, ["a", "b"], flat))
    moving = LongTail(LongTailConfig(migrate=True))
    assert moving.moves_samples and not LongTail(LongTailConfig()).moves_samples
    assert all(a.samples == tuple(range(8)) for a in moving.dispatch(prompts, [0.0] * 6, ["a", "b"], flat))


def test_the_scheduler_moves_from_what_engines_report_and_learns_each_finished_sample_once():
    scheduler = LongTail(LongTailConfig(migrate=True, gain=0.0, chunk=0))
    prompts = [Prompt(uid="g", text="g"), Prompt(uid="h", text="h")]
    ctx = DispatchContext(8, [500, 1000, 20000] * 30, 500.0, STEP)
    scheduler.dispatch(prompts, [0.0, 0.0], ["a", "b"], ctx)
    crowded = RequestsNow([(f"g-{k}", 900, 500, True) for k in range(7)] + [("h-0", 9000, 500, True),
                          ("h-1", 9500, 500, False)], [("g-7", 400)])
    moves = scheduler.moves([crowded, RequestsNow([], [])])
    assert moves and moves[0] == ("h-0", 0, 1) and all(uid != "h-1" for uid, _, _ in moves)  # h-1 moved once already
    assert scheduler.policy.lengths.groups["g"].finished == [400]  # g-7 taught g's estimate mid-step
    # an engine that did not answer the look (gone, restarting) is no target, however idle it looks
    assert scheduler.moves([crowded, None]) == []
    moves = scheduler.moves([crowded, None, RequestsNow([], [])])
    assert moves and all(target == 2 for _, _, target in moves)
    scheduler.observe(prompts, [[400] + [900] * 7, [9000] * 8])
    assert "g" not in scheduler.policy.lengths.groups and not scheduler.seen_online  # closed, g-7 counted once


def test_a_straggler_far_past_its_estimate_on_a_crowded_instance_is_moved():
    policy = LongTailPolicy(LongTailConfig(migrate=True, gain=0.0), STEP)
    policy.start([GroupSpec("g", 8, 500, math.log(1000)), GroupSpec("h", 8, 500, math.log(1000))])
    crowded = [Running(("g", k), "g", 900, 500) for k in range(40)] + [Running("late", "h", 9000, 500)]
    moves = policy.moves([crowded, []])
    assert [(m.key, m.source, m.target) for m in moves][:1] == [("late", 0, 1)]
    assert LongTailPolicy(LongTailConfig(migrate=False), STEP).moves([crowded, []]) == []


def test_a_moved_straggler_keeps_its_tokens_and_versions_and_nothing_is_lost_or_doubled():
    profile = Profile()
    policy = LongTailPolicy(LongTailConfig(migrate=True, gain=0.0), partial(latency.step_latency, profile))
    policy.start([GroupSpec("g", 8, 500, math.log(500)), GroupSpec("h", 1, 500, math.log(500))])
    samples = [SampleRecord("g", k, 600, 500) for k in range(8)] + [SampleRecord("h", 0, 6000, 500)]
    placed = [(s, 0, 0.0) for s in samples]  # everything crowded on instance 0, instance 1 idle
    result = Rollout(profile, 2, tick_s=1.0).run(samples, placed, policy, version=7)
    assert result.moved >= 1
    straggler = samples[-1]
    # moved once, as an engine's sample is (at most): a segment on each instance
    assert len(straggler.segments) == 2 and {i for i, _, _ in straggler.segments} == {0, 1}
    assert all(len(s.segments) <= 2 for s in samples)
    assert sum(n for _, _, n in straggler.segments) == 6000  # every token once, none lost or doubled
    assert all(v == 7 for _, v, _ in straggler.segments)  # its tokens keep their versions
    for s in samples[:-1]:
        assert sum(n for _, _, n in s.segments) == 600
    assert set(result.group_end_s) == {"g", "h"}


def test_the_rollout_model_reproduces_w3_and_chunks_beat_whole_groups():
    task = LongTailSimTask(LongTailSimConfig(dataset_size=256))
    setup = Setup(task, Profile(), 4, 16, 8, train_gpus=2)
    fcfs = simulate(setup, Variant("fcfs", FCFS(FCFSConfig())), 2, 1)
    whole = simulate(setup, Variant("whole", policy=LongTailConfig(chunk=0)), 2, 1)
    chunked = simulate(setup, Variant("chunks", policy=LongTailConfig(chunk=1)), 2, 1)
    assert chunked["generate_makespan_s"] < min(fcfs["generate_makespan_s"], whole["generate_makespan_s"])
    assert 0.0 <= chunked["recall_first"] <= 1.0


def test_a_groups_chunks_join_in_sample_order_and_an_overlap_is_refused():
    from streamrl.on_worker.task_functions import join_chunks
    from streamrl.sim.engine import SimEngine, SimEngineConfig

    task = LongTailSimTask(LongTailSimConfig(dataset_size=8))
    prompt = task.prompts(0, 1)[0]
    engine = SimEngine(SimEngineConfig(time_scale=1e-6))
    engine.load()
    try:
        whole = engine.generate(prompt, 4)
        parts = [engine.generate_samples(prompt, [2, 0]), engine.generate_samples(prompt, [3, 1])]
    finally:
        engine.close()
    joined = join_chunks(*parts)
    assert [s.uid for s in joined] == [s.uid for s in whole]
    assert [len(s.response_ids) for s in joined] == [len(s.response_ids) for s in whole]  # same lengths
    with pytest.raises(ValueError, match="overlap"):
        join_chunks(parts[0], parts[0])


def test_one_instance_gets_whole_groups():
    prompts = [Prompt(uid=str(i), text=f"p{i}") for i in range(4)]
    out = LongTail(LongTailConfig(chunk=1)).dispatch(prompts, [float(i) for i in range(4)], ["only"],
                                                     DispatchContext(8, [10, 20, 30], 5.0, STEP))
    assert sorted(a.index for a in out) == [0, 1, 2, 3] and all(a.samples == () for a in out)


def test_without_a_tail_the_scheduler_places_like_fcfs_and_asks_the_ranker_nothing():
    prompts = [Prompt(uid=f"0-{i}", text=f"p{i}") for i in range(6)]
    scheduler = LongTail(LongTailConfig())
    flat = DispatchContext(8, [4] * 60 + [5] * 40, 20.0, STEP)  # W1-like: P99 / median = 1.25
    assert not scheduler.needs_scores(["a", "b"], flat)
    out = scheduler.dispatch(prompts, [0.0] * 6, ["a", "b"], flat)
    assert [(a.index, a.worker, a.samples) for a in out] == [(i, "ab"[i % 2], ()) for i in range(6)]
    tailed = DispatchContext(8, [400] * 90 + [4000] * 10, 20.0, STEP)
    assert scheduler.needs_scores(["a", "b"], tailed)
    assert scheduler.needs_scores(["a", "b"], DispatchContext(8, [4] * 10, 20.0, STEP))  # too few seen to judge


def test_the_scheduler_learns_its_spreads_across_steps_and_not_from_placeholder_priors():
    task = LongTailSimTask(LongTailSimConfig(dataset_size=512))
    scheduler, observed, workers = LongTail(LongTailConfig()), [], ["a", "b", "c", "d"]
    for step in range(3):
        prompts = task.prompts(step, 32)
        out = scheduler.dispatch(prompts, [random.random() for _ in prompts], workers,
                                 DispatchContext(8, observed, 600.0, STEP))
        # every priority is a length a Dask priority and an engine can take: no blow-up from a
        # first step whose priors were placeholders
        assert all(1 <= a.priority <= 20480 * 4 for a in out), max(a.priority for a in out)
        lengths = [[int(math.exp(random.Random(f"{p.uid}-{k}").gauss(p.answer["log_median"], 0.35)))
                    for k in range(8)] for p in prompts]
        scheduler.observe(prompts, lengths)
        observed += [n for ls in lengths for n in ls]
        if step == 0:  # the placeholder priors taught nothing about how far groups land from them
            assert scheduler.policy.lengths.tau == LengthEstimateConfig().tau
    assert scheduler.policy.lengths.sigma == pytest.approx(0.35, abs=0.08)  # learned from the groups
    assert scheduler.policy.lengths.tau != LengthEstimateConfig().tau
    assert scheduler.policy.lengths.groups == {}  # every observed group closed


def test_the_spreads_learned_survive_a_checkpoint_and_a_resumed_run_places_with_them(tmp_path):
    # a resumed run placed from the starting spreads, not those its run had learned
    from types import SimpleNamespace

    from streamrl.checkpoints.integrity import json_problem
    from streamrl.flow.dispatch import Dispatcher

    task = LongTailSimTask(LongTailSimConfig(dataset_size=512))
    scheduler, observed, workers = LongTail(LongTailConfig()), [], ["a", "b", "c", "d"]
    for step in range(3):
        prompts = task.prompts(step, 32)
        scheduler.dispatch(prompts, [random.random() for _ in prompts], workers, DispatchContext(8, observed, 600.0, STEP))
        lengths = [[int(math.exp(random.Random(f"{p.uid}-{k}").gauss(p.answer["log_median"], 0.35)))
                    for k in range(8)] for p in prompts]
        scheduler.observe(prompts, lengths)
        observed += [n for ls in lengths for n in ls]
    learned = scheduler.policy.lengths
    assert learned.sigma != LengthEstimateConfig().sigma

    def dispatcher(scheduler):  # (the checkpoint's side of a run's dispatcher: no ranker, no cluster)
        d = Dispatcher.__new__(Dispatcher)
        d.scheduler, d.rank_worker, d.scheduler_problems = scheduler, None, set()
        d.observed_lengths, d.prompt_tokens = observed, 600.0
        return d

    for name, data in dispatcher(scheduler).checkpoint_files("t").items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "controller.json").write_text('{"next_step": 3, "policy_version": 3, "records": 3}')
    assert json_problem(tmp_path) is None
    fresh = LongTail(LongTailConfig())
    dispatcher(fresh).restore(tmp_path)
    prompts = task.prompts(3, 32)
    fresh.dispatch(prompts, [0.5] * 32, workers, DispatchContext(8, observed, 600.0, STEP))
    assert (fresh.policy.lengths.sigma, fresh.policy.lengths.tau) == (learned.sigma, learned.tau)
    assert fresh.policy.lengths.state_dict()["within"] == learned.state_dict()["within"]
    # a plugin's scheduler whose state cannot be written: said once, the checkpoint written all the same
    for broken in (SimpleNamespace(state_dict=lambda: {"x": object()}), SimpleNamespace(state_dict=lambda: None)):
        with pytest.warns(Warning, match="state_dict"):  # (null kept, every checkpoint was refused on resume)
            assert "scheduler" not in json.loads(dispatcher(broken).checkpoint_files("t")["dispatch.json"])
    with pytest.raises(ValueError):  # a damaged state: refused as it is restored, not at the first dispatch
        LongTail(LongTailConfig()).load_state_dict({"lengths": {"sigma": "x", "tau": 1, "within": [], "between": []}})


def test_a_dask_priority_is_clamped_and_a_nan_priority_is_refused_in_one_line():
    from streamrl.flow.submit import DASK_PRIORITY_LIMIT, dask_priority

    assert dask_priority(1e19) == DASK_PRIORITY_LIMIT and dask_priority(float("inf")) == DASK_PRIORITY_LIMIT
    assert dask_priority(-float("inf")) == -DASK_PRIORITY_LIMIT and dask_priority(12.7) == 12
    # a long estimate stays below a weight load's: the load goes first on a busy worker
    from streamrl.flow.weights import LOAD_PRIORITY

    assert dask_priority(5e6) < LOAD_PRIORITY - 1  # (and below a moved sample's continuation)
    from streamrl.api import Assignment
    from streamrl.errors import UserError
    from streamrl.flow.dispatch import placement

    assert placement([Assignment(0, "a", 3.0)], ["a"], 2) == {0: [("a", 3.0, ())]}
    with pytest.raises(UserError, match=r"gave prompt 0 the priority nan; expected a number"):
        placement([Assignment(0, "a", float("nan"))], ["a"], 2)
    with pytest.raises(UserError, match="not one of the generate workers"):
        placement([Assignment(0, "z")], ["a"], 2)
    with pytest.raises(UserError, match=r"samples as \[0\]"):
        placement([Assignment(0, "a", 0.0, (0,))], ["a"], 2)
    # numpy's numbers are numbers; a generator is read once; what else a plugin may hand back is one line
    import numpy as np

    assert placement((a for a in [Assignment(np.int64(1), "a", np.float32(2.5))]), ["a"], 2, prompts=2) == \
        {1: [("a", 2.5, ())]}
    for wrong, said in [(None, "returned NoneType; expected a list of Assignment"),
                        ([(0, "a")], "returned a tuple among its assignments"),
                        ([Assignment(2, "a")], "placed prompt index 2; expected a position in the list of 2 prompts"),
                        ([Assignment(-1, "a")], "placed prompt index -1"),
                        ([Assignment(0, "a", True)], "the priority True; expected a number"),
                        ([Assignment(0, "a", 0.0, 5)], "the samples 5; expected a tuple of sample numbers")]:
        with pytest.raises(UserError, match=re.escape(said)):
            placement(wrong, ["a"], 2, prompts=2)


def test_a_step_that_brought_no_samples_leaves_nothing_kept_for_it():
    # (a stop ends a step with none): its prompts, the ranker's scores and the scheduler's
    # metrics stayed for the rest of the run, one entry a step
    from types import SimpleNamespace

    from streamrl.flow.dispatch import Dispatcher

    dispatcher = Dispatcher(None, SimpleNamespace(rank=None), 8, None)
    dispatcher.step_prompts[3], dispatcher.predicted[3], dispatcher.scheduler_metrics[3] = [object()], [1.0], {}
    assert dispatcher.learn(3, []) == {}
    assert 3 not in dispatcher.step_prompts and 3 not in dispatcher.predicted and 3 not in dispatcher.scheduler_metrics


def test_a_profile_whose_weights_leave_no_kv_cache_is_refused():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="weight_bytes = 8e\\+10 leaves no KV cache"):
        Profile(weight_bytes=80e9, memory_bytes=80e9)
    assert latency.kv_capacity_tokens(Profile(weight_bytes=1e9, memory_bytes=2e9)) > 0
