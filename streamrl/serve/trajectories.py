"""An agent's rollout as one token-faithful trajectory, on the worker that serves it.

Every call an agent makes with the ``X-Streamrl-Rollout`` header joins its rollout here. The
first call's prompt is rendered by the chat template; each later call that continues the
conversation -- its messages are the last call's, then the reply the endpoint gave, then new
ones (tool results, a user turn) -- is *not* rendered again: its prompt is the last prompt, the
exact tokens the engine generated, and the template's text for what follows the reply only.
That text is found by rendering the conversation with a placeholder in the reply's place, so the
generated tokens are never decoded and re-tokenised (which drifts: a model's tokens are not
always the tokenizer's for the same text).

The trajectory is then one sample: the first prompt, and a response made of each call's
generated tokens (trained: loss mask 1, their behaviour log-probs and policy versions) and the
template's tokens between them (context only: mask 0). A call that does not continue the
conversation (an agent that rewrote or cut its history, changed its tools or asked for a
reply in parallel) starts a new segment, rendered from scratch; the split is counted, and each
segment is a sample of the rollout's group with the rollout's reward.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from streamrl.chat import content_as_text
from streamrl.chat.messages import message_key, render
from streamrl.engines.stop_tokens import stop_ids

#: The header that ties a call to an agent's rollout (its value: the rollout's id; HTTP header
#: names are case-insensitive). The agent's client sends it, the endpoint reads it.
ROLLOUT_HEADER = "X-Streamrl-Rollout"

#: The header that proves a call is the run's own agent's: the secret the run gave its endpoints
#: and its rollouts, and nobody else (a serve client that sends :data:`ROLLOUT_HEADER` without
#: it is refused, so it can neither fill the store nor reach training through it).
ROLLOUT_KEY_HEADER = "X-Streamrl-Rollout-Key"

#: Seconds a rollout may go without a call before it is dropped from the store (an agent worker
#: that died, or a rollout abandoned without its trajectory ever being asked for).
STALE_ROLLOUT_S = 3600.0

#: Finished rollouts remembered, so that a late call of one is refused rather than begun anew.
FINISHED_KEPT = 100_000

#: Handed-over trajectories kept for a client that asks again (its first answer timed out on the
#: way): at most this many, the newest, each for :data:`HANDED_OVER_S` seconds.
HANDED_OVER_KEPT = 256
HANDED_OVER_S = 120.0

#: The most calls one rollout may make, and segments (forks, rewritten histories) it may have: an
#: agent that loops without end is refused past them, not kept until memory runs out.
MAX_CALLS = 1024
MAX_SEGMENTS = 256

#: The most rollouts in flight on one endpoint; a new one past it drops the oldest (counted with
#: the stale ones).
MAX_ROLLOUTS = 16_384


class RolloutLimit(ValueError):
    """A rollout's call past :data:`MAX_CALLS` or :data:`MAX_SEGMENTS`."""


class RolloutFinished(ValueError):
    """A call of a rollout that was finished (its trajectory handed over) or dropped."""


#: Stands in for a reply's text when the template renders a conversation around it (no
#: template writes this, so where it lands tells what the template adds after a reply).
PLACEHOLDER = "\u2063streamrl-reply\u2063"


@dataclass
class Segment:
    """One run of calls that continue each other: the sample it becomes, and what the next
    call must continue."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    history: list[tuple] = field(default_factory=list)
    """``message_key`` of the last call's messages and of the reply given: what the next call's
    messages must start with."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The last call's messages and the reply, canonical (rendering around the placeholder)."""
    tools: str = ""
    calls: int = 0
    ended_with: int | None = None
    """The stop token that ended the last call's reply (None: it ran to its limit or a stop string)."""
    busy: bool = False
    """A call of this segment is decoding (a parallel call cannot continue it)."""

    def context(self) -> list[int]:
        """Every token so far: the next call's prompt starts with them."""
        return self.prompt_ids + self.response_ids


@dataclass
class Rollout:
    """The calls of one rollout, as segments."""

    segments: list[Segment] = field(default_factory=list)
    calls: int = 0
    tool_calls: int = 0
    splits: int = 0
    active: float = field(default_factory=time.time)
    """When its last call began (a rollout idle past :data:`STALE_ROLLOUT_S` is dropped)."""


