"""One served request against the engine: its ``n`` choices decoded in the engine's slots, their
tokens turned into text as they come, stop sequences, cancellation, and the samples the
learners get.

The engine's loop thread calls back with each decode step's tokens; :class:`Choice` keeps them
and works out the text that is new since the last event (a token that ends inside a multi-byte
character waits for the next). Everything here runs on the HTTP server's event loop, fed through
``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from streamrl.chat.decoding import plain_text
from streamrl.engines.stop_tokens import of_engine
from streamrl.sample import Group, Prompt, Sample


#: Tokens a response's text waits for a character cut between them to end. A byte-level BPE
#: token can hold the end of one character and the start of the next, so a run of them (CJK
#: text in a small vocabulary) may leave no character whole for several tokens; past this many,
#: what they decode to is sent as it is (a model writing bytes that are no text must not make
#: every later step decode all of them again).
MAX_CHARACTER_TOKENS = 64


class Inbox:
    """Events from other threads (the engine's loop) to one event loop, with one wake-up per
    batch: a decode step hands every followed choice its token, and a wake-up per choice (a
    write to the event loop's self-pipe, which also hands the interpreter lock to the waiting
    server thread) cost both threads more than the tokens' own handling (``streamrl bench
    serve``'s CPU per token). An engine that says it flushes (``flushes_token_callbacks``)
    calls :meth:`flush` once after a step's callbacks; the items posted before it go in one
    wake-up."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._items: deque = deque()
        self._lock = threading.Lock()
        self._scheduled = False

    def post(self, queue: asyncio.Queue, item, wake: bool = True) -> None:
        """Put ``item`` into ``queue`` on the event loop (any thread): soon, or with ``wake``
        False at the next :meth:`flush` or waking post."""
        with self._lock:
            self._items.append((queue, item))
            if self._scheduled or not wake:
                return
            self._scheduled = True
        self._wake()

    def flush(self) -> None:
        """Deliver what was posted without waking (any thread)."""
        with self._lock:
            if self._scheduled or not self._items:
                return
            self._scheduled = True
        self._wake()

    def _wake(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # (the loop closed: nothing is delivered, and a later post tries again)
            with self._lock:
                self._scheduled = False

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, deque()
            self._scheduled = False
        for queue, item in items:
            queue.put_nowait(item)


_INBOXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def inbox(loop: asyncio.AbstractEventLoop) -> Inbox:
    """The :class:`Inbox` of ``loop`` (one per event loop, made at its first request)."""
    found = _INBOXES.get(loop)
    if found is None:
        found = _INBOXES[loop] = Inbox(loop)
    return found


@dataclass
class Params:
    """What a request asks of its completions, checked (``openai_api.py``)."""

    max_tokens: int
    n: int = 1
    greedy: bool = False
    stop: list[str] = field(default_factory=list)
    answer: Any = None
    kept: bool = True
    """Kept to learn from once it ends (False: ``serve.max_waiting`` samples were held to learn
    from as it came; it is answered all the same)."""


@dataclass
class Choice:
    """One of a request's ``n`` completions, as it is decoded."""

    index: int
    rid: str
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    """The text decoded so far (cut at a stop sequence)."""
    sent: int = 0
    """Characters of ``text`` sent in events (a tail that may begin a stop sequence is held back)."""
    finish_reason: str | None = None
    stopped_at: int | None = None
    """Token count when a stop sequence was found: the trained response ends there."""
    stopped_early: bool = False
    """The reward's ``stop_early`` ended it (``engine.stop_early_every``): a hopeless response,
    not decoded to its end; it is trained on as far as it went."""
    prefix_at: int = 0
    read_at: int = 0
    """Tokens ``prefix_at:read_at`` were decoded into the text before the last new text, and are
    decoded again in front of new tokens (``_new_text``): a token's text can depend on the one
    before it (a word's leading space, a character split over bytes)."""


@dataclass
class Event:
    """New output of one choice: text, tokens (with log-probs and versions), or its end."""

    index: int
    text: str
    tokens: list[int]
    logprobs: list[float]
    version: int | None
    finish_reason: str | None = None


class Completion:
    """A request's choices running in the engine; :meth:`events` yields their output in order."""

    def __init__(self, engine, tokenizer, cid: str, prompt_ids: list[int], params: Params,
                 keep: frozenset[int] | None = None):
        self.engine, self.tokenizer, self.cid = engine, tokenizer, cid
        self.stops = frozenset(of_engine(engine))
        """The tokens that end a choice as a stop (``engines/stop_tokens.py``)."""
        self.keep = keep or frozenset()
        """Special tokens the choices' text keeps (a tool parser's markers); others are dropped."""
        self.prompt_ids, self.params = prompt_ids, params
        self.choices = [Choice(k, f"{cid}-{k}") for k in range(params.n)]
        self.prompt = Prompt(uid=cid, text=tokenizer.decode(prompt_ids, skip_special_tokens=True),
                             answer=params.answer, token_ids=list(prompt_ids))
        """The request as a prompt: what the reward scores and its ``stop_early`` is asked about."""
        self.started = time.time()
        self._inbox = inbox(asyncio.get_running_loop())
        # an engine that flushes its token callbacks once per step: their events wait for it
        self._batched = bool(getattr(engine, "flushes_token_callbacks", False))
        self._queue: asyncio.Queue = asyncio.Queue()
        self._open = params.n
        self._decoding, self._decoding_lock = params.n, threading.Lock()
        self._loop = asyncio.get_running_loop()
        self.on_decoded = None
        """Called on the event loop once the engine is done with every choice (decoded, failed or
        cancelled), whether or not the client has read them yet: the places the request holds
        in the engine go back then, not when a slow reader gets to its last byte."""
        self.cancelled = False
        """Whether :meth:`cancel` stopped the request (its choices are not trained)."""
        self.turn = None
        """The agent rollout's call this request is (``responses.Turn``), or None."""
        self.ended = False
        """Whether the endpoint has handed the request's end on (``responses.finished``)."""
        self.released = False
        """Whether its places in ``serve.max_pending`` went back (``responses.release``)."""
        self.working = None
        """While it decodes in this process: the work counted for this worker until it ends
        (``telemetry/bubbles.py``: its busy clock, and the elastic pool's retirement)."""
        self.first_token_at: float | None = None
        """When the first token of any choice came (time to first token, per variant)."""
        self.last_token_at: float | None = None

    def start(self) -> None:
        """Queue every choice in the engine."""
        for c in self.choices:
            future = self.engine.stream(c.rid, self.prompt_ids, self.params.max_tokens,
                                        on_tokens=self._from_engine(c.index), greedy=self.params.greedy,
                                        # (an agent's turn is not a whole response: not the reward's to end)
                                        prompt=self.prompt if self.turn is None else None)
            future.add_done_callback(self._done(c.index))

    def _from_engine(self, index: int):
        def on_tokens(tokens, logprobs, version):  # (the engine's loop thread)
            self._inbox.post(self._queue, ("tokens", index, tokens, logprobs, version), wake=not self._batched)
        on_tokens.flush = self._inbox.flush
        return on_tokens

    def _done(self, index: int):
        def done(future):  # (the engine's loop thread, or a cancelling one)
            self._inbox.post(self._queue, ("done", index, future))
            with self._decoding_lock:
                self._decoding -= 1
                last = self._decoding == 0
            if last and self.on_decoded is not None:
                try:
                    self._loop.call_soon_threadsafe(self.on_decoded)
                except RuntimeError:  # (the server's loop closed meanwhile)
                    pass
        return done

    def waiting(self) -> bool:
        """Whether more output is here already (:meth:`events` yields it without waiting): a
        stream writes what a decode step brought its choices in one go."""
        return not self._queue.empty()

    def cancel(self) -> None:
        """Stop every choice still decoding (the client went away)."""
        self.cancelled = True
        for c in self.choices:
            if c.finish_reason is None:
                self.engine.cancel(c.rid)

    async def events(self):
        """Each choice's new text and tokens as the engine decodes them, then its end."""
        while self._open:
            kind, index, *rest = await self._queue.get()
            c = self.choices[index]
            if kind == "tokens":
                tokens, logprobs, version = rest
                if c.finish_reason is not None:  # decoded after a stop sequence: not sent, not trained
                    continue
                if not all(math.isfinite(x) for x in logprobs):
                    # (a broken model or replica: its tokens are no sample of the policy, and a NaN
                    # would be invalid JSON to the client and poison a trajectory's training)
                    raise RuntimeError(f"choice {index} of {self.cid} failed: the engine gave a log-prob "
                                       "that is not a finite number")
                self.last_token_at = time.time()
                if self.first_token_at is None:
                    self.first_token_at = self.last_token_at
                c.tokens += tokens
                c.logprobs += logprobs
                c.versions += [version] * len(tokens)
                text = self._new_text(c)
                yield Event(index, text, tokens, logprobs, version, c.finish_reason)
                if c.finish_reason == "stop":
                    self.engine.cancel(c.rid)
                continue
            self._open -= 1
            future = rest[0]
            exc = future.exception()
            if exc is not None and c.finish_reason is None:  # (after its end -- a stop sequence -- it lost nothing)
                raise RuntimeError(f"choice {index} of {self.cid} failed: {exc}")
            if exc is not None:
                continue
            if c.finish_reason is None:
                # tokens not yet in the text (a character cut between them, waiting for its end
                # that now never comes): decoded as they are, or the characters they completed
                # before the cut one were lost with it -- from the client and the reward alike
                tail = self._new_text(c, final=True) if c.read_at < len(c.tokens) else ""
                response = future.result()
                if c.finish_reason is not None:  # (the tail held a stop sequence)
                    pass
                elif getattr(response, "stopped_early", False):
                    c.finish_reason, c.stopped_early = "stop", True
                elif response.tokens and response.tokens[-1] in self.stops:
                    c.finish_reason = "stop"
                else:
                    c.finish_reason = "cancelled" if self.cancelled else "length"
                rest, c.sent = c.text[c.sent:], len(c.text)  # (a tail held back for a stop sequence that never came)
                yield Event(index, tail + rest, [], [], None, c.finish_reason)

    def _new_text(self, c: Choice, final: bool = False) -> str:
        # Only the tokens since the last new text, behind the few decoded before them (decoded
        # alike in both calls, so what they print differently alone cancels out): decoding the
        # whole choice at each step cost the event loop time quadratic in its length.
        # ``final``: the choice ended, so a character cut between tokens waits for nothing.
        before = decode(self.tokenizer, c.tokens[c.prefix_at:c.read_at], self.keep)
        window = decode(self.tokenizer, c.tokens[c.prefix_at:], self.keep)
        if window.endswith("\ufffd") and len(c.tokens) - c.read_at < MAX_CHARACTER_TOKENS and not final:
            return ""  # a character cut between tokens: wait for its end
        c.prefix_at, c.read_at = c.read_at, len(c.tokens)
        full = c.text + window[len(before):]
        for stop in self.params.stop:
            at = full.find(stop, max(0, len(c.text) - len(stop)))
            if at >= 0:
                full, c.finish_reason, c.stopped_at = full[:at], "stop", len(c.tokens)
        c.text = full
        # a tail that may be the start of a stop sequence waits: sent, it could not be taken back
        hold = 0 if c.finish_reason else max((len(s) for s in self.params.stop), default=1) - 1
        upto = max(c.sent, len(full) - hold)
        new, c.sent = full[c.sent:upto], upto
        return new

    @property
    def first_token_s(self) -> float | None:
        """Seconds from the request to its first token (None: no token came)."""
        return None if self.first_token_at is None else self.first_token_at - self.started

    @property
    def token_s(self) -> float | None:
        """Seconds between two tokens of a choice after the first, on average (None: too few)."""
        longest = max((len(c.tokens) for c in self.choices), default=0)
        if self.first_token_at is None or longest < 2:
            return None
        return (self.last_token_at - self.first_token_at) / (longest - 1)

    def samples(self) -> Group:
        """The choices as training samples (a stop sequence's tokens kept: the policy made
        them), each token with the version that decoded it."""
        prompt = self.prompt
        end = time.time()
        group = []
        for c in self.choices:
            n = c.stopped_at if c.stopped_at is not None else len(c.tokens)
            versions = c.versions[:n]
            group.append(Sample(uid=c.rid, prompt=prompt, prompt_ids=list(self.prompt_ids),
                                response_ids=c.tokens[:n], logprobs=c.logprobs[:n], response_text=c.text,
                                policy_version=min(versions) if versions else self.engine.version,
                                worker=getattr(self.engine, "worker", ""),
                                token_versions=versions, times={"gen_start": self.started, "gen_end": end,
                                                                **({"stopped_early": 1.0} if c.stopped_early else {})}))
        return group


def token_ids(tokenizer, tokens) -> frozenset[int]:
    """The ids of those of ``tokens`` (strings) the tokenizer has as one token."""
    vocab = tokenizer.get_vocab()
    return frozenset(vocab[t] for t in tokens if t in vocab)


def decode(tokenizer, tokens: list[int], keep: frozenset[int]) -> str:
    """``tokens`` as text, special tokens dropped but those in ``keep`` (written as their
    strings, where a tool parser looks for them)."""
    if not keep or keep.isdisjoint(tokens):
        return plain_text(tokenizer, tokens)
    out, run = [], []
    for t in tokens:
        if t in keep:
            out += [plain_text(tokenizer, run), tokenizer.convert_ids_to_tokens(t)]
            run = []
        else:
            run.append(t)
    out.append(plain_text(tokenizer, run))
    return "".join(out)
