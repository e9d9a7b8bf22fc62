"""Prompt sources and rewards: the ``task`` and ``reward`` contracts.

Plugins import these from ``streamrl.api``."""

from __future__ import annotations


from streamrl.sample import Prompt


class Task:
    """The prompt source of a run (runs in the ``streamrl`` process).

    ``prompts(step, n)`` must be deterministic in its config (``seed``) and ``step``, so a run
    can be repeated. A config field named ``seed`` that the recipe leaves unset gets ``run.seed``.
    """

    alphabet: str = ""
    """Characters of the task's text; with :meth:`example`, lets ``streamrl model init`` make a
    tiny character-level model for the task. Empty: the task cannot make one."""

    def prompts(self, step: int, n: int) -> list[Prompt]:
        """The ``n`` prompts of ``step``; every ``Prompt.uid`` unique within the run."""
        raise NotImplementedError

    def eval_prompts(self) -> list[Prompt]:
        """Held-out prompts for evaluation (``[eval]``), the same every call; uids unique among
        themselves (they never reach training). Empty: the task has no held-out set."""
        return []

    def example(self, rng) -> tuple[str, str]:
        """One ``(prompt text, answer text)`` pair drawn with ``rng`` (``random.Random``), for
        the supervised warm start of ``streamrl model init``."""
        raise NotImplementedError(f"{type(self).__name__} cannot make examples for a tiny model")

    def max_prompt_chars(self) -> int:
        """Longest prompt in characters (sizes a tiny model's context)."""
        return 16

    def max_response_chars(self) -> int:
        """Longest answer in characters (sizes a tiny model's context)."""
        return 8

    def close(self) -> None:
        """Release resources at the end of the run."""


class Reward:
    """Scores one response (runs in reward tasks on the reward pool).

    Must be thread-safe: a reward worker runs several tasks at once. A score is a number, or a
    dict with the number under ``"score"`` and other named numbers beside it, each logged per
    step as ``reward/<name>/mean`` (the sample's :attr:`~streamrl.sample.Sample.reward_info`;
    values that are not numbers are left out). A reward that raises, gives something that is
    not a finite number, or has not returned within ``reward.score_timeout_s`` (the late call is
    abandoned on its thread, not stopped) scores that sample 0 and is counted in
    ``reward_errors``; the run goes on.
    """

    def score(self, prompt: Prompt, response: str) -> float | dict[str, float]:
        """The reward of ``response`` (decoded text) to ``prompt`` (``prompt.answer`` holds what
        the task put there to check it; ``prompt.columns`` the rest of its dataset row)."""
        raise NotImplementedError

    def stop_early(self, prompt: Prompt, text: str) -> bool:
        """Whether a response still being generated, ``text`` so far, can stop here: its reward
        can no longer change (a format already broken, a wrong number already written), so the
        rest of its generation would be wasted. Asked by an engine that watches responses
        (``engine.stop_early_every``), on the generate worker, every few tokens: it must be
        quick. A response stopped is scored and trained as it stands. Default: never."""
        return False

    def score_group(self, prompts: list[Prompt], responses: list[str]) -> list:
        """The scores of several responses at once (a group: one prompt's samples), in order,
        each what :meth:`score` returns, or the exception that sample failed with (scored 0 and
        counted, like a raise from :meth:`score`). Override it to score in one call (a batched
        reward model, a TRL-style function); :meth:`score` must still work: when this raises or
        gives the wrong number of scores, every response is scored alone with it, so one bad
        response fails alone. Default: :meth:`score` on each."""
        out = []
        for prompt, response in zip(prompts, responses):
            try:
                out.append(self.score(prompt, response))
            except Exception as exc:  # that sample fails, not the group
                out.append(exc)
        return out

    @classmethod
    def scores_groups(cls) -> bool:
        """Whether this reward scores a group in one call (it overrides :meth:`score_group`);
        when not, streamrl scores each response alone, each within its own time limit."""
        return cls.score_group is not Reward.score_group

    def close(self) -> None:
        """Release resources (a reward model, a sandbox) when the worker shuts down."""
