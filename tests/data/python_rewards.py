"""Reward functions written as for verl and TRL, for ``[reward] name = "python"``
(tests/test_rewards.py). Each records what it was called with in ``CALLS``."""

CALLS = []


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl: 1.0 when the response is the ground truth."""
    CALLS.append(("compute_score", data_source, solution_str, ground_truth, extra_info))
    return 1.0 if solution_str.strip() == str(ground_truth) else 0.0


def scored_dict(data_source, solution_str, ground_truth, extra_info=None):
    """verl's dict result: the score and values to log (a string among them is not logged)."""
    acc = solution_str.strip() == str(ground_truth)
    return {"score": 2.0 if acc else -1.0, "acc": acc, "pred": solution_str.strip(), "length": len(solution_str)}


def contains_solution(prompts, completions, solution, **kwargs):
    """TRL: 1.0 when the completion contains the row's ``solution`` column; None (no reward)
    for a row without one."""
    CALLS.append(("contains_solution", prompts, completions, solution, kwargs))
    out = []
    for completion, sol in zip(completions, solution):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        out.append(None if sol is None else float(str(sol) in text))
    return out


def shorter(prompt, response):
    """streamrl's own (prompt, response): a tenth of a point off per character."""
    return -len(response) / 10


def misbehaves(data_source, solution_str, ground_truth, extra_info=None):
    """verl-style, but fails in every way a reward can, chosen by the response."""
    if solution_str == "raise":
        raise ZeroDivisionError("nothing to divide")
    if solution_str == "none":
        return None
    if solution_str == "text":
        return "1.0"
    if solution_str == "nan":
        return float("nan")
    if solution_str == "nodict":
        return {"acc": 1.0}
    if solution_str == "textdict":
        return {"score": "1"}
    if solution_str == "bytes":
        return b"1"
    return 1.0


def wrong_length(prompts, completions, **kwargs):
    """TRL, but gives one score too many for a batch (one completion alone: right)."""
    return [1.0] * (len(completions) + (len(completions) > 1))


def two_args(a, b):
    """Neither convention."""
    return 0.0


def answer_in(prompts, completions, answer, **kwargs):
    """TRL, with the task's own answer (streamrl passes ``answer`` when the row has no such
    column): 1.0 when the completion contains it."""
    return [float(str(a) in c) for a, c in zip(answer, completions)]
