"""Length ranking and dispatch: the ``ranker`` and ``scheduler`` contracts.

Plugins import these from ``streamrl.api``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from streamrl.sample import Prompt


class Ranker:
    """Predicts which prompts will have long outputs (StreamRL's output-length ranker).

    Lives on one worker for the whole run (the ``rank`` pool, else the first reward worker), so
    it may keep state. Its recall of the longest 20% is logged every step (``ranker_recall``).
    """

    def predict(self, prompts: list[Prompt]) -> list[float]:
        """One score per prompt, higher = longer output (any scale)."""
        raise NotImplementedError

    def observe(self, prompts: list[Prompt], lengths: list[list[int]]) -> None:
        """After a step: each prompt's observed output lengths (one per sample)."""

    def state_dict(self) -> dict:
        """What the ranker has learned, for a checkpoint (picklable: plain values and tensors).
        A resumed run hands it to :meth:`load_state_dict` of a freshly built ranker, so it
        predicts as well as before the stop. Default: nothing to keep."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""

    def close(self) -> None:
        """Release resources."""


@dataclass
class Assignment:
    """Where and how one prompt group is generated (what a scheduler returns per prompt)."""

    index: int
    """Position of the prompt in the list given to ``dispatch``."""
    worker: str
    """Name of the generate worker (engine instance), one of ``workers``."""
    priority: float = 0.0
    """Higher is admitted first by the engine."""
    samples: tuple[int, ...] = ()
    """Which of the group's samples (0-based) this assignment generates; empty: all of them. A
    scheduler may split a group into chunks on different workers: one assignment per chunk,
    together covering every sample exactly once."""


@dataclass
class DispatchContext:
    """What a scheduler knows when it dispatches a step."""

    samples_per_prompt: int
    """Samples generated per prompt (requests per group)."""
    observed_lengths: list[int] = field(default_factory=list)
    """Output lengths seen so far in the run (all samples, most recent 8192), for estimates."""
    prompt_tokens: float = 0.0
    """Typical prompt length in tokens (mean over the last step)."""
    step_latency: Callable[[float], float] | None = None
    """Seconds of one decode step given the running batch's total context tokens (from
    :meth:`Engine.decode_latency`); None when the engine has no profile."""


class Scheduler:
    """Places a step's prompt groups on generate workers and orders them (on the client)."""

    moves_samples: bool = False
    """True when the scheduler moves running samples between instances (:meth:`moves`): each
    chunk is then generated so that a sample can leave it, and a mover in the ``streamrl``
    process shows the scheduler what every engine decodes, a few times a second. It needs an
    engine whose capabilities say ``moves_samples``."""

    def dispatch(self, prompts: list[Prompt], scores: list[float], workers: list[str],
                 ctx: DispatchContext) -> list[Assignment]:
        """One :class:`Assignment` per prompt: ``scores`` are the ranker's (all 0.0 without
        one), ``workers`` the generate workers' names."""
        raise NotImplementedError

    def needs_scores(self, workers: list[str], ctx: DispatchContext) -> bool:
        """Whether this step's placement uses the ranker's scores. Ranking is a round trip to
        the rank worker before the step's generation is submitted, and each step's lesson costs
        the ranker's worker CPU; a scheduler that has nothing to place by length (no long tail
        in the lengths seen, say) answers False, and the step is dispatched with
        every score 0.0 and teaches the ranker nothing. Default: True."""
        return True

    def observe(self, prompts: list[Prompt], lengths: list[list[int]]) -> None:
        """After a step: each of its prompts' observed output lengths (one per sample), in the
        order ``dispatch`` got them. A scheduler that learns across steps (how far a group's
        lengths land from its estimate) uses it; default: nothing."""

    def moves(self, instances: list) -> list[tuple[str, int, int]]:
        """For a scheduler that ``moves_samples``: ``instances`` is what each generate worker's
        engine decodes now (a :class:`~streamrl.api.RequestsNow` each, in the order ``dispatch``
        got the workers; None for one that did not answer); returns the samples to move now as
        ``(sample uid, index of the worker it leaves, index of the one that finishes it)``."""
        return []

    def metrics(self) -> dict[str, float]:
        """Optional: numbers about the last dispatch, merged into the step's metrics record."""
        return {}

    def state_dict(self) -> dict:
        """What the scheduler has learned across steps, for a checkpoint (JSON values). A
        resumed run hands it to :meth:`load_state_dict` of a freshly built scheduler, so it
        places as the uninterrupted run would have. Default: nothing to keep."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""

    def close(self) -> None:
        """Release resources."""
