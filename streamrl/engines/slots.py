"""Slot batching: streamrl's own decode loop, one captured CUDA graph per decode step
(``batching = "slots"``).

:class:`SlotEngine` runs one loop thread over a :class:`~streamrl.engines.slot_decoder.SlotDecoder`
of ``engine.slots`` request slots. Each turn of the loop:

1. takes waiting requests from the engine's priority queue into free slots (highest priority
   first, at most ``max_running`` running) and prefills them;
2. hands back every request that ended (EOS, its token limit) and frees its slot;
3. runs one decode step for the slots in use (a graph replay on a GPU).

A long response holds one slot, never a batch: the next request takes a freed slot at the next
step. Weights load between two turns (the loop waits while :meth:`_weights_paused` is held), so
no request is dropped and the next step decodes with the new weights.
"""

from __future__ import annotations

import heapq
import threading
import time
from contextlib import contextmanager

import torch

from streamrl.engines.base import HFEngineConfig, TransformersEngine
from streamrl.engines.request_queue import Response, await_response
from streamrl.engines.slot_decoder import SlotDecoder
from streamrl.sample import Group, Prompt

#: The request ids of greedy (evaluation) requests start with it: their slots take the argmax.
GREEDY = "greedy:"


class SlotEngine(TransformersEngine):
    """The ``hf`` engine on streamrl's slot decoder."""

    @classmethod
    def kv_capacity_tokens(cls, config: HFEngineConfig) -> int:
        """``slots`` slots of ``max_prompt_tokens + max_new_tokens`` positions each."""
        return config.slots * (config.max_prompt_tokens + config.max_new_tokens)

    def __init__(self, config: HFEngineConfig):
        super().__init__(config)
        self.decoder: SlotDecoder | None = None
        """The slot decoder, built by :meth:`load`."""
        self._loop: threading.Thread | None = None
        self._turn = threading.Lock()  # held by the loop for one turn; a weight load takes it between turns
        self._pause = threading.Event()  # a weight load wants the next turn
        self._incoming: list[tuple[str, list[int]]] = []  # admitted by the queue, not prefilled yet
        self._slot_of: dict[int, str] = {}  # slot -> request id
        self._free = list(range(config.slots))  # a heap: the lowest free slot first
        self._wake = threading.Event()
        self.loop_error: BaseException | None = None
        """What killed the loop, if something did (every request then fails naming it)."""

    def _start(self, device: str) -> None:
        c = self.config
        self.decoder = SlotDecoder(self.model, c.slots, c.max_prompt_tokens + c.max_new_tokens, c.max_new_tokens,
                                   c.temperature, self.tokenizer.eos_token_id,
                                   graphs=c.cuda_graph and device == "cuda")
        self.latency_points = self._profile() if c.profile else []
        self._loop = threading.Thread(target=self._run, args=(torch.get_num_threads(),),
                                      name="streamrl-hf-slots", daemon=True)
        self._loop.start()

    # -- the loop -----------------------------------------------------------------------------------

    def _run(self, torch_threads: int) -> None:
        torch.set_num_threads(torch_threads)  # per thread (OpenMP): the loop takes the worker's
        try:
            while not self._closed.is_set():
                if self._pause.is_set():
                    time.sleep(0.0005)
                    continue
                with self._turn:
                    busy = self._one_turn()
                if not busy:
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 -- every waiting request learns why, then the loop ends
            self.loop_error = e
            self._queue.fail_all(f"its generation loop died: {type(e).__name__}: {e}")

    def _one_turn(self) -> bool:
        """Admit and prefill, hand back what ended, decode one step; False when nothing runs."""
        if self._admit_into_free_slots():
            self._hand_back()  # a first token can end a request (EOS, max_new_tokens = 1)
        if not self._slot_of:
            return False
        self.decoder.step(self._size())
        self._hand_back()
        return True

    def _size(self) -> int:
        return self.decoder.size_for(max(self._slot_of))

    def _admit_into_free_slots(self) -> bool:
        if not self._free:
            return False
        self._incoming.clear()
        # the queue admits while fewer than the limit run; every running request holds a slot
        self._queue.admit(self._take, min(self.config.max_running or self.config.slots, self.config.slots))
        if not self._incoming:
            return False
        starts = []
        for rid, ids in self._incoming:
            slot = heapq.heappop(self._free)  # the lowest free slot: steps stay small when few run
            self._slot_of[slot] = rid
            # a slot holds max_prompt_tokens + max_new_tokens positions (generate_groups checked the prompt)
            starts.append((slot, ids, min(self.config.max_new_tokens, self.decoder.context - len(ids)),
                           rid.startswith(GREEDY)))
        self.decoder.prefill(starts)
        return True

    def _take(self, rid: str, ids: list[int]) -> bool:
        # called by the queue, under its lock, for each request it admits (highest priority first)
        self._incoming.append((rid, ids))
        return True

    def generate_greedy(self, prompts: list[Prompt]) -> list[Group]:
        """One greedy response per prompt (held-out evaluation), decoded in slots beside the
        sampled requests, ahead of them in the queue: generation does not pause for it."""
        ids = [self.prompt_ids(p) for p in prompts]
        self._check_prompts(prompts, ids)
        start, version = time.time(), self.version
        rids = [f"{GREEDY}{p.uid}-0" for p in prompts]
        futures = self._queue.put([(rid, i, float("inf")) for rid, i in zip(rids, ids)])
        self._submitted()
        return [[self._sample(p, i, rid.removeprefix(GREEDY), out.tokens, out.logprobs, version, start, time.time())]
                for p, i, rid in zip(prompts, ids, rids)
                for out in [await_response(rid, futures[rid], self.config.request_timeout)]]

    def _hand_back(self) -> None:
        done = [int(s) for s in self.decoder.finished_slots(self._size())]
        if not done:
            return
        for slot, (tokens, logprobs) in zip(done, self.decoder.release(done)):
            self._queue.finish(self._slot_of.pop(slot), Response(tokens, logprobs))
            heapq.heappush(self._free, slot)

    def _submitted(self) -> None:
        self._wake.set()

    def generate_groups(self, prompts: list[Prompt], n: int, priorities: list[float]) -> list[Group]:
        """As :meth:`TransformersEngine.generate_groups`; a prompt longer than
        ``engine.max_prompt_tokens`` fails its requests at once, naming the field."""
        self._check_prompts(prompts, [self.prompt_ids(p) for p in prompts])
        return super().generate_groups(prompts, n, priorities)

    def _check_prompts(self, prompts: list[Prompt], ids: list[list[int]]) -> None:
        for p, i in zip(prompts, ids):
            if len(i) > self.config.max_prompt_tokens:
                raise ValueError(f"hf engine: prompt {p.uid} has {len(i)} tokens, more than engine.max_prompt_tokens "
                                 f"= {self.config.max_prompt_tokens} (a slot holds max_prompt_tokens + max_new_tokens)")

    def _profile_batch(self, ids: list[int], batch: int, steps: int, tag: str) -> None:
        # before the loop starts: drive the decoder directly, every request decoding ``steps``
        # tokens whatever it draws (no EOS: the limit ends them)
        batch = min(batch, self.config.slots)
        eos = int(self.decoder.eos_id)
        self.decoder.eos_id.fill_(-1)
        try:
            self.decoder.prefill([(s, ids, min(steps, self.config.max_new_tokens), False) for s in range(batch)])
            b = self.decoder.size_for(batch - 1)
            for _ in range(steps - 1):
                self.decoder.step(b)
            self.decoder.finished_slots(b)  # waits for the device, so the time is the steps'
        finally:
            self.decoder.eos_id.fill_(eos)
            self.decoder.reset()

    @contextmanager
    def _weights_paused(self):
        # the loop finishes its turn and waits; running requests keep their slots and caches
        self._pause.set()
        try:
            with self._turn:
                yield
        finally:
            self._pause.clear()

    def _stop(self) -> None:
        self._wake.set()
        if self._loop is not None:  # None: closed before it loaded
            self._loop.join(timeout=5)
