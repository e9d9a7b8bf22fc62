"""The slot engine's requests and its slot table (``engines/slots.py`` runs the loop over them).

A request's whole state lives in one :class:`Request`, from the call that queues it (a group's
sample, a served request, a moved sample's continuation) to its hand-back; once it is queued only
the loop's thread changes it, but for :attr:`Request.moving`, which ``move_out`` sets from the
thread that asks (a flag the loop reads at its next turn). :class:`SlotTable` decides where admitted
requests go and owns which slot holds which request: the decode loop asks it, never keeps a
table of its own.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from streamrl.engines.adapters import POLICY
from streamrl.sample import Prompt


@dataclass(eq=False)
class Request:
    """One request in the slot engine."""

    rid: str
    """Its id: ``<prompt uid>-<k>`` for a task's sample, the caller's for a served request."""
    limit: int
    """Most new tokens it may decode (``engine.max_new_tokens`` or fewer)."""
    greedy: bool = False
    """The argmax instead of a draw (held-out evaluation, a served request at temperature 0)."""
    streamed: bool = False
    """Its tokens are followed step by step: each token's policy version is recorded (and
    :attr:`on_tokens`, if any, is called), so a weight load mid-response shows. Served requests
    and the continuation of a moved sample are."""
    on_tokens: Callable[[list[int], list[float], int], None] | None = None
    """A served request's callback, handed each step's new tokens, their log-probs and the
    version that decoded them, from the loop's thread."""
    adapter: str = POLICY
    """The LoRA adapter it decodes with, by name (``engines/adapters.py``): the served policy's,
    or a learner's variant; the base weights alone while the engine holds no such adapter."""
    adapter_index: int = 0
    """The bank's index of that adapter while it runs (set at admission; 0: the base)."""
    watch: Prompt | None = None
    """The prompt the reward's ``stop_early`` is asked about as the response grows (None: the
    response is not watched)."""
    watched_at: int = 0
    """Tokens the response had when the watch last asked."""
    task: bool = False
    """A task's sample a straggler mover may see (:meth:`SlotEngine.requests_now`)."""
    prompt_tokens: int = 0
    """Its prompt's tokens (for the mover's estimate of what a move costs)."""
    brought: int = 0
    """Response tokens it brought from the instance it was moved from."""
    movable: bool = False
    """It may be taken out to go on elsewhere (``Engine.move_out``)."""
    slot: int | None = None
    """The slot that holds it while it decodes (None: waiting, or done)."""
    sent: int = 0
    """Tokens already handed to :attr:`on_tokens` (and stamped with a version)."""
    versions: list[int] = field(default_factory=list)
    """The policy version of each token so far, when :attr:`streamed`."""
    marks: list[tuple[int, int]] = field(default_factory=list)
    """Not streamed: ``(tokens decoded before it, version)`` where a policy began decoding the
    response -- at its admission, and at each weight load while it held a slot -- which
    :func:`token_versions` spells out per token when it ends."""
    ended_early: bool = False
    """The watch ended it: its response says ``stopped_early``."""
    moving: bool = False
    """Asked to be taken out at the loop's next turn (``move_out``)."""


class SlotTable:
    """Which slot holds which request, and where the next admitted request goes: the lowest free
    slot, so a step runs over as few slots as the requests in flight need."""

    def __init__(self, slots: int):
        self.slots = slots
        self._free = list(range(slots))  # a heap
        self.running: dict[int, Request] = {}
        """Slot -> the request decoding in it."""

    def has_room(self) -> bool:
        """Whether a slot is free."""
        return bool(self._free)

    def place(self, request: Request) -> int:
        """Give ``request`` the lowest free slot (there must be one) and return it."""
        slot = heapq.heappop(self._free)
        self.running[slot] = request
        request.slot = slot
        return slot

    def free(self, slot: int) -> Request:
        """The request that held ``slot``, which is free again."""
        request = self.running.pop(slot)
        request.slot = None
        heapq.heappush(self._free, slot)
        return request

    def highest(self) -> int:
        """The highest slot in use (some must be)."""
        return max(self.running)

    def slot_of(self, rid: str) -> int | None:
        """The slot request ``rid`` decodes in, or None."""
        return next((s for s, r in self.running.items() if r.rid == rid), None)


def token_versions(marks: list[tuple[int, int]], tokens: int) -> list[int] | None:
    """The version of each of a response's ``tokens`` from its :attr:`Request.marks`; None when
    one version decoded them all (the sample's ``policy_version`` says it)."""
    if len({version for _, version in marks}) <= 1:
        return None
    out = []
    for (at, version), (until, _) in zip(marks, marks[1:] + [(tokens, None)]):
        out += [version] * max(0, min(until, tokens) - len(out))
    return out
