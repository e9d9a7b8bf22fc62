"""What a generate worker's engine hands back, checked before it is scored and trained: an
engine is a plugin, and a mistake of its shape (a group short, a sample of another prompt, a
log-prob that is not a number) would otherwise train without a word."""

from __future__ import annotations

import math

from streamrl.errors import RunStopped
from streamrl.sample import Group, Prompt


def checked_groups(engine, prompts: list[Prompt], n: int, groups) -> list[Group]:
    """What an engine's ``generate_groups`` returned, checked before it is scored and trained:
    one group per prompt, in order, each of ``n`` :class:`~streamrl.sample.Sample` of that
    prompt, with prompt tokens, and as many log-probs (and loss-mask entries) as response tokens (or
    none, as a simulated engine gives). A plugin engine's mistake stops the run
    in one line naming the engine (:class:`~streamrl.errors.RunStopped`: nothing of the step is
    applied); trained on, it would pair samples with other prompts' rewards or scale a step's
    gradient by samples that are not there, without a word."""
    from streamrl.sample import Sample

    said = f"engine {type(engine).__name__}: generate_groups()"
    groups = list(groups) if isinstance(groups, (list, tuple)) else groups
    if not isinstance(groups, list) or len(groups) != len(prompts):
        got = f"{len(groups)} groups" if isinstance(groups, list) else type(groups).__name__
        raise RunStopped(f"{said} returned {got} for {len(prompts)} prompts; expected one group of {n} samples per "
                         "prompt, in order; nothing of this step was applied")
    for prompt, group in zip(prompts, groups):
        if not isinstance(group, list) or len(group) != n:
            got = f"{len(group)} samples" if isinstance(group, list) else type(group).__name__
            raise RunStopped(f"{said} returned {got} for prompt {prompt.uid!r}; expected {n} (a list of Sample); "
                             "nothing of this step was applied")
        for s in group:
            if not isinstance(s, Sample) or not str(s.uid).startswith(f"{prompt.uid}-"):
                what = f"sample {s.uid!r}" if isinstance(s, Sample) else f"a {type(s).__name__}"
                raise RunStopped(f"{said} returned {what} in the group of prompt {prompt.uid!r}; expected Samples "
                                 f"with uids '{prompt.uid}-<k>'; nothing of this step was applied")
            if not s.prompt_ids:  # (the token before the response predicts its first: there must be one)
                raise RunStopped(f"{said} returned sample {s.uid!r} with no prompt tokens; expected the ids its "
                                 "response was generated after (at least a BOS); nothing of this step was applied")
            if s.loss_mask and len(s.loss_mask) != len(s.response_ids):
                raise RunStopped(f"{said} returned sample {s.uid!r} with {len(s.response_ids)} response tokens "
                                 f"and a loss_mask of {len(s.loss_mask)}; expected one per token (or none); nothing "
                                 "of this step was applied")
            if s.logprobs and len(s.logprobs) != len(s.response_ids):  # (none: a simulated engine's)
                raise RunStopped(f"{said} returned sample {s.uid!r} with {len(s.response_ids)} response tokens "
                                 f"and {len(s.logprobs)} log-probs; expected one per token; nothing of this step "
                                 "was applied")
            bad = [x for x in s.logprobs or () if not _finite(x)]
            if bad:  # (a NaN or -inf behaviour log-prob makes every weight and ratio of the batch NaN)
                raise RunStopped(f"{said} returned sample {s.uid!r} with a log-prob of {str(bad[0])[:40]!r}; expected finite "
                                 "log-probabilities of the tokens it sampled; nothing of this step was applied")
    return groups


def _finite(x) -> bool:
    try:  # (a float, or a number that is one: numpy's, a 0-d tensor)
        return not isinstance(x, (bool, str)) and math.isfinite(float(x))
    except (TypeError, ValueError, OverflowError):
        return False
