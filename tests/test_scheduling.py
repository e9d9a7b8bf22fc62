"""Length rankers and skewness-aware scheduling: recall, LPT, the dispatch split, ranker state."""

from __future__ import annotations

import math
import random

import pytest

from streamrl.ranking.rankers import HistoryRanker, HistoryRankerConfig, LearnedRanker, LearnedRankerConfig
from streamrl.ranking.recall import top_recall
from streamrl.sample import Prompt
from streamrl.api import DispatchContext
from streamrl.scheduling.schedulers import FCFS, FCFSConfig, Skew, SkewConfig, best_split, makespan


def test_recall_of_the_top_fifth():
    actual = [10, 9, 8, 7, 6, 5, 4, 3, 2, 1]
    assert top_recall(actual, actual) == 1.0
    assert top_recall(list(reversed(actual)), actual) == 0.0
    # top 2 are items 0 and 1; the prediction gets item 0 and misses item 1
    assert top_recall([10, 0, 9, 0, 0, 0, 0, 0, 0, 0], actual) == 0.5
    with pytest.raises(ValueError):
        top_recall([1], [1, 2])


def prompts(n):
    return [Prompt(f"0-{i:03d}", f"q{i}") for i in range(n)]


def test_skew_orders_longest_predicted_first_inside_each_instance():
    ps = prompts(6)
    scores = [1.0, 5.0, 3.0, 6.0, 2.0, 4.0]
    out = Skew(SkewConfig(split=False)).dispatch(ps, scores, ["g0", "g1"], DispatchContext(4))
    assert [a.index for a in out] == list(range(6))
    for w in ("g0", "g1"):
        mine = [a for a in out if a.worker == w]
        by_priority = [a.index for a in sorted(mine, key=lambda a: -a.priority)]
        assert by_priority == sorted((a.index for a in mine), key=lambda i: -scores[i])


def test_skew_balances_predicted_work_lpt():
    # observed lengths 1..100; four prompts, two instances: LPT pairs longest with shortest
    ctx = DispatchContext(1, observed_lengths=list(range(1, 101)))
    out = Skew(SkewConfig(split=False)).dispatch(prompts(4), [4.0, 3.0, 2.0, 1.0], ["a", "b"], ctx)
    by_worker = {w: sorted(a.index for a in out if a.worker == w) for w in ("a", "b")}
    assert by_worker == {"a": [0, 3], "b": [1, 2]}


def test_tied_scores_are_placed_as_alike_not_by_their_place_in_the_list():
    # every score 0.0 (no ranker, or one that failed): prompt 0 was estimated the P99 and the last
    # the shortest, so largest-first packing gave the workers unequal counts of alike prompts, and
    # a split sent the first by index to the long-tail instances
    from streamrl.scheduling.estimates import prior_from_scores

    observed = [int(math.exp(random.Random(k).gauss(6.0, 1.0))) for k in range(200)]
    ctx = DispatchContext(8, observed_lengths=observed, prompt_tokens=10, step_latency=lambda c: 1e-3 + 1e-6 * c)
    sched = Skew(SkewConfig())
    out = sched.dispatch(prompts(64), [0.0] * 64, [f"g{i}" for i in range(4)], ctx)
    counts = sorted(sum(a.worker == w for a in out) for w in ("g0", "g1", "g2", "g3"))
    assert counts == [16] * 4 and sched.metrics()["long_tail_instances"] == 0
    # partly tied: the tied ones share one prior, the others keep their rank's
    priors = prior_from_scores([3.0, 1.0, 1.0, 1.0, 0.0], observed)
    assert priors[1] == priors[2] == priors[3] and priors[0] > priors[1] > priors[4]


def test_fcfs_is_round_robin_without_priorities():
    out = FCFS(FCFSConfig()).dispatch(prompts(5), [0] * 5, ["a", "b"], DispatchContext(1))
    assert [(a.worker, a.priority) for a in out] == [("a", 0), ("b", 0), ("a", 0), ("b", 0), ("a", 0)]


def linear(ctx_tokens):  # a latency model: 1 ms per step + 1 us per context token
    return 1e-3 + 1e-6 * ctx_tokens


def test_makespan_integrates_the_latency_over_a_growing_context():
    by_hand = sum(linear(4 * (100 + t)) for t in range(1000))
    assert makespan(4, 1000, 100, linear) == pytest.approx(by_hand, rel=1e-3)


def test_best_split_picks_the_smallest_estimated_makespan():
    args = dict(n_long=16, n_regular=112, workers=8, long_len=8000, regular_len=1000, prompt_tokens=500)
    m, t = best_split(**args, step_latency=linear)
    # brute force over every choice, with the same estimates
    a, b = 2, 14
    mixed = makespan(a + b, 1000, 500, linear) + makespan(a, 7000, 1500, linear)
    candidates = {0: mixed}
    for k in range(1, 8):
        candidates[k] = max(makespan(math.ceil(16 / k), 8000, 500, linear),
                            makespan(math.ceil(112 / (8 - k)), 1000, 500, linear))
    assert t == pytest.approx(min(candidates.values()))
    assert m == min(candidates, key=candidates.get)
    # a latency that does not depend on the batch gains nothing from separating long requests
    assert best_split(**args, step_latency=lambda c: 1e-3)[0] == 0


