"""``streamrl plan``: the predictor against the sim engine it forecasts, the split search, and the
command as a user runs it (``--check`` runs real simulated clusters)."""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from streamrl.run import runner
from streamrl.planning import allocate
from streamrl.planning.predict import predict
from streamrl.planning.profile import StageProfile, from_cost_model
from streamrl.recipe.recipe import load_recipe
from streamrl.sim.batching import ContinuousBatch
from streamrl.sim.engine import SimEngine
from tests.helpers import ROOT, sets, streamrl

W3 = ROOT / "recipes" / "paper-7b-20k.toml"


def w3(*overrides: str):
    return runner.resolve(load_recipe(W3, list(overrides)))


def test_continuous_batch_orders_admits_and_times_like_stepping_one_token_at_a_time():
    b = ContinuousBatch(c0=0.01, per_context_token=1e-6, prefill_per_token=0.0, capacity=1_000, max_running=2)
    low = b.add(100, 5, priority=0.0)
    high = b.add(100, 3, priority=1.0)
    mid = b.add(100, 4, priority=0.5)
    b.admit()
    assert {id(r) for r in b.running} == {id(high), id(mid)}  # max_running 2, highest priority first
    by_hand = sum(0.01 + 1e-6 * (200 + 2 * i) for i in range(3))
    assert b.decode_time(3) == pytest.approx(by_hand)
    assert b.steps_within(by_hand * (1 + 1e-9)) == 3 and b.steps_within(by_hand * 0.999) == 2
    assert b.steps_to_next_finish() == 3
    assert b.advance(3) == [high]
    b.admit()
    assert low in b.running and b.context() == 103 + 100  # mid after 3 steps + low just admitted
    # the KV cache: a request that does not fit waits (unless the batch is empty)
    kv = ContinuousBatch(c0=0.01, per_context_token=0.0, prefill_per_token=0.0, capacity=150)
    kv.add(100, 10)
    kv.add(100, 10)
    kv.admit()
    assert len(kv.running) == 1 and len(kv.waiting) == 1


def test_prediction_matches_the_sim_engine_it_forecasts():
    """One real SimEngine instance, driven by threads as generate tasks drive it, against the
    predictor's replay of the same groups: the same batching, so the makespans agree.

    Every request is queued before the engine's loop starts (as a batch step's groups are all
    submitted at once), so the engine is busy from the first token to the last and its
    simulated busy time is its makespan: the comparison is in simulated seconds, exactly."""
    r = w3("task.median=300", "task.p90=900", "task.cap=2000", "engine.time_scale=0.003")  # ~0.1 s real
    prof = from_cost_model(r, observe_steps=1)
    prompts = r.task.build().prompts(0, r.recipe.trainer.prompts_per_step)
    n = r.recipe.trainer.samples_per_prompt
    engine = SimEngine(r.engine.config)
    with ThreadPoolExecutor(len(prompts)) as ex:
        groups = [ex.submit(engine.generate, p, n) for p in prompts]
        deadline = time.time() + 60  # a hang guard only
        while len(engine.batch.waiting) < len(prompts) * n:
            assert time.time() < deadline
            time.sleep(0.001)
        engine.load()
        lengths = [[len(s.response_ids) for s in g.result(timeout=60)] for g in groups]
    engine.close()
    # the profile's groups are those very prompts' lengths as the engine draws them
    assert [g.lengths for g in prof.groups] == lengths
    pred = predict(_fixed(prof), 1, 1, "batch", 0, steps=1, warmup=0)
    assert pred.generate_makespan_s == pytest.approx(engine.busy_sim_s, rel=1e-6), (pred.generate_makespan_s,
                                                                                     engine.busy_sim_s)


def _fixed(p: StageProfile) -> StageProfile:
    """A profile whose every step is its groups in order (no resampling)."""

    class Fixed(StageProfile):
        def draw_steps(self, steps, seed):
            return [list(self.groups)] * steps

    return Fixed.model_validate(p.model_dump())


