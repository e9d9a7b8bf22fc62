"""Followed requests in the slot engine: each step's new tokens handed to the request's callback,
stamped with the policy version that decoded them, and cancels taken by the loop at its next turn.

A request is *followed* (``Request.streamed``) when it is served to a client or continues a
sample moved from another instance: a weight load mid-response must show in its tokens'
versions. The decode loop (``engines/slots.py``) calls :meth:`TokenStreams.emit` after each
prefill and decode step and :meth:`TokenStreams.take_cancels` at the start of a turn when cancels
are pending (:meth:`TokenStreams.pending`); any thread may call :meth:`TokenStreams.cancel` (a
client that went away, a stop sequence found, a sample asked to move).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from streamrl.engines.slot_requests import Request


class TokenStreams:
    """The followed requests' tokens, as they are decoded, and the cancels asked for."""

    def __init__(self, version_of: Callable[[str], int], wake: threading.Event):
        # ``version_of(adapter)``: the version that decodes with that adapter now; ``wake``: the
        # loop's, set so that a cancel is taken at once even by an idle loop
        self._version_of = version_of
        self._wake = wake
        self._cancels: set[str] = set()
        self._lock = threading.Lock()

    def cancel(self, rid: str) -> None:
        """Ask the loop to stop request ``rid`` at its next turn (any thread)."""
        with self._lock:
            self._cancels.add(rid)
        self._wake.set()

    def pending(self) -> bool:
        """Whether cancels wait for the loop's next turn."""
        return bool(self._cancels)

    def take_cancels(self) -> set[str]:
        """The cancels asked for since the last call (the loop's thread)."""
        with self._lock:
            cancels, self._cancels = self._cancels, set()
        return cancels

    def emit(self, running: dict[int, Request], decoder) -> None:
        """Hand each followed request in ``running`` (slot -> request) the tokens ``decoder``
        decoded for it since the last call, with their log-probs and version. A callback that
        raises cancels its own request; the loop goes on. A callback with a ``flush`` attribute
        has it called once after the step's callbacks (distinct flushes once each): a consumer
        may hold what it was given until then (``SlotEngine.flushes_token_callbacks``)."""
        live = [(slot, r) for slot, r in running.items() if r.streamed]
        if not live:
            return
        idx = torch.tensor([slot for slot, _ in live], device=decoder.device)
        counts = decoder.generated[idx].tolist()
        sent = [r.sent for _, r in live]
        width = max(n - s for n, s in zip(counts, sent))
        if width <= 0:
            return
        # only the columns decoded since the last call (one, between two steps): copying whole
        # rows of max_new_tokens cost the loop time that grew with the responses' limit
        cols = (torch.tensor(sent)[:, None] + torch.arange(width)).clamp(max=decoder.max_new_tokens - 1)
        cols = cols.to(decoder.device)
        tokens = decoder.out_tokens[idx[:, None], cols].tolist()
        logprobs = decoder.out_logprobs[idx[:, None], cols].tolist()
        flushes = {}
        for (slot, r), n, toks, lps in zip(live, counts, tokens, logprobs):
            if n <= r.sent:
                continue
            new_tokens, new_lps = toks[:n - r.sent], lps[:n - r.sent]
            version = self._version_of(r.adapter)
            r.versions.extend([version] * len(new_tokens))
            r.sent = n
            if r.on_tokens is not None:
                try:
                    r.on_tokens(new_tokens, new_lps, version)
                except KeyboardInterrupt:
                    raise
                except BaseException:  # noqa: BLE001 -- a consumer's failure is its own; the loop goes on
                    # (SystemExit or a CancelledError too: raised here, it would end the decode loop
                    # and every request after it)
                    self.cancel(r.rid)
                flush = getattr(r.on_tokens, "flush", None)
                if flush is not None:
                    flushes[flush] = None  # (one call per distinct flush: a server's requests share one)
        for flush in flushes:
            try:
                flush()
            except KeyboardInterrupt:
                raise
            except BaseException:  # noqa: BLE001 -- as a callback's: its consumer's, not the loop's
                pass
