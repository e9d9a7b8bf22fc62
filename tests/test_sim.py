"""The simulated engine and workload (W3): cost model arithmetic, batching, ordering, lengths."""

from __future__ import annotations

import math
import random
import re
import statistics
import threading
import time

import pytest

from streamrl.sample import Prompt
from streamrl.sim import latency
from streamrl.sim.engine import SimEngine, SimEngineConfig
from streamrl.sim.latency import Profile
from streamrl.sim.workload import LongTailSimConfig, LongTailSimTask, SimLengthConfig, SimLengthReward, sample_length


def test_decode_time_sums_step_latencies_and_steps_within_inverts_it():
    p = Profile()
    context, running, steps = 300_000, 64, 500
    by_hand = sum(latency.step_latency(p, context + i * running) for i in range(steps))
    assert latency.decode_time(p, context, running, steps) == pytest.approx(by_hand, rel=1e-9)
    t = latency.decode_time(p, context, running, steps)
    assert latency.steps_within(p, context, running, t * (1 + 1e-9)) == steps
    assert latency.steps_within(p, context, running, t * 0.999) == steps - 1


def test_w3_numbers():
    p = Profile()
    # KV capacity of WORKLOADS.md: (0.9 * 80e9 - 15.2e9) / 57344 ~ 1.0 M tokens
    assert latency.kv_capacity_tokens(p) == pytest.approx(0.99e6, rel=0.01)
    # an empty batch decodes at ~ c0 + W / (eff * BW) ~ 7.7 ms per token
    assert latency.step_latency(p, 0) == pytest.approx(0.002 + 15.2e9 / (0.8 * 3.35e12))


def test_task_lengths_follow_the_w3_long_tail_and_belong_to_the_prompt():
    task = LongTailSimTask(LongTailSimConfig(dataset_size=2000))
    rng = random.Random(0)
    prompts = task.prompts(0, 2000)
    lengths = [sample_length(pr, rng) for pr in prompts]
    q = statistics.quantiles(lengths, n=10)
    assert 3500 < statistics.median(lengths) < 4500 and 9500 < q[8] < 12500, (statistics.median(lengths), q[8])
    assert max(lengths) <= 20480 and min(lengths) >= 16
    # the prompt sets most of the spread: two samples of a prompt correlate in log length
    a = [math.log(sample_length(pr, rng)) for pr in prompts]
    b = [math.log(sample_length(pr, rng)) for pr in prompts]
    assert statistics.correlation(a, b) > 0.6


def test_task_walks_the_dataset_in_epochs():
    task = LongTailSimTask(LongTailSimConfig(dataset_size=10))
    ids = [p.answer["prompt_id"] for s in range(5) for p in task.prompts(s, 4)]
    assert sorted(ids[:10]) == list(range(10)) and sorted(ids[10:20]) == list(range(10))


def test_task_shuffles_an_epoch_once_and_gives_the_same_prompts_as_before(monkeypatch):
    # (shuffled again for every prompt: most of the controller's time in a step of 64)
    task = LongTailSimTask(LongTailSimConfig(dataset_size=100, seed=3))
    shuffles = []
    shuffle = random.Random.shuffle
    monkeypatch.setattr(random.Random, "shuffle", lambda self, x: shuffles.append(1) or shuffle(self, x))
    ids = [p.answer["prompt_id"] for s in range(3) for p in task.prompts(s, 64)]  # (192 prompts: two epochs)
    assert len(shuffles) == 2  # (once an epoch: it was once a prompt, 192)
    expected = []
    for j in range(192):
        epoch, pos = divmod(j, 100)
        order = list(range(100))
        shuffle(random.Random(3 * 7919 + epoch), order)
        expected.append(order[pos])
    assert ids == expected


@pytest.mark.parametrize("trace, said", [("4000\n0\n", "line 2 ('0') is not an output length"),
                                         ("12\nabc\n", "line 2 ('abc') is not an output length"),
                                         ("\n\n", "holds no output lengths")])
