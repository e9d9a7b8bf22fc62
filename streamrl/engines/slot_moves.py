"""Samples moved between slot engine instances: what a straggler mover sees of an instance
(:meth:`SampleMoves.requests_now`), a running sample taken out with its tokens so far
(:meth:`SampleMoves.move_out`, handed to the :meth:`SampleMoves.generate_movable` call that asked
for it), and a moved sample finished on the instance it went to
(:meth:`SampleMoves.continue_sample`).

The engine (``engines/slots.py``) keeps one :class:`SampleMoves` and answers the ``Engine``
contract's move methods through it; its loop tells it which task samples ended
(:meth:`SampleMoves.ended`). A request leaves as moved only when the loop takes it out after
``move_out`` asked; one that ends by itself first stays where it is, finished.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, wait

import torch

from streamrl.contracts.generation import RequestsNow
from streamrl.engines.request_queue import await_response
from streamrl.engines.slot_requests import Request
from streamrl.sample import Group, Prompt, Sample

#: Ended task samples an instance remembers for :meth:`SampleMoves.requests_now` (a run without a
#: straggler mover never asks).
FINISHED_KEPT = 8192


class SampleMoves:
    """One slot engine's samples that may move, or moved, between instances."""

    def __init__(self, engine):
        self.engine = engine
        self._finished: deque[tuple[str, int]] = deque(maxlen=FINISHED_KEPT)  # since requests_now

    def ended(self, request: Request, tokens: int) -> None:
        """The loop's hand-back of ``request`` (not moved) with ``tokens`` new tokens: a task's
        sample is remembered for the next :meth:`requests_now`."""
        if request.task:
            self._finished.append((request.rid, request.brought + tokens))

    def generate_movable(self, prompt: Prompt, samples: list[int], priority: float, on_moved) -> Group:
        """The samples numbered ``samples`` of ``prompt``'s group; one taken out by
        :meth:`move_out` goes to ``on_moved`` the moment it is out (its tokens so far carry the
        version the group was asked under, as an unmoved sample's do), and comes back finished."""
        e = self.engine
        ids = e.prompt_ids(prompt)
        e.check_prompts([prompt], [ids])
        requests = [Request(f"{prompt.uid}-{k}", e.config.max_new_tokens, watch=e.watch.watching(prompt), task=True,
                            prompt_tokens=len(ids), movable=True) for k in samples]
        rids = [r.rid for r in requests]
        version, start = e.version, time.time()
        futures = e.queued(requests, [ids] * len(requests), priority)
        pending = {futures[rid]: rid for rid in rids}
        ended, handed = {}, {}
        while pending:  # whichever ends first, so a moved sample goes on elsewhere at once
            done, _ = wait(list(pending), timeout=e.config.request_timeout, return_when=FIRST_COMPLETED)
            if not done:
                rid = next(iter(pending.values()))
                await_response(rid, futures[rid], 0)  # raises, naming it and the timeout
            for f in done:
                rid = pending.pop(f)
                out = await_response(rid, f, 0)
                if out.moved:
                    partial = e.sample_of(prompt, ids, rid, out, version, start, time.time())
                    partial.token_versions = partial.token_versions or [partial.policy_version] * len(out.tokens)
                    partial.times["moved"] = partial.times["gen_end"]
                    handed[rid] = on_moved(partial)
                else:
                    ended[rid] = (out, time.time())
        group = []
        for rid in rids:
            if rid in handed:
                group.append(handed[rid].result())
                continue
            out, end = ended[rid]
            group.append(e.sample_of(prompt, ids, rid, out, version, start, end))
        return group

    def requests_now(self) -> RequestsNow:
        """The task samples in slots now (with the tokens they have) and those that ended since
        the last call. Safe from any thread: it copies the loop's table before reading it."""
        decoder = self.engine.decoder
        live = [(slot, r) for slot, r in dict(self.engine.table.running).items() if r.task]
        counts = decoder.generated[torch.tensor([s for s, _ in live], dtype=torch.long)
                                   .to(decoder.device)].tolist() if live else []
        running = [(r.rid, r.brought + int(n), r.prompt_tokens, r.movable) for (_, r), n in zip(live, counts)]
        finished = []
        while True:  # (one popleft at a time: a second caller draining it meanwhile ends the loop, no IndexError)
            try:
                finished.append(self._finished.popleft())
            except IndexError:
                break
        return RequestsNow(running, finished)

    def move_out(self, uid: str) -> bool:
        """Take running sample ``uid`` out at the loop's next turn. False when it is not a
        movable sample running here; it may still end by itself before the turn, and then it
        stays."""
        request = next((r for r in dict(self.engine.table.running).values() if r.rid == uid), None)
        if request is None or not request.movable:
            return False
        request.moving = True
        self.engine.cancel(uid)
        return True

    def continue_sample(self, partial: Sample, priority: float = 0.0) -> Sample:
        """Finish a sample another instance took out: its prompt and response so far are
        prefilled into a slot and decoded on, up to ``max_new_tokens`` in all. Its new tokens
        carry the versions this engine decoded them with; it is not moved again."""
        e = self.engine
        rid, done = partial.uid, len(partial.response_ids)
        ids = list(partial.prompt_ids) + list(partial.response_ids)
        versions = list(partial.token_versions or [partial.policy_version] * done)
        limit = e.config.max_new_tokens - done
        if limit < 1 or len(partial.prompt_ids) > e.config.max_prompt_tokens:
            raise ValueError(f"hf engine: moved sample {rid} has {len(partial.prompt_ids)} prompt and {done} "
                             f"response tokens; a slot holds {e.config.max_prompt_tokens} + "
                             f"{e.config.max_new_tokens} (engine.max_prompt_tokens, engine.max_new_tokens)")
        # streamed: the loop records the version of each token it decodes
        request = Request(rid, limit, streamed=True, task=True, prompt_tokens=len(partial.prompt_ids), brought=done)
        version = e.version
        out = await_response(rid, e.queued([request], [ids], priority)[rid], e.config.request_timeout)
        versions += out.token_versions or [version] * len(out.tokens)
        sample = e.make_sample(partial.prompt, partial.prompt_ids, rid, list(partial.response_ids) + out.tokens,
                           list(partial.logprobs) + list(out.logprobs), min(versions),
                           partial.times.get("gen_start", time.time()), time.time())
        sample.token_versions = versions
        sample.times["moved"] = partial.times.get("moved", sample.times["gen_end"])
        return sample