class Trajectories:
    """The rollouts in flight on this endpoint (thread-safe: the HTTP server's event loop adds,
    a rollout's end takes)."""

    def __init__(self, tokenizer, encode: Callable[[str, dict[str, str]], list[int]], stops: Iterable[int] | None = None):
        self.tokenizer = tokenizer
        self.stops = frozenset(stop_ids(tokenizer) if stops is None else stops)
        """The engine's stop tokens (``engines/stop_tokens.py``; None: the tokenizer's EOS): a reply
        ending with one ended its turn."""
        # (chat text, guarded contents) -> token ids, as the endpoint tokenizes a rendered prompt
        self.encode = encode
        self._lock = threading.Lock()
        self._rollouts: dict[str, Rollout] = {}
        self._finished: OrderedDict[str, str | None] = OrderedDict()
        """Rollouts over (None: finished; else why it was dropped): a late call of one is refused."""
        self._handed: OrderedDict[str, tuple[float, threading.Event, list]] = OrderedDict()
        """The newest trajectories handed over: when, set once the answer is built, and the
        answer (asked again -- the first reply timed out on its way back -- the same answer, once:
        the rollout's success is not lost; asked while the first is still built, it waits)."""
        self.dropped_stale = 0
        """Rollouts dropped for going :data:`STALE_ROLLOUT_S` without a call (never finished)."""

    def prompt(self, rollout_id: str, messages: list[dict[str, Any]], tools: list[dict] | None
               ) -> tuple[list[int], Segment]:
        """The prompt of a rollout's call with canonical ``messages``, and the segment it joins
        (marked busy until :meth:`add` or :meth:`abandon`). ``ValueError`` for a call of a
        rollout already finished; :class:`RolloutLimit` past a rollout's bounds. Rendering and
        tokenizing happen outside the store's lock: the server's event loop takes it when a
        call ends, and must not wait on another call's template."""
        tools_key = json.dumps(tools or [], sort_keys=True)
        keys = [message_key(m) for m in messages]

        def continues(seg: Segment) -> bool:
            k = len(seg.history)
            return (not seg.busy and seg.tools == tools_key and len(keys) > k and keys[:k] == seg.history
                    and messages[k]["role"] != "assistant")

        with self._lock:
            rollout = self._begin(rollout_id)
            candidates = [seg for seg in reversed(rollout.segments) if continues(seg)]
        for seg in candidates:
            with self._lock:  # (another call may have taken it, or the rollout ended, meanwhile)
                if not continues(seg) or self._rollouts.get(rollout_id) is not rollout:
                    continue
                seg.busy = True
            try:
                ids = self._continue(seg, messages[len(seg.history):], tools)
            except Exception:  # noqa: BLE001 -- a template that refuses the placeholder: render anew
                ids = None
            if ids is not None:
                return ids, seg
            with self._lock:
                seg.busy = False
        with self._lock:
            if self._rollouts.get(rollout_id) is not rollout:
                self._refuse_call(rollout_id, rollout)
                raise RolloutFinished(f"rollout {rollout_id!r} is finished: its trajectory was handed over")
            if len(rollout.segments) >= MAX_SEGMENTS:
                self._refuse_call(rollout_id, rollout)
                raise RolloutLimit(f"rollout {rollout_id!r} has {MAX_SEGMENTS} segments, the most one rollout may "
                                   "have: its calls rewrote or forked the conversation that often")
            split = bool(rollout.segments)
            rollout.splits += split
            seg = Segment(prompt_ids=[], tools=tools_key, busy=True)
            rollout.segments.append(seg)
        try:
            guarded, contents = content_as_text.guard(self.tokenizer, messages)
            ids = self.encode(render(self.tokenizer, guarded, tools, generation_prompt=True), contents)
        except BaseException:  # (messages the template refuses, a prompt too long): not a call, nor a split
            with self._lock:
                if seg in rollout.segments:
                    rollout.segments.remove(seg)
                rollout.splits -= split
                self._refuse_call(rollout_id, rollout)
            raise
        seg.prompt_ids = ids
        return ids, seg

    def _begin(self, rollout_id: str) -> Rollout:
        # (under the lock) the rollout of a new call, counted: refused once finished or past its
        # calls, and the oldest rollout dropped when too many are in flight
        self._sweep()  # (first: a call of a rollout that went stale is refused with the rest)
        if rollout_id in self._finished:
            why = self._finished[rollout_id] or "its trajectory was handed over"
            raise RolloutFinished(f"rollout {rollout_id!r} is finished: {why}")
        rollout = self._rollouts.get(rollout_id)
        if rollout is None:
            while len(self._rollouts) >= MAX_ROLLOUTS:  # (an agent that makes up rollout ids)
                self._finished[next(iter(self._rollouts))] = f"dropped, {MAX_ROLLOUTS} rollouts being in flight"
                del self._rollouts[next(iter(self._rollouts))]
                self.dropped_stale += 1
            rollout = self._rollouts[rollout_id] = Rollout()
        if rollout.calls >= MAX_CALLS:
            raise RolloutLimit(f"rollout {rollout_id!r} has made {MAX_CALLS} calls, the most one rollout may make")
        rollout.calls += 1
        rollout.active = time.time()
        return rollout

    def _refuse_call(self, rollout_id: str, rollout: Rollout) -> None:
        # (under the lock) a call refused before it decoded is not counted; a rollout it began
        # and that holds nothing else is not kept
        rollout.calls -= 1
        if rollout.calls == 0 and not rollout.segments and self._rollouts.get(rollout_id) is rollout:
            del self._rollouts[rollout_id]

    def _continue(self, seg: Segment, new: list[dict[str, Any]], tools) -> list[int] | None:
        # the template's text after the reply: the reply's end of turn, the new messages and the
        # next assistant header; the reply itself is its generated tokens, as they are
        # (contents that hold a control token's string: sentinels, tokenized as text below)
        before, contents = content_as_text.guard(self.tokenizer, seg.messages[:-1])
        new, more = content_as_text.guard(self.tokenizer, new)
        contents.update(more)
        last_prompt = render(self.tokenizer, before, tools, generation_prompt=True)
        around = render(self.tokenizer, before + [{"role": "assistant", "content": PLACEHOLDER}] + new,
                        tools, generation_prompt=True)
        gap, found, after = (around[len(last_prompt):] if around.startswith(last_prompt) else "").partition(PLACEHOLDER)
        # (a template may write a space before a reply -- Mistral's -- which the model's first
        # token carries: the generated tokens stand for it)
        if not found or gap.strip():
            return None  # the template writes the reply's turn in a way tokens cannot be kept for
        end = self.tokenizer.decode([seg.ended_with]) if seg.ended_with is not None else ""
        if end and after.lstrip(" ").startswith(end):
            # the model's own end of turn stands for the template's (and a space the template
            # writes before it, after a reply it trims)
            after = after.lstrip(" ")[len(end):]
        # (the text goes on a sequence: no BOS in front of it, whatever the tokenizer adds to a prompt)
        return seg.context() + content_as_text.encode(self.tokenizer, after, contents)

    def add(self, rollout_id: str, seg: Segment, messages: list[dict[str, Any]], prompt_ids: list[int],
            tokens: list[int], logprobs: list[float], versions: list[int], reply: dict[str, Any]) -> None:
        """A call of the rollout finished: ``tokens`` generated for ``prompt_ids`` (from
        :meth:`prompt`), and the ``reply`` message the agent was given."""
        with self._lock:
            rollout = self._rollouts.get(rollout_id)
            if rollout is None:  # (the rollout ended while its call ran: nothing to join)
                return
            gap = prompt_ids[len(seg.context()):] if seg.calls else []
            fill = seg.versions[-1] if seg.versions else (versions[0] if versions else 0)
            seg.response_ids += gap + tokens
            seg.loss_mask += [0] * len(gap) + [1] * len(tokens)
            seg.logprobs += [0.0] * len(gap) + list(logprobs)
            seg.versions += [fill] * len(gap) + list(versions)
            seg.messages = messages + [reply]
            seg.history = [message_key(m) for m in seg.messages]
            seg.ended_with = tokens[-1] if tokens and tokens[-1] in self.stops else None
            seg.calls += 1
            seg.busy = False
            rollout.tool_calls += len(reply.get("tool_calls", []))

    def abandon(self, rollout_id: str, seg: Segment) -> None:
        """A call failed, was refused or was cancelled: its segment takes later calls as before
        (a segment it opened is removed, and the call is not counted)."""
        with self._lock:
            seg.busy = False
            rollout = self._rollouts.get(rollout_id)
            if rollout is None:
                return
            rollout.calls -= 1
            if seg.calls == 0 and seg in rollout.segments:
                first = rollout.segments[0] is seg
                rollout.segments.remove(seg)
                # one split fewer: this one, or (the first gone) the next, which now stands first
                if not first or rollout.segments:
                    rollout.splits -= 1

    def finish(self, rollout_id: str) -> dict[str, Any]:
        """The rollout is over: its segments (those with a reply) and counts, removed from here
        (asked again within :data:`HANDED_OVER_S`, the same answer; a rollout that never called,
        none). :class:`RolloutFinished` for one dropped here (stale, or crowded out) or handed
        over and no longer kept: an empty trajectory would read as an agent that never called the
        model, and the rollout would be lost without its reason."""
        now = time.time()
        with self._lock:
            self._forget_handed(now)
            again = self._handed.get(rollout_id)  # (asked again: the same answer, while it is kept)
            if again is None:
                rollout = self._rollouts.pop(rollout_id, None)
                if rollout is None and rollout_id in self._finished:
                    why = self._finished[rollout_id] or (f"its trajectory was handed over, and is kept "
                                                         f"{HANDED_OVER_S:.0f} s for a client that asks again")
                    raise RolloutFinished(f"rollout {rollout_id!r} is finished: {why}")
                self._finished[rollout_id] = None
                while len(self._finished) > FINISHED_KEPT:
                    self._finished.popitem(last=False)
                built, answer = threading.Event(), []
                self._handed[rollout_id] = (now, built, answer)
                while len(self._handed) > HANDED_OVER_KEPT:
                    self._handed.popitem(last=False)
        if again is not None:
            _, built, answer = again
            built.wait(HANDED_OVER_S)  # (the first answer is still being built)
            if not answer:  # (its building failed: said as the first ask was)
                raise RolloutFinished(f"rollout {rollout_id!r} is finished: its trajectory could not be built")
            return answer[0]
        if rollout is None:  # (no call of it ever came: an agent that answered without the model)
            answer.append({"segments": [], "calls": 0, "tool_calls": 0, "splits": 0})
            built.set()
            return answer[0]
        try:
            segments = [{"prompt_ids": s.prompt_ids, "response_ids": s.response_ids, "loss_mask": s.loss_mask,
                         "logprobs": s.logprobs, "policy_versions": s.versions, "calls": s.calls,
                         "text": self.tokenizer.decode(s.response_ids, skip_special_tokens=False)}
                        for s in rollout.segments if s.calls]
            answer.append({"segments": segments, "calls": rollout.calls, "tool_calls": rollout.tool_calls,
                           "splits": rollout.splits})
        finally:
            built.set()
        return answer[0]

    def _forget_handed(self, now: float) -> None:
        # (under the lock) answers kept past HANDED_OVER_S: no retry comes that late
        while self._handed and now - next(iter(self._handed.values()))[0] > HANDED_OVER_S:
            self._handed.popitem(last=False)

    def _sweep(self) -> None:
        # (under the lock) rollouts nobody will finish: their agent worker died, or gave up on them
        now = time.time()
        self._forget_handed(now)
        for rid in [rid for rid, r in self._rollouts.items() if now - r.active > STALE_ROLLOUT_S]:
            del self._rollouts[rid]
            self.dropped_stale += 1
            # (a call of it after this is refused, not begun anew: its first turns are gone, and
            # its tail alone would be trained with the whole rollout's reward)
            self._finished[rid] = f"dropped after {STALE_ROLLOUT_S:.0f} s without a call"
        while len(self._finished) > FINISHED_KEPT:
            self._finished.popitem(last=False)

    def in_flight(self) -> int:
        """Rollouts begun and not finished."""
        with self._lock:
            return len(self._rollouts)