def test_skew_split_sends_the_predicted_long_tail_to_its_own_instances():
    # a profile and lengths where splitting pays: the long tail is 2x the regular length and a
    # decode step costs mostly a fixed 1 ms, so long requests decode faster on their own
    # instances than mixed into the regular batch (best_split's estimate, checked below)
    ctx = DispatchContext(8, observed_lengths=[100] * 90 + [200] * 10, prompt_tokens=10,
                          step_latency=lambda c: 1e-3 + 1e-6 * c)
    sched = Skew(SkewConfig(alpha=0.2))
    scores = list(range(20))  # prompt 19 longest; the top 4 (16..19) are the long tail
    workers = [f"g{i}" for i in range(4)]
    out = sched.dispatch(prompts(20), scores, workers, ctx)
    m = sched.metrics()["long_tail_instances"]
    assert m == best_split(32, 128, 4, 200, 100, 10, ctx.step_latency)[0] == 2
    long_workers = {a.worker for a in out if a.index >= 16}
    regular_workers = {a.worker for a in out if a.index < 16}
    assert long_workers == {"g0", "g1"} and regular_workers == {"g2", "g3"}
    assert sorted(a.index for a in out) == list(range(20))  # every prompt placed once
    # longest predicted first inside an instance
    prio = {a.index: a.priority for a in out}
    assert prio[19] > prio[16] > prio[15] > prio[0]
    # without the split the same prompts are only balanced over all four instances
    unsplit = Skew(SkewConfig(alpha=0.2, split=False))
    assert {a.worker for a in unsplit.dispatch(prompts(20), scores, workers, ctx) if a.index >= 16} == set(workers)
    assert unsplit.metrics()["long_tail_instances"] == 0
    # scores tied across the long-tail boundary: nothing says which of the tied are long, no split
    tied = [2.0] * 3 + [1.0] * 10 + [0.0] * 7
    sched.dispatch(prompts(20), tied, workers, ctx)
    assert sched.metrics()["long_tail_instances"] == 0


def test_history_ranker_remembers_prompts_across_steps():
    r = HistoryRanker(HistoryRankerConfig())
    a, b, c = Prompt("0-0", "long one"), Prompt("0-1", "short one"), Prompt("1-0", "never seen")
    r.observe([a, b], [[900, 1100], [10, 12]])
    r.observe([b], [[14]])  # a later step: state accumulates
    s = r.predict([a, b, c])
    assert s[0] > s[2] > s[1]  # unseen prompts rank in the middle


def test_learned_ranker_generalises_to_unseen_prompts():
    rng = random.Random(0)
    words = {"tiny": 20, "small": 60, "mid": 200, "big": 800, "huge": 3000}

    def batch(n):
        ps, ls = [], []
        for i in range(n):
            w = rng.choice(list(words))
            ps.append(Prompt(str(i), f"task {rng.randint(0, 10**6)} {w}"))
            ls.append([int(words[w] * math.exp(rng.gauss(0, 0.2))) for _ in range(4)])
        return ps, ls

    ranker = LearnedRanker(LearnedRankerConfig())
    for _ in range(6):
        ranker.observe(*batch(64))
    test_p, test_l = batch(200)  # fresh prompt texts: history could not rank them
    actual = [sum(map(math.log, ls)) / 4 for ls in test_l]
    recall = top_recall(ranker.predict(test_p), actual)
    # the best any ranker can do from the text: the word's true length (ties inside a word
    # class are noise no prompt reveals)
    ceiling = top_recall([math.log(words[p.text.split()[-1]]) for p in test_p], actual)
    assert recall >= ceiling - 0.05 and recall > 0.6, (recall, ceiling)


@pytest.mark.parametrize("kind", ["history", "learned"])
def test_a_ranker_restored_from_its_state_predicts_and_learns_on_exactly_as_the_original(kind):
    import io

    import torch

    def build():
        return HistoryRanker(HistoryRankerConfig()) if kind == "history" else LearnedRanker(LearnedRankerConfig())

    rng = random.Random(1)
    steps = [([Prompt(f"{s}-{i}", f"count {rng.randint(1, 500)} things") for i in range(16)],
              [[rng.randint(5, 900) for _ in range(2)] for _ in range(16)]) for s in range(4)]
    original = build()
    for ps, ls in steps[:2]:
        original.observe(ps, ls)
    buf = io.BytesIO()
    torch.save(original.state_dict(), buf)  # as a checkpoint holds it
    restored, fresh = build(), build()
    restored.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
    probe = steps[0][0] + steps[3][0]
    assert restored.predict(probe) == original.predict(probe)
    assert fresh.predict(probe) != original.predict(probe)  # (so the state is what carries it)
    for ps, ls in steps[2:]:  # and both go on learning the same way (buffer, Adam, sampling RNG)
        original.observe(ps, ls)
        restored.observe(ps, ls)
    assert restored.predict(probe) == original.predict(probe)

