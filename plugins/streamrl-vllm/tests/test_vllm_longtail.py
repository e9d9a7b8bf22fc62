"""W2 with ``engine.name = "vllm"``, run the way a user runs it: the long-tail recipe with the skew
scheduler and learned ranker, vLLM's priorities carrying the scheduler's order."""

from __future__ import annotations

from recipe_runs import check_every_sample_trained_once, run


def test_longtail_recipe_ranks_and_schedules_on_vllm(tmp_path):
    # W2 with the skew scheduler and learned ranker; vLLM's priorities carry the scheduler's order
    records = run(tmp_path, "recipes/longtail-cpu.toml",
                  'engine={name="vllm", max_new_tokens=256, enforce_eager=true}',
                  "run.steps=2", "trainer.prompts_per_step=8", "trainer.samples_per_prompt=4")
    check_every_sample_trained_once(records, prompts=8, n=4)
    for r in records:
        assert 0.0 <= r["ranker_recall"] <= 1.0 and "long_tail_instances" in r
        by_prompt = {}
        for x in r["sample_log"]:
            by_prompt.setdefault(x["uid"].rsplit("-", 1)[0], set()).add(x["worker"])
        assert all(len(w) == 1 for w in by_prompt.values()) and len(by_prompt) == 8
        assert {w for ws in by_prompt.values() for w in ws} <= {"generate-0", "generate-1"}