def test_a_profile_with_empty_responses_is_replayed_and_one_without_groups_or_lengths_is_refused():
    # an empty response (a request cancelled at once) ends where it starts: the replay queued its
    # finish at the clock's own time, and found it there again, for ever
    import threading

    prof = from_cost_model(w3()).model_dump()
    prof["groups"] = [{"prompt_tokens": 10, "lengths": [0, 5]}, {"prompt_tokens": 0, "lengths": [0, 0]}]
    got = []
    replay = threading.Thread(target=lambda: got.append(predict(StageProfile.model_validate(prof), 2, 2, "async", 1,
                                                               steps=2)), daemon=True)
    replay.start()
    replay.join(60)
    assert got and math.isfinite(got[0].step_s) and got[0].step_s > 0
    for groups in ([], [{"prompt_tokens": 10, "lengths": []}], [{"prompt_tokens": 10, "lengths": [-1]}]):
        with pytest.raises(ValueError):  # (plan --profile: one line naming the file)
            StageProfile.model_validate({**prof, "groups": groups})
    # a time of Infinity (JSON's own word in Python's reader) is no time: refused, not a traceback later
    with pytest.raises(ValueError):
        StageProfile.model_validate({**prof, "decode_c0_s": float("inf")})


def test_predictions_order_the_modes_and_respond_to_the_split():
    prof = from_cost_model(w3())
    batch = predict(prof, 8, 4, "batch", 0)
    stream = predict(prof, 8, 4, "stream", 0)
    async1 = predict(prof, 8, 4, "async", 1)
    assert batch.samples_per_s < stream.samples_per_s < async1.samples_per_s
    # in batch mode each pool waits for the other: both idle about half the time
    assert batch.idle_generate > 0.4 and batch.idle_train > 0.4
    # training-bound async: more training devices shorten the step, fewer lengthen it
    assert predict(prof, 8, 8, "async", 1).step_s < async1.step_s < predict(prof, 8, 2, "async", 1).step_s
    for p in (batch, stream, async1):
        assert 0 <= p.idle_generate <= 1 and 0 <= p.idle_train <= 1
    # same profile, same seed: the same forecast
    assert predict(prof, 8, 4, "async", 1) == async1
    # controller costs measured by calibration slow every step down
    slow = prof.model_copy(update={"step_overhead_s": 30.0, "submit_per_group_s": 0.3})
    assert predict(slow, 8, 4, "async", 1).step_s > async1.step_s + 30


def test_search_tries_every_split_and_ranks_by_the_objective():
    prof = from_cost_model(w3())
    rows = allocate.search(prof, 6, ["batch", "async"], 2, 4, 1, (1.0, 3.0), "throughput")
    assert {(p.generate, p.train, p.mode, p.max_staleness) for p, _ in rows} == {
        (g, 6 - g, m, k) for g in range(1, 6) for m, k in [("batch", 0), ("async", 1), ("async", 2)]}
    rates = [p.samples_per_s for p, _ in rows]
    assert rates == sorted(rates, reverse=True)
    by_cost = allocate.search(prof, 6, ["async"], 1, 4, 1, (1.0, 3.0), "cost")
    costs = [c for _, c in by_cost]
    assert costs == sorted(costs, reverse=True)
    p = by_cost[0][0]
    assert costs[0] == pytest.approx(p.samples_per_s * 3600 / (p.generate * 1.0 + p.train * 3.0))
    # a trainer of one worker (not data-parallel): no split the run would refuse is offered
    alone = allocate.search(prof, 6, ["async"], 1, 4, 1, (1.0, 3.0), "throughput", lambda workers: workers == 1)
    assert [(p.generate, p.train) for p, _ in alone] == [(5, 1)]
    # devices that cost nothing: samples per cost unit is infinite, which JSON writes as null
    assert allocate._json_number(allocate.search(prof, 4, ["batch"], 0, 4, 1, (0.0, 0.0), "cost")[0][1]) is None


def test_split_overrides_apply_the_choice(tiny_recipe):
    r = w3()
    best = predict(from_cost_model(r), 4, 8, "async", 3, steps=2)
    ov = allocate.split_overrides(r, best)
    assert ov[:4] == ["pools.generate.workers=4", "trainer.gpus=8", "run.mode=async", "run.max_staleness=3"]
    # four steps of 64 groups on 4 workers need more than the recipe's 32 task slots each
    threads = int(ov[4].split("=")[1])
    assert ov[4].startswith("pools.generate.threads=") and threads * 4 > 4 * 64
    applied = load_recipe(W3, ov).recipe
    assert (applied.pools.generate.workers, applied.run.max_staleness, applied.pools.generate.threads) == (4, 3, threads)
    # a real trainer gets train workers (data parallel) instead of virtual GPUs
    real = runner.resolve(load_recipe(tiny_recipe, []))
    assert "pools.train.workers=8" in allocate.split_overrides(real, best)


