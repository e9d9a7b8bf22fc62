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

A served request (:meth:`SlotEngine.stream`) also has its tokens handed to a callback as each
step decodes them, with the policy version that decoded them, and can be cancelled (a client
that went away, a stop sequence found) to free its slot at the next turn.

Each request's state is one :class:`~streamrl.engines.slot_requests.Request` (served or not,
watched by a reward's ``stop_early``, movable to another instance), and which slot holds which
request is the :class:`~streamrl.engines.slot_requests.SlotTable`'s: the loop reads both. What
only some requests need is a collaborator the loop calls, not a branch in it: followed requests'
tokens and cancels (``slot_streams.py``), the reward's early stop (``slot_watch.py``) and samples
moved between instances (``slot_moves.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import contextmanager

import torch

from streamrl.engines.adapters import POLICY
from streamrl.engines.base import HFEngineConfig, TransformersEngine
from streamrl.engines.request_queue import Response, await_response
from streamrl.engines.slot_decoder import SlotDecoder, Start
from streamrl.engines.slot_moves import SampleMoves
from streamrl.engines.slot_requests import Request, SlotTable, token_versions
from streamrl.engines.slot_streams import TokenStreams
from streamrl.engines.slot_watch import EarlyStopWatch
from streamrl.contracts.generation import RequestsNow
from streamrl.sample import Group, Prompt, Sample


class SlotEngine(TransformersEngine):
    """The ``hf`` engine on streamrl's slot decoder."""

    flushes_token_callbacks = True
    """A served request's ``on_tokens`` with a ``flush`` attribute has it called once after each
    step's callbacks (``TokenStreams.emit``): the endpoint wakes its event loop once a step, not
    once a choice."""

    def __init__(self, config: HFEngineConfig):
        super().__init__(config)
        self.decoder: SlotDecoder | None = None
        """The slot decoder, built by :meth:`load`."""
        self.positions: int | None = None
        """The model's positions (``max_position_embeddings``), set by :meth:`load`: a prompt
        longer than they leave beside ``max_new_tokens`` is refused (None: the model does not say)."""
        self._loop: threading.Thread | None = None
        self._turn = threading.Lock()  # held by the loop for one turn; a weight load takes it between turns
        self._pause = threading.Event()  # a weight load wants the next turn
        self._wake = threading.Event()
        self.table = SlotTable(config.slots)
        """Which slot holds which request (the loop's; read from other threads by copying it)."""
        # requests set up by the call that queues them (a served one, a watched or movable sample),
        # by id; written before they are queued, taken by the loop when it admits them
        self._requests: dict[str, Request] = {}
        self._incoming: list[tuple[Request, list[int]]] = []  # admitted by the queue, not prefilled yet
        self.loop_error: BaseException | None = None
        """What killed the loop, if something did (every request then fails naming it)."""
        self.streams = TokenStreams(self._version_of, self._wake)
        """Followed requests' tokens handed on as they are decoded, and the cancels asked for."""
        self.watch = EarlyStopWatch(config.stop_early_every, self.response_text)
        """The reward that may end responses early (:meth:`stop_early_with`)."""
        self.moves = SampleMoves(self)
        """Samples taken out to go on elsewhere, and those continued here."""
        self.loop_counts = {"steps": 0, "admissions": 0, "admitted": 0, "prefill_s": 0.0, "prefill_graphed": 0, "prefill_failed": 0,
                            "idle_s": 0.0, "emit_s": 0.0}
        """What the loop did so far: decode steps, admissions (each one prefill between two steps),
        the requests they took, the seconds its prefill calls took on the host (on a GPU, mostly
        launching the prefill's kernels), the prefills replayed from captured graphs, the requests
        whose prefill failed (each failed alone, naming why; the loop went on), the seconds it waited with nothing to decode and the
        seconds it spent handing followed requests their tokens (``emit_s``: the serving path's
        share of the loop); read by ``streamrl bench engine`` and the endpoint's stats (monotone
        counters)."""

    def _start(self, device: str) -> None:
        c = self.config
        positions = getattr(self.model.config, "max_position_embeddings", None)
        self.positions = positions if isinstance(positions, int) and positions > 0 else None
        self.decoder = SlotDecoder(self.model, c.slots, c.max_prompt_tokens + c.max_new_tokens, c.max_new_tokens,
                                   c.temperature, self.stop_ids,
                                   graphs=c.cuda_graph and device == "cuda", adapters=self.adapters,
                                   fused=c.fused_sampling, prefill_graphs=c.prefill_graphs)
        self.latency_points = self._profile() if c.profile else []
        self.decoder.prompts.replays = 0  # (the profile's prefills are not the loop's)
        self._loop = threading.Thread(target=self._run, args=(torch.get_num_threads(),),
                                      name="streamrl-hf-slots", daemon=True)
        self._loop.start()

    @property
    def loop_thread(self) -> threading.Thread | None:
        """The decode loop's thread (None before :meth:`load`): what the endpoint's host counts
        read the CPU time of."""
        return self._loop

    def queued(self, requests: list[Request], ids: list[list[int]], priority: float) -> dict[str, Future]:
        """Register ``requests`` (before the loop can see them) and queue them; their futures."""
        for r in requests:
            self._requests[r.rid] = r
        try:
            futures = self._queue.put([(r.rid, i, priority) for r, i in zip(requests, ids)])
        except BaseException:  # (refused, none queued: an entry left would be a later request's settings)
            for r in requests:
                self._requests.pop(r.rid, None)
            raise
        self._submitted()
        return futures

    def _submitted(self) -> None:
        self._wake.set()  # (the base class's generate_groups calls it too)

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
                    t = time.perf_counter()
                    self._wake.wait(0.05)
                    self._wake.clear()
                    self.loop_counts["idle_s"] += time.perf_counter() - t
        except BaseException as e:  # noqa: BLE001 -- every waiting request learns why, then the loop ends
            self.loop_error = e
            self._queue.fail_all(f"its generation loop died: {type(e).__name__}: {e}")

    def _one_turn(self) -> bool:
        """Cancel, admit and prefill, hand back what ended, decode one step; False when nothing
        runs and nothing was admitted."""
        if self.streams.pending():
            self._cancel_requested()
        # waiting requests are admitted on the turns that look for ended ones (or when nothing
        # runs): requests that arrive a few at a time share one prefill between two steps
        admitted = ((not self.table.running or self._steps % self.config.finished_every == 0)
                    and self._admit_into_free_slots())
        if admitted:
            self._emit()
            self._hand_back()  # a first token can end a request (EOS, max_new_tokens = 1)
        if not self.table.running:
            # (a turn whose every admitted request ended on its first token looks again at once:
            # more may wait, and the wake that told of them was taken)
            return admitted
        self.decoder.step(self._size())
        self.loop_counts["steps"] += 1
        self._emit()
        stop = self.watch.stops(self.table.running, self.decoder)
        if stop:
            self._release(stop)
        # (the watch may have ended every running request)
        if self.table.running and self._steps % self.config.finished_every == 0:
            self._hand_back()
        return True

    def _emit(self) -> None:
        # followed requests' new tokens to their callbacks, timed (the serving path's share of the loop)
        t = time.perf_counter()
        self.streams.emit(self.table.running, self.decoder)
        self.loop_counts["emit_s"] += time.perf_counter() - t

    @property
    def _steps(self) -> int:
        # decode steps so far (the loop's counter): ended requests are looked for every finished_every
        return self.loop_counts["steps"]

    def _size(self) -> int:
        return self.decoder.size_for(self.table.highest())

    def _admit_into_free_slots(self) -> bool:
        if not self.table.has_room():
            return False
        self._incoming.clear()
        # the queue admits while fewer than the limit run; every running request holds a slot
        self._queue.admit(self._take, min(self.config.max_running or self.config.slots, self.config.slots))
        if not self._incoming:
            return False
        starts = []
        busy = self._adapters_in_use() if self.adapters is not None else frozenset()  # (once: the loop's hot path)
        for request, ids in self._incoming:
            slot = self.table.place(request)
            if not request.streamed:
                request.marks = [(0, self._version_of(request.adapter))]
            # a slot holds max_prompt_tokens + max_new_tokens positions (the caller checked the prompt)
            adapter = 0 if self.adapters is None else self.adapters.slot(request.adapter, busy)
            request.adapter_index = adapter
            starts.append(Start(slot, ids, min(request.limit, self.decoder.context - len(ids)), request.greedy, adapter))
        t = time.perf_counter()
        try:
            self.decoder.prefill(starts)
        except Exception as e:  # noqa: BLE001 -- these requests fail; the loop and every other request go on
            self._prefill_failed([s.slot for s in starts], e)
            return False
        self.loop_counts["prefill_s"] += time.perf_counter() - t
        self.loop_counts["prefill_graphed"] = self.decoder.prompts.replays
        self.loop_counts["admissions"] += 1
        self.loop_counts["admitted"] += len(starts)
        return True

    def _prefill_failed(self, slots: list[int], e: Exception) -> None:
        # the requests just placed fail, naming why, and their slots are free again: an
        # out-of-memory on a burst of long prompts (or any one prefill's error) ended the loop
        # before, and with it every request then and after
        if isinstance(e, torch.OutOfMemoryError) and torch.cuda.is_available():
            torch.cuda.empty_cache()
        why = f"its prefill failed: {type(e).__name__}: {str(e)[:300]}"
        self.decoder.release(slots)  # (whatever the prefill wrote there is reset, not read)
        for slot in slots:
            r = self.table.free(slot)
            self.moves.ended(r, 0)
            self._queue.fail(r.rid, why)
        self.loop_counts["prefill_failed"] += len(slots)

    def _adapters_in_use(self) -> frozenset[int]:
        return frozenset(r.adapter_index for r in self.table.running.values())

    def _take(self, rid: str, ids: list[int]) -> bool:
        # called by the queue, under its lock, for each request it admits (highest priority first);
        # a plain task sample was queued by the base class without a request of its own
        request = self._requests.pop(rid, None) or Request(rid, self.config.max_new_tokens)
        self._incoming.append((request, ids))
        return True

    def generate_greedy(self, prompts: list[Prompt]) -> list[Group]:
        """One greedy response per prompt (held-out evaluation), decoded in slots beside the
        sampled requests, ahead of them in the queue: generation does not pause for it."""
        ids = [self.prompt_ids(p) for p in prompts]
        self.check_prompts(prompts, ids)
        start, version = time.time(), self.version
        requests = [Request(f"greedy:{p.uid}-0", self.config.max_new_tokens, greedy=True) for p in prompts]
        futures = self.queued(requests, ids, float("inf"))
        # (under the version that began each response, which a weight load between this call and
        # its admission changes: the loop knows it, this call does not)
        return [[self.sample_of(p, i, f"{p.uid}-0", out, version, start, time.time())]
                for p, i, r in zip(prompts, ids, requests)
                for out in [await_response(r.rid, futures[r.rid], self.config.request_timeout)]]

    def _hand_back(self) -> None:
        done = [int(s) for s in self.decoder.finished_slots(self._size())]
        if done:
            self._release(done)

    def _release(self, slots: list[int], taken_out: bool = False) -> None:
        # ``taken_out``: released by a cancel, so a request asked to move leaves as moved (one
        # that ended by itself first stays here, finished: with finished_every > 1 an ended one
        # keeps its slot for a few steps, and moved on it was decoded past its end elsewhere)
        ended = set(self.decoder.finished_slots(self._size()).tolist()) if taken_out else set()
        for slot, (tokens, logprobs) in zip(slots, self.decoder.release(slots)):
            r = self.table.free(slot)
            moved = taken_out and r.moving and slot not in ended
            if not moved:
                self.moves.ended(r, len(tokens))
            versions = r.versions if r.streamed else token_versions(r.marks, len(tokens))
            first = None if r.streamed or not r.marks else r.marks[0][1]  # (the version that began it)
            self._queue.finish(r.rid, Response(tokens, logprobs, version=first, token_versions=versions,
                                               stopped_early=r.ended_early, moved=moved))

    # -- responses ended early, served requests, moved samples: the collaborators -----------------

    def stop_early_with(self, reward) -> None:
        """Ask ``reward.stop_early(prompt, text)`` every ``engine.stop_early_every`` tokens of a
        task's response; a response it stops is released at once, its tokens so far its sample."""
        self.watch.reward = reward

    def stream(self, rid: str, ids: list[int], max_new_tokens: int,
               on_tokens: Callable[[list[int], list[float], int], None] | None = None,
               greedy: bool = False, priority: float = 0.0, prompt: Prompt | None = None,
               adapter: str = POLICY) -> Future:
        """Serve one request: queue it, call ``on_tokens(tokens, logprobs, version)`` from the
        loop's thread with each step's new tokens (the callback must be quick: the loop waits
        for it), and return the future of its :class:`Response`, whose ``token_versions`` say
        which policy decoded each token. ``greedy``: the argmax (``temperature = 0``).
        ``prompt``: what the reward's ``stop_early`` is asked about, when this engine stops
        hopeless responses early (:meth:`stop_early_with`): a served response is watched as a
        task's is, and one it stops ends there (``Response.stopped_early``). ``adapter``: the
        LoRA adapter it decodes with (a learner's variant), in the same steps as every other
        request; its tokens carry that adapter's version."""
        self._check_ids(f"request {rid}", ids)
        request = Request(rid, max(1, min(max_new_tokens, self.config.max_new_tokens)), greedy=greedy, streamed=True,
                          on_tokens=on_tokens, watch=self.watch.watching(prompt), adapter=adapter)
        return self.queued([request], [ids], priority)[rid]

    def cancel(self, rid: str) -> None:
        """Stop request ``rid`` at the loop's next turn (its future gets the tokens so far);
        nothing if it already ended."""
        self.streams.cancel(rid)

    def _cancel_requested(self) -> None:
        stop = []
        for rid in self.streams.take_cancels():
            slot = self.table.slot_of(rid)
            if slot is not None:
                stop.append(slot)
            elif self._queue.cancel(rid):  # still waiting: answered empty, its request forgotten
                self._requests.pop(rid, None)
        if stop:
            self._emit()
            self._release(stop, taken_out=True)

    def _version_of(self, adapter: str) -> int:
        # the served policy's version is the engine's; a learner's variant has its adapter's
        if adapter == POLICY or self.adapters is None:
            return self.version
        return self.adapters.versions.get(adapter, 0)

    def generate_groups(self, prompts: list[Prompt], n: int, priorities: list[float]) -> list[Group]:
        """As :meth:`TransformersEngine.generate_groups`; a prompt longer than
        ``engine.max_prompt_tokens`` fails its requests at once, naming the field."""
        self.check_prompts(prompts, [self.prompt_ids(p) for p in prompts])
        if self.watch.reward is not None:  # (registered before the base class queues them: the loop reads them)
            for p in prompts:
                for k in range(n):
                    rid = f"{p.uid}-{k}"
                    self._requests[rid] = Request(rid, self.config.max_new_tokens, watch=p)
        return super().generate_groups(prompts, n, priorities)

    def generate_movable(self, prompt: Prompt, samples: list[int], priority: float, on_moved) -> Group:
        """:meth:`SampleMoves.generate_movable <streamrl.engines.slot_moves.SampleMoves.generate_movable>`."""
        return self.moves.generate_movable(prompt, samples, priority, on_moved)

    def requests_now(self) -> RequestsNow:
        """:meth:`SampleMoves.requests_now <streamrl.engines.slot_moves.SampleMoves.requests_now>`."""
        return self.moves.requests_now()

    def move_out(self, uid: str) -> bool:
        """:meth:`SampleMoves.move_out <streamrl.engines.slot_moves.SampleMoves.move_out>`."""
        return self.moves.move_out(uid)

    def continue_sample(self, partial: Sample, priority: float = 0.0) -> Sample:
        """:meth:`SampleMoves.continue_sample <streamrl.engines.slot_moves.SampleMoves.continue_sample>`."""
        return self.moves.continue_sample(partial, priority)

    def check_prompts(self, prompts: list[Prompt], ids: list[list[int]]) -> None:
        """Refuse, naming the prompt and the field, a prompt whose ``ids`` do not fit a slot."""
        for p, i in zip(prompts, ids):
            self._check_ids(f"prompt {p.uid}", i)

    def _check_ids(self, what: str, ids: list[int]) -> None:
        if not ids:  # (an empty text on a tokenizer without BOS: nothing to prefill, no last token to sample from)
            raise ValueError(f"hf engine: {what} has no tokens; a prompt needs at least one")
        if len(ids) > self.config.max_prompt_tokens:
            raise ValueError(f"hf engine: {what} has {len(ids)} tokens, more than engine.max_prompt_tokens "
                             f"= {self.config.max_prompt_tokens} (a slot holds max_prompt_tokens + max_new_tokens)")
        room = self.positions - self.config.max_new_tokens if self.positions else None
        if room is not None and len(ids) > room:
            raise ValueError(f"hf engine: {what} has {len(ids)} tokens, more than the {max(room, 0)} the model's "
                             f"{self.positions} positions leave beside engine.max_new_tokens = "
                             f"{self.config.max_new_tokens}")

    def _profile_batch(self, ids: list[int], batch: int, steps: int, tag: str) -> None:
        # before the loop starts: drive the decoder directly, every request decoding ``steps``
        # tokens whatever it draws (no EOS: the limit ends them)
        batch = min(batch, self.config.slots)
        stops = self.decoder.stop_ids.clone()
        self.decoder.stop_ids.fill_(-1)
        try:
            self.decoder.prefill([(s, ids, min(steps, self.config.max_new_tokens), False) for s in range(batch)])
            b = self.decoder.size_for(batch - 1)
            for _ in range(steps - 1):
                self.decoder.step(b)
            self.decoder.finished_slots(b)  # waits for the device, so the time is the steps'
        finally:
            self.decoder.stop_ids.copy_(stops)
            self.decoder.reset()

    @contextmanager
    def _weights_paused(self):
        # the loop finishes its turn and waits; running requests keep their slots and caches
        self._pause.set()
        try:
            with self._turn:
                yield
                self._mark_versions()
        finally:
            self._pause.clear()

    def _mark_versions(self) -> None:
        # (the loop waits: a task's request holding a slot goes on under the weights just loaded,
        # from the tokens it has; a streamed one stamps each token as it is handed over)
        held = [(slot, r) for slot, r in self.table.running.items() if not r.streamed and r.marks]
        if not held:
            return
        counts = self.decoder.generated[torch.tensor([slot for slot, _ in held], device=self.decoder.device)].tolist()
        for (_, r), n in zip(held, counts):
            version = self._version_of(r.adapter)
            if version != r.marks[-1][1]:
                r.marks.append((int(n), version))

    def _stop(self) -> None:
        self._wake.set()
        if self._loop is not None:  # None: closed before it loaded
            self._loop.join(timeout=5)
