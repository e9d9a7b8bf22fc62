"""W2 ``countdown``: the long-tail task for the real engine, its reward, and ranking its prompts."""

from __future__ import annotations

import math

from streamrl.ranking.rankers import LearnedRanker, LearnedRankerConfig, OracleRanker, OracleRankerConfig
from streamrl.ranking.recall import top_recall
from streamrl.sample import Prompt
from streamrl.tasks.countdown import (CountdownConfig, CountdownReward, CountdownRewardConfig, CountdownTask,
                                      countdown)


def test_lengths_have_the_w2_long_tail_and_belong_to_the_prompt():
    task = CountdownTask(CountdownConfig())
    ps = [p for step in range(40) for p in task.prompts(step, 32)]
    lengths = sorted(len(p.answer["target"]) for p in ps)
    median, p99 = lengths[len(lengths) // 2], lengths[int(0.99 * len(lengths))]
    assert 18 <= median <= 32 and lengths[0] >= 4 and lengths[-1] <= 256, (median, lengths[0], lengths[-1])
    assert p99 > 4 * median  # a heavy tail, not a spread around the median
    for p in ps[:50]:  # the prompt alone fixes the answer, hence the length
        n = int(p.text.rstrip(":"))
        assert p.answer["target"] == countdown(n)
        assert p.answer["log_median"] == math.log(len(countdown(n)))
    assert [p.text for p in task.prompts(3, 8)] == [p.text for p in task.prompts(3, 8)]  # same step, same prompts


def test_countdown_reward_is_exact_or_prefix_credit():
    prompt = Prompt("0-000", "5:", {"target": countdown(5), "log_median": math.log(9)})
    reward = CountdownReward(CountdownRewardConfig(prefix_credit=0.5))
    assert reward.score(prompt, "5 4 3 2 1") == 1.0
    assert reward.score(prompt, "5 4 3 2 1 0") == 0.5 * 5 / 5  # right numbers, wrong stop: not exact
    assert reward.score(prompt, "5 4 9 2 1") == 0.5 * 2 / 5
    assert reward.score(prompt, "") == 0.0
    assert CountdownReward(CountdownRewardConfig(prefix_credit=0)).score(prompt, "5 4 3") == 0.0


def test_learned_ranker_reaches_the_recall_target_on_countdown_prompts():
    # the lengths an engine that counts correctly would produce; the ranker sees only prompt text
    task = CountdownTask(CountdownConfig())
    ranker = LearnedRanker(LearnedRankerConfig())
    for step in range(4):  # four warm-up steps of 32 prompts, as in recipes/longtail-cpu.toml
        ps = task.prompts(step, 32)
        ranker.observe(ps, [[len(p.answer["target"])] * 8 for p in ps])
    recalls = []
    for step in range(100, 110):  # later steps, many prompts never seen
        ps = task.prompts(step, 32)
        recalls.append(top_recall(ranker.predict(ps), [p.answer["log_median"] for p in ps]))
        assert top_recall(OracleRanker(OracleRankerConfig()).predict(ps), [p.answer["log_median"] for p in ps]) == 1.0
    # without the numeric features (n-grams of the digits only) this is ~0.72
    assert sum(recalls) / len(recalls) >= 0.87, recalls