def test_plan_command_prints_choices_and_writes_json(tmp_path):
    out, prof = tmp_path / "plan.json", tmp_path / "profile.json"
    proc = streamrl("plan", str(W3), "--devices", "6", "--calibrate-steps", "0", "--steps", "3", "--modes",
                    "batch,async", "--max-staleness", "2", "--top", "3", "--out", str(out),
                    "--save-profile", str(prof))
    assert proc.returncode == 0, proc.stderr
    assert "SIMULATED" in proc.stderr and "apply the top choice with: --set pools.generate.workers=" in proc.stderr
    result = json.loads(out.read_text())
    assert len(result["choices"]) == 3 and result["devices"] == 6
    assert result["choices"][0]["samples_per_s"] >= result["choices"][1]["samples_per_s"]
    assert all(c["generate"] + c["train"] == 6 for c in result["choices"])
    # the saved profile plans the same without the recipe's cost model
    again = tmp_path / "again.json"
    proc = streamrl("plan", str(W3), "--devices", "6", "--profile", str(prof), "--steps", "3", "--modes",
                    "batch,async", "--max-staleness", "2", "--top", "3", "--out", str(again))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(again.read_text())["choices"] == result["choices"]


@pytest.mark.parametrize("args, message", [
    (["--modes", "colocated"], "--modes: 'colocated' is not a mode the planner can split for"),
    (["--devices", "1"], "--devices must be >= 2"),
    (["--max-staleness", "100000"], "--max-staleness must be <= 64"),
    (["--steps", "3", "--warmup", "3"], "--warmup (3) must be below --steps (3)"),
    (["--profile", "missing.json"], "profile missing.json: not a streamrl plan profile"),
])
def test_plan_mistakes_are_one_line(args, message):
    proc = streamrl("plan", str(W3), "--calibrate-steps", "0", *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_plan_of_a_real_engine_needs_a_warm_up_or_a_saved_profile(tiny_recipe):
    proc = streamrl("plan", str(tiny_recipe), "--calibrate-steps", "0")
    assert proc.returncode == 2 and "planned from a saved profile with --profile" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_plan_profiles_a_real_engine_from_its_start_up_profile_and_a_warm_up_run(tiny_recipe, tmp_path, shared_cluster):
    # (the warm-up runs on the shared cluster: it has the recipe's pools)
    prof, out = tmp_path / "profile.json", tmp_path / "plan.json"
    proc = streamrl("plan", str(tiny_recipe), "--devices", "3", "--calibrate-steps", "2", "--steps", "3",
                    "--modes", "stream,async", "--max-staleness", "1", "--save-profile", str(prof), "--out", str(out),
                    "--set", f'run.out_dir="{tmp_path}"', *sets(*shared_cluster.sets), timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    p = json.loads(prof.read_text())
    assert p["source"].startswith("measured") and not p["simulated"]
    # the hf engine's own decode profile, the trainer's time per token, the loads, the controller
    assert p["decode_c0_s"] > 0 and p["train_per_token_s"] > 0 and p["step_overhead_s"] > 0
    assert p["kv_capacity_tokens"] < 1 << 40  # the engine's KV blocks
    # every group of the 2 measured batch steps (4 prompts x 4 samples each), with its lengths
    assert len(p["groups"]) == 2 * 4 and all(len(g["lengths"]) == 4 for g in p["groups"])
    assert all(1 <= n <= 6 for g in p["groups"] for n in g["lengths"])  # max_new_tokens = 6
    result = json.loads(out.read_text())
    assert {(c["generate"], c["train"]) for c in result["choices"]} <= {(1, 2), (2, 1)}
    assert all(c["samples_per_s"] > 0 for c in result["choices"])


@pytest.mark.slow
def test_plan_check_runs_the_choice_and_the_recipe_and_reports_both(tmp_path):
    """The whole command on two small simulated clusters: calibration, the plan, the check."""
    out = tmp_path / "plan.json"
    proc = streamrl("plan", str(W3), "--devices", "4", "--steps", "2", "--warmup", "1", "--calibrate-steps", "2",
                    "--modes", "async", "--max-staleness", "1", "--top", "2", "--check", "--out", str(out),
                    "--set", "pools.generate.workers=2", "--set", "trainer.gpus=2", "--set", "engine.time_scale=0.002",
                    "--set", "trainer.prompts_per_step=16", "--set", f'run.out_dir="{tmp_path}"', timeout=400)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    check = result["check"]
    assert check["plan"]["measured_samples_per_s"] > 0 and check["recipe"]["measured_samples_per_s"] > 0
    assert check["plan_vs_recipe"] == pytest.approx(
        check["plan"]["measured_samples_per_s"] / check["recipe"]["measured_samples_per_s"])
    assert "controller" in result["profile"] and "measured" in result["profile"]  # calibrated
    assert "check: plan" in proc.stderr and "prediction error" in proc.stderr