def test_a_trace_that_is_not_output_lengths_is_one_line_naming_the_file_and_line(tmp_path, trace, said):
    path = tmp_path / "lengths.txt"
    path.write_text(trace)
    with pytest.raises(ValueError, match=re.escape(said)):
        LongTailSimConfig(trace=str(path))
    with pytest.raises(ValueError, match=re.escape("min_len (99) must be <= cap (98)")):
        LongTailSimConfig(min_len=99, cap=98)
    with pytest.raises(ValueError):
        LongTailSimConfig(median=float("inf"))


def test_sim_length_reward():
    pr = Prompt("0-000", "q1", {"log_median": math.log(100)})
    reward = SimLengthReward(SimLengthConfig())
    assert reward.score(pr, "[simulated: 90 tokens]") == 1.0
    assert reward.score(pr, "[simulated: 101 tokens]") == 0.0
    with pytest.raises(ValueError):
        reward.score(pr, "42")


def fixed_prompt(uid, length, prompt_tokens=100):
    # sigma 0: every sample has exactly ``length`` tokens
    return Prompt(uid, "q", {"prompt_tokens": prompt_tokens, "log_median": math.log(length), "sigma": 0.0,
                             "min_len": 1, "cap": 100_000})


@pytest.fixture
def engine():
    # 1 simulated s = 1 ms: a 2000-token request takes ~16 simulated s ~ 16 ms
    e = SimEngine(SimEngineConfig(time_scale=0.001, quantum_s=0.002))
    e.load()
    yield e
    e.close()


def test_engine_batches_concurrent_requests():
    # 1 simulated s = 30 ms here: the wall-clock comparison at the end holds a margin of about
    # 1.5 s against a stall of the loaded machine
    engine = SimEngine(SimEngineConfig(time_scale=0.03, quantum_s=0.002))
    engine.load()
    try:
        _batches_concurrent_requests(engine)
    finally:
        engine.close()


def _batches_concurrent_requests(engine):
    p = engine.profile
    t0 = time.time()
    group = engine.generate(fixed_prompt("0-000", 2000), 8)
    together = time.time() - t0
    assert [len(s.response_ids) for s in group] == [2000] * 8
    assert [s.uid for s in group] == [f"0-000-{k}" for k in range(8)]
    # 8 requests decode together: the simulated time of one batch of 8 ...
    batched = latency.prefill_time(p, 800) + latency.decode_time(p, 800, 8, 2000)
    assert engine.busy_sim_s == pytest.approx(batched, rel=0.05)
    # ... far less than the same 8 requests one after another (1 / 7.8 of it by the cost model)
    t0 = time.time()
    for k in range(8):
        engine.generate(fixed_prompt(f"1-00{k}", 2000), 1)
    in_a_row = time.time() - t0
    one = latency.prefill_time(p, 100) + latency.decode_time(p, 100, 1, 2000)
    assert engine.busy_sim_s - batched == pytest.approx(8 * one, rel=0.05)
    # the real time (the same engine, measured in this test) follows: batching is not only on paper
    assert together < 0.5 * in_a_row, (together, in_a_row)


def test_engine_admits_highest_priority_first():
    e = SimEngine(SimEngineConfig(time_scale=0.001, max_running=1))
    done = {}

    def run(uid, prio):
        done[uid] = e.generate(fixed_prompt(uid, 300), 1, priority=prio)[0].times["gen_end"]

    # queue three requests before the loop starts, so the order is the scheduler's choice
    threads = [threading.Thread(target=run, args=(u, pr)) for u, pr in [("a", 0), ("b", 2), ("c", 1)]]
    for t in threads:
        t.start()
    while len(e.batch.waiting) < 3:
        time.sleep(0.001)
    e.load()
    for t in threads:
        t.join()
    e.close()
    assert sorted(done, key=done.get) == ["b", "c", "a"]


def test_weight_load_sets_version_and_new_samples_carry_it(engine):
    engine.load_weights({}, 3)
    assert engine.generate(fixed_prompt("1-000", 10), 1)[0].policy_version == 3
