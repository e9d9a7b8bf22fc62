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
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from streamrl.engines.base import HFEngineConfig, TransformersEngine
from streamrl.engines.request_queue import Response, await_response
from streamrl.engines.slot_decoder import SlotDecoder
from streamrl.contracts.generation import RequestsNow
from streamrl.sample import Group, Prompt, Sample

#: The request ids of greedy (evaluation) requests start with it: their slots take the argmax.
GREEDY = "greedy:"

#: Ended task samples the engine remembers for :meth:`SlotEngine.requests_now` (a run without a
#: straggler mover never asks).
FINISHED_KEPT = 8192


@dataclass
class Stream:
    """A served request's state in the loop: its callback, what it was sent, its versions."""

    on_tokens: Callable[[list[int], list[float], int], None] | None
    limit: int
    greedy: bool
    sent: int = 0
    versions: list[int] = field(default_factory=list)


class SlotEngine(TransformersEngine):
    """The ``hf`` engine on streamrl's slot decoder."""

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
        self._streams: dict[str, Stream] = {}  # served requests, by id (written before they are queued)
        self._cancels: set[str] = set()  # served requests to stop, taken by the loop at its next turn
        self._cancel_lock = threading.Lock()
        self.loop_error: BaseException | None = None
        """What killed the loop, if something did (every request then fails naming it)."""
        self._stop_early = None  # the reward that may end a response early (stop_early_with)
        self._watched: dict[str, list] = {}  # request id -> [its prompt, tokens when last asked]
        self._ended_early: set[str] = set()  # released by the watch: their responses say so
        # task samples a straggler mover may see: rid -> (prompt tokens, tokens brought along, movable)
        self._task_info: dict[str, tuple[int, int, bool]] = {}
        self._finished_tasks: deque[tuple[str, int]] = deque(maxlen=FINISHED_KEPT)  # since requests_now
        self._moving: set[str] = set()  # taken out at the next turn, to go on elsewhere

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
        """Cancel, admit and prefill, hand back what ended, decode one step; False when nothing runs."""
        if self._cancels:
            self._cancel_requested()
        if self._admit_into_free_slots():
            self._emit()
            self._hand_back()  # a first token can end a request (EOS, max_new_tokens = 1)
        if not self._slot_of:
            return False
        self.decoder.step(self._size())
        self._emit()
        if self._watched:
            self._watch()
        if self._slot_of:  # (the watch may have ended every running request)
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
            served = self._streams.get(rid)
            limit = served.limit if served else self.config.max_new_tokens
            # a slot holds max_prompt_tokens + max_new_tokens positions (generate_groups checked the prompt)
            starts.append((slot, ids, min(limit, self.decoder.context - len(ids)),
                           rid.startswith(GREEDY) or bool(served and served.greedy)))
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
        if done:
            self._release(done)

    def _release(self, slots: list[int]) -> None:
        for slot, (tokens, logprobs) in zip(slots, self.decoder.release(slots)):
            rid = self._slot_of.pop(slot)
            served = self._streams.pop(rid, None)
            self._watched.pop(rid, None)
            early = rid in self._ended_early
            self._ended_early.discard(rid)
            moved = rid in self._moving
            self._moving.discard(rid)
            info = self._task_info.pop(rid, None)
            if info is not None and not moved:
                self._finished_tasks.append((rid, info[1] + len(tokens)))
            self._queue.finish(rid, Response(tokens, logprobs, token_versions=served.versions if served else None,
                                             stopped_early=early, moved=moved))
            heapq.heappush(self._free, slot)

    # -- responses ended early --------------------------------------------------------------------

    def stop_early_with(self, reward) -> None:
        """Ask ``reward.stop_early(prompt, text)`` every ``engine.stop_early_every`` tokens of a
        task's response; a response it stops is released at once, its tokens so far its sample."""
        self._stop_early = reward

    def _watch(self) -> None:
        # (the loop's thread, after a decode step) the watched requests that decoded another
        # stop_early_every tokens: their text so far, and the reward's verdict on it
        every = self.config.stop_early_every
        live = [(slot, rid) for slot, rid in self._slot_of.items() if rid in self._watched]
        if not live:
            return
        idx = torch.tensor([slot for slot, _ in live], device=self.decoder.device)
        counts = self.decoder.generated[idx].tolist()
        due = [(slot, rid, n) for (slot, rid), n in zip(live, counts) if n - self._watched[rid][1] >= every]
        if not due:
            return
        rows = self.decoder.out_tokens[torch.tensor([s for s, _, _ in due], device=self.decoder.device)].tolist()
        stop = []
        for (slot, rid, n), row in zip(due, rows):
            prompt = self._watched[rid][0]
            self._watched[rid][1] = n
            try:
                hopeless = bool(self._stop_early.stop_early(prompt, self.tokenizer.decode(row[:n], skip_special_tokens=True)))
            except Exception:  # noqa: BLE001 -- a watch that fails stops nothing; the reward scores it later
                hopeless = False
            if hopeless:
                stop.append(slot)
                self._ended_early.add(rid)
        if stop:
            self._release(stop)

    # -- served requests ------------------------------------------------------------------------

    def stream(self, rid: str, ids: list[int], max_new_tokens: int,
               on_tokens: Callable[[list[int], list[float], int], None] | None = None,
               greedy: bool = False, priority: float = 0.0, prompt: Prompt | None = None) -> Future:
        """Serve one request: queue it, call ``on_tokens(tokens, logprobs, version)`` from the
        loop's thread with each step's new tokens (the callback must be quick: the loop waits
        for it), and return the future of its :class:`Response`, whose ``token_versions`` say
        which policy decoded each token. ``greedy``: the argmax (``temperature = 0``).
        ``prompt``: what the reward's ``stop_early`` is asked about, when this engine stops
        hopeless responses early (:meth:`stop_early_with`): a served response is watched as a
        task's is, and one it stops ends there (``Response.stopped_early``)."""
        self._check_ids(f"request {rid}", ids)
        if prompt is not None and self._stop_early is not None:  # (before it is queued: the loop reads it)
            self._watched[rid] = [prompt, 0]
        self._streams[rid] = Stream(on_tokens, max(1, min(max_new_tokens, self.config.max_new_tokens)), greedy)
        future = self._queue.put([(rid, ids, priority)])[rid]
        self._submitted()
        return future

    def cancel(self, rid: str) -> None:
        """Stop served request ``rid`` at the loop's next turn (its future gets the tokens so
        far); nothing if it already ended."""
        with self._cancel_lock:
            self._cancels.add(rid)
        self._wake.set()

    def _cancel_requested(self) -> None:
        with self._cancel_lock:
            cancels, self._cancels = self._cancels, set()
        running = {rid: slot for slot, rid in self._slot_of.items()}
        stop = []
        for rid in cancels:
            if rid in running:
                stop.append(running[rid])
            elif rid in self._moving:  # it ended before it could be taken out: it stays here
                self._moving.discard(rid)
            elif self._queue.cancel(rid):
                self._streams.pop(rid, None)
                self._watched.pop(rid, None)
        if stop:
            self._emit()
            self._release(stop)

    def _emit(self) -> None:
        # each served request's tokens decoded since its last call, stamped with this version
        live = [(slot, rid, self._streams[rid]) for slot, rid in self._slot_of.items()
                if rid in self._streams]
        if not live:
            return
        idx = torch.tensor([slot for slot, _, _ in live], device=self.decoder.device)
        counts = self.decoder.generated[idx].tolist()
        tokens, logprobs = self.decoder.out_tokens[idx].tolist(), self.decoder.out_logprobs[idx].tolist()
        for (slot, rid, st), n, toks, lps in zip(live, counts, tokens, logprobs):
            if n <= st.sent:
                continue
            new_tokens, new_lps = toks[st.sent:n], lps[st.sent:n]
            st.versions.extend([self.version] * len(new_tokens))
            st.sent = n
            if st.on_tokens is not None:
                try:
                    st.on_tokens(new_tokens, new_lps, self.version)
                except Exception:  # noqa: BLE001 -- a consumer's failure is its own; the loop goes on
                    self.cancel(rid)

    def _submitted(self) -> None:
        self._wake.set()

    def generate_groups(self, prompts: list[Prompt], n: int, priorities: list[float]) -> list[Group]:
        """As :meth:`TransformersEngine.generate_groups`; a prompt longer than
        ``engine.max_prompt_tokens`` fails its requests at once, naming the field."""
        self._check_prompts(prompts, [self.prompt_ids(p) for p in prompts])
        if self._stop_early is not None:  # (written before the requests are queued: the loop reads it)
            for p in prompts:
                for k in range(n):
                    self._watched[f"{p.uid}-{k}"] = [p, 0]
        return super().generate_groups(prompts, n, priorities)

    # -- samples moved between instances ----------------------------------------------------------

    def generate_movable(self, prompt: Prompt, samples: list[int], priority: float, on_moved) -> Group:
        """The samples numbered ``samples`` of ``prompt``'s group; one taken out by
        :meth:`move_out` goes to ``on_moved`` the moment it is out (its tokens so far carry the
        version the group was asked under, as an unmoved sample's do), and comes back finished."""
        ids = self.prompt_ids(prompt)
        self._check_prompts([prompt], [ids])
        rids = [f"{prompt.uid}-{k}" for k in samples]
        for rid in rids:  # (written before the requests are queued: the loop reads them)
            self._task_info[rid] = (len(ids), 0, True)
            if self._stop_early is not None:
                self._watched[rid] = [prompt, 0]
        version, start = self.version, time.time()
        futures = self._queue.put([(rid, ids, priority) for rid in rids])
        self._submitted()
        pending = {futures[rid]: rid for rid in rids}
        ended, handed = {}, {}
        while pending:  # whichever ends first, so a moved sample goes on elsewhere at once
            done, _ = wait(list(pending), timeout=self.config.request_timeout, return_when=FIRST_COMPLETED)
            if not done:
                rid = next(iter(pending.values()))
                await_response(rid, futures[rid], 0)  # raises, naming it and the timeout
            for f in done:
                rid = pending.pop(f)
                out = await_response(rid, f, 0)
                if out.moved:
                    partial = self._sample(prompt, ids, rid, out.tokens, out.logprobs, version, start, time.time())
                    partial.token_versions = [version] * len(out.tokens)
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
            group.append(self._sample(prompt, ids, rid, out.tokens, out.logprobs, version, start, end))
            if out.stopped_early:
                group[-1].times["stopped_early"] = 1.0
        return group

    def requests_now(self) -> RequestsNow:
        """The task samples in slots now (with the tokens they have) and those that ended since
        the last call. Safe from any thread: it copies the loop's tables before reading them."""
        slots = dict(self._slot_of)
        info = dict(self._task_info)
        live = [(slot, rid) for slot, rid in slots.items() if rid in info]
        counts = self.decoder.generated[torch.tensor([s for s, _ in live], dtype=torch.long)
                                        .to(self.decoder.device)].tolist() if live else []
        running = [(rid, info[rid][1] + int(n), info[rid][0], info[rid][2]) for (_, rid), n in zip(live, counts)]
        finished = [self._finished_tasks.popleft() for _ in range(len(self._finished_tasks))]
        return RequestsNow(running, finished)

    def move_out(self, uid: str) -> bool:
        """Take running sample ``uid`` out at the loop's next turn, its tokens so far handed to
        the :meth:`generate_movable` call that asked for it. False when it is not a movable sample
        running here; it may still end by itself before the turn, and then it stays."""
        info = self._task_info.get(uid)
        if info is None or not info[2] or uid not in dict(self._slot_of).values():
            return False
        self._moving.add(uid)
        self.cancel(uid)
        return True

    def continue_sample(self, partial: Sample, priority: float = 0.0) -> Sample:
        """Finish a sample another instance took out: its prompt and response so far are
        prefilled into a slot and decoded on, up to ``max_new_tokens`` in all. Its new tokens
        carry the versions this engine decoded them with; it is not moved again."""
        rid, done = partial.uid, len(partial.response_ids)
        ids = list(partial.prompt_ids) + list(partial.response_ids)
        versions = list(partial.token_versions or [partial.policy_version] * done)
        limit = self.config.max_new_tokens - done
        if limit < 1 or len(partial.prompt_ids) > self.config.max_prompt_tokens:
            raise ValueError(f"hf engine: moved sample {rid} has {len(partial.prompt_ids)} prompt and {done} "
                             f"response tokens; a slot holds {self.config.max_prompt_tokens} + "
                             f"{self.config.max_new_tokens} (engine.max_prompt_tokens, engine.max_new_tokens)")
        self._task_info[rid] = (len(partial.prompt_ids), done, False)
        self._streams[rid] = Stream(None, limit, False)  # a stream: the loop records each token's version
        version = self.version
        future = self._queue.put([(rid, ids, priority)])[rid]
        self._submitted()
        out = await_response(rid, future, self.config.request_timeout)
        versions += out.token_versions or [version] * len(out.tokens)
        sample = self._sample(partial.prompt, partial.prompt_ids, rid, list(partial.response_ids) + out.tokens,
                              list(partial.logprobs) + list(out.logprobs), min(versions),
                              partial.times.get("gen_start", time.time()), time.time())
        sample.token_versions = versions
        sample.times["moved"] = partial.times.get("moved", sample.times["gen_end"])
        return sample

    def _check_prompts(self, prompts: list[Prompt], ids: list[list[int]]) -> None:
        for p, i in zip(prompts, ids):
            self._check_ids(f"prompt {p.uid}", i)

    def _check_ids(self, what: str, ids: list[int]) -> None:
        if len(ids) > self.config.max_prompt_tokens:
            raise ValueError(f"hf engine: {what} has {len(ids)} tokens, more than engine.max_prompt_tokens "
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
