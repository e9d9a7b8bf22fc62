"""Responses ended early in the slot engine: a reward's ``stop_early(prompt, text)`` asked about
each watched response every ``engine.stop_early_every`` tokens, so that a response it calls
hopeless frees its slot at once (its tokens so far are its sample, marked ``stopped_early``).

Only responses queued while a reward watches carry a prompt to ask about (``Request.watch``);
the decode loop (``engines/slots.py``) asks :meth:`EarlyStopWatch.stops` after each decode step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from streamrl.engines.slot_requests import Request
from streamrl.errors import RunWarning
from streamrl.sample import Prompt


class EarlyStopWatch:
    """The reward that may end responses early, and when it is next asked about each."""

    def __init__(self, every: int, response_text: Callable[[list[int]], str]):
        self.every = every
        self.response_text = response_text
        self.reward = None
        """The reward whose ``stop_early`` is asked (None: nothing is watched)."""
        self.failed = False  # (whether it has raised: said once, not per response)

    def watching(self, prompt: Prompt | None) -> Prompt | None:
        """What a new request's watch asks about: its prompt while a reward watches."""
        return prompt if self.reward is not None else None

    def stops(self, running: dict[int, Request], decoder) -> list[int]:
        """The slots (of ``running``, slot -> request) whose responses the reward ends now: the
        watched ones that decoded another ``every`` tokens and that it calls hopeless. Each is
        marked ``ended_early``; a reward that raises stops nothing (it scores the response later)."""
        if self.reward is None:
            return []
        live = [(slot, r) for slot, r in running.items() if r.watch is not None]
        if not live:
            return []
        idx = torch.tensor([slot for slot, _ in live], device=decoder.device)
        # (one read of both: a response that ended by itself -- its EOS, its limit -- in the step
        # its watch came due is not asked about: stopped then, it read as ended early)
        read = torch.stack((decoder.generated[idx], decoder.finished[idx].to(decoder.generated.dtype)))
        counts, ended = read.tolist()
        due = [(slot, r, n) for (slot, r), n, e in zip(live, counts, ended)
               if n - r.watched_at >= self.every and not e]
        if not due:
            return []
        rows = decoder.out_tokens[torch.tensor([s for s, _, _ in due], device=decoder.device)].tolist()
        stop = []
        for (slot, r, n), row in zip(due, rows):
            r.watched_at = n
            try:
                hopeless = bool(self.reward.stop_early(r.watch, self.response_text(row[:n])))
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # noqa: BLE001 -- a watch that fails stops nothing; the reward scores it later
                # (sys.exit() in a grader, a CancelledError of its own loop: not Exceptions, and
                # raised here they would end the decode loop, and every request after with it)
                hopeless = False
                if not self.failed:
                    self.failed = True
                    warnings.warn(f"the reward's stop_early raised {type(exc).__name__}: {str(exc)[:200]}; "
                                  "it stops no response (said once)", RunWarning, stacklevel=2)
            if hopeless:
                stop.append(slot)
                r.ended_early = True
        return stop
