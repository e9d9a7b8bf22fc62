"""The ``hf`` engine: transformers' own continuous batching, on CPU or GPU.

One ``ContinuousBatchingManager`` per generate worker runs a background generation loop; every
generate task (one prompt group, on its own Dask worker thread) adds its requests and waits for
them, so concurrent tasks are batched together by the engine, not by us. A router thread moves
finished results from the manager's single output queue to the waiting tasks.

Scheduling: requests wait in the engine's own priority queue (highest ``priority`` first, then
arrival order) and enter transformers' batch while fewer than ``max_running`` are running; that is
how a scheduler's longest-first ordering and a long-tail instance's smaller batch reach this engine.

Weights are updated in place between requests: ``manager.pause()`` stops the loop at a step
boundary (no request is dropped, caches are kept), the parameters are overwritten, and the loop
resumes with the new policy.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as RequestTimeout
from types import SimpleNamespace
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from streamrl.api import Engine, EngineCapabilities, fit_decode_latency
from streamrl.engines.seeded import group_generator, sample_group
from streamrl.engines.static import decode_batch
from streamrl.sample import Group, Prompt, Sample


class HFEngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    max_new_tokens: int = Field(16, ge=1)
    """Most tokens generated per response."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature. The trainer divides its logits by the same value, so the engine's
    logprobs and the trainer's agree."""
    max_batch_tokens: int = Field(1024, ge=16)
    """Most tokens in one forward pass of the continuous-batching loop."""
    num_blocks: int = Field(256, ge=1)
    """KV-cache blocks (of ``page_size`` tokens each) reserved on the worker."""
    page_size: int = Field(32, ge=1)
    """Tokens per KV-cache block."""
    batching: Literal["continuous", "static"] = "continuous"
    """``continuous``: transformers' continuous batching, requests join the running batch at any
    decode step (long or uneven outputs). ``static``: the requests waiting when a batch starts
    are decoded together as one padded batch until all finish (``engines/static.py``); faster
    when outputs are short and arrive together, as in W1."""
    max_running: int = Field(0, ge=0)
    """Most requests in the running batch at once; the rest wait in the engine's queue, highest
    priority first. 0: no cap (every request goes straight into the batch)."""
    profile: bool = True
    """Measure the decode step latency at a few batch sizes when the engine starts (about a
    second on CPU); a scheduler (``skew``) uses it to decide how many instances the long tail
    gets. False: no profile, schedulers only balance predicted work."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Torch dtype the engine loads the model in. ``auto``: bfloat16 on a GPU, float32 on CPU
    (where float32 keeps engine and trainer logprobs within 1e-5)."""
    cuda_graph: bool = True
    """On a GPU, let continuous batching replay CUDA graphs of its decode steps (measured ~1.9x
    tokens/s on an H100 for a 0.5B model). Ignored on CPU."""
    kv_memory_fraction: float | None = Field(None, gt=0, lt=1)
    """Size the KV cache as this share of the device's free memory instead of ``num_blocks``
    (continuous batching; leave room for a train worker sharing the GPU)."""
    reproducible: bool = False
    """True: each group is decoded alone with a random generator seeded by ``seed`` and the
    prompt, so a seed gives the same samples every run (and a resumed run the same samples as an
    uninterrupted one); no continuous batching across groups, so slower under load."""
    seed: int | None = None
    """Seed of ``reproducible`` sampling (default: ``run.seed``)."""
    request_timeout: float = Field(600.0, gt=0)
    """Seconds a generate task waits for one response before it fails (naming the request)
    instead of hanging the step on a stuck generation loop."""


class HFEngine(Engine):
    """Continuous-batching generation with per-token logprobs (built on the worker)."""

    @classmethod
    def capabilities(cls, config: HFEngineConfig) -> EngineCapabilities:
        """``engine.temperature`` (the trainer divides its logits by it), ``max_running``, and
        the KV cache's tokens when ``num_blocks`` sizes it (continuous batching)."""
        fixed_kv = config.batching == "continuous" and not config.reproducible and not config.kv_memory_fraction
        return EngineCapabilities(temperature=config.temperature, max_running=config.max_running,
                                  kv_capacity_tokens=config.num_blocks * config.page_size if fixed_kv else 0,
                                  repeatable=config.reproducible)

    def __init__(self, config: HFEngineConfig):
        self.config = config
        self.version = 0
        self._waiting: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._queue: list[tuple[float, int, str, list[int]]] = []  # (-priority, order, id, prompt ids)
        self._order = itertools.count()
        self._running = 0
        self.manager = None
        self._model_lock = threading.Lock()  # reproducible mode: a group never sees two policies

    def load(self, model_path: str | None, device: str | None = None) -> None:
        """Load model + tokenizer with ``from_pretrained`` onto ``device`` (default: the pool's,
        ``streamrl.devices.worker_device``) and start the generation loop."""
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        from streamrl.devices import worker_device

        device = device or worker_device()
        dtype = self.config.dtype if self.config.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        self.model.to(device).eval()
        self.latency_points = []
        if self.config.reproducible:
            return  # groups are decoded one by one in the calling task (``engines/seeded.py``)
        if self.config.batching == "static":
            self.latency_points = self._profile() if self.config.profile else []
            self._wake = threading.Condition(self._lock)
            # torch's thread count is per thread (OpenMP): the loop takes the one set here
            self._loop = threading.Thread(target=self._static_loop, args=(torch.get_num_threads(),),
                                          name="streamrl-hf-static", daemon=True)
            self._loop.start()
            return
        gen = GenerationConfig(
            do_sample=True, temperature=self.config.temperature, top_k=0, top_p=1.0,
            max_new_tokens=self.config.max_new_tokens, eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        fraction = self.config.kv_memory_fraction
        cb = ContinuousBatchingConfig(
            return_logprobs=True, page_size=self.config.page_size, max_batch_tokens=self.config.max_batch_tokens,
            num_blocks=None if fraction else self.config.num_blocks, max_memory_percent=fraction,
            allow_block_sharing=False, use_cuda_graph=self.config.cuda_graph and device == "cuda",
        )
        self.manager = self.model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        self.manager.start()
        self.latency_points = self._profile() if self.config.profile else []
        self._router = threading.Thread(target=self._route, name="streamrl-hf-router", daemon=True)
        self._router.start()

    def _route(self) -> None:
        # The manager has one output queue; hand each finished request to the task waiting on it.
        while not self._closed.is_set():
            result = self.manager.get_result(timeout=0.1)
            if result is None or not result.is_finished():
                continue
            with self._lock:
                fut = self._waiting.pop(result.request_id, None)
                self._running -= 1
            self._admit()  # a slot is free: the next request in priority order may start
            if fut is not None:
                fut.set_result(result)

    def _static_loop(self, torch_threads: int) -> None:
        # Take the waiting requests (highest priority first, at most max_running), decode them as
        # one batch, hand out the results; weight loads wait for the batch (the model lock).
        torch.set_num_threads(torch_threads)
        while not self._closed.is_set():
            with self._wake:
                while not self._queue and not self._closed.is_set():
                    self._wake.wait(0.5)
                limit = self.config.max_running or len(self._queue)
                batch = [heapq.heappop(self._queue) for _ in range(min(limit, len(self._queue)))]
                self._running = len(batch)
            if not batch:
                continue
            try:
                with self._model_lock:  # the version that really generated the batch
                    version = self.version
                    out = decode_batch(self.model, [ids for *_, ids in batch], self.config.max_new_tokens,
                                       self.config.temperature, self.tokenizer.eos_token_id,
                                       self.tokenizer.pad_token_id or 0)
                results = [SimpleNamespace(generated_tokens=t, logprobs=lp, error=None, version=version)
                           for t, lp in out]
            except Exception as e:  # every request of the batch fails; the loop goes on
                results = [SimpleNamespace(error=f"{type(e).__name__}: {e}")] * len(batch)
            with self._lock:
                futures = [self._waiting.pop(rid, None) for _, _, rid, _ in batch]
                self._running = 0
            for fut, res in zip(futures, results):
                if fut is not None:
                    fut.set_result(res)

    def _admit(self) -> None:
        limit = self.config.max_running or float("inf")
        refused = []
        with self._lock:  # held while adding, so concurrent tasks cannot reorder the queue
            while self._queue and self._running < limit:
                _, _, rid, ids = heapq.heappop(self._queue)
                if self.manager.add_request(ids, request_id=rid, max_new_tokens=self.config.max_new_tokens) is None:
                    refused.append((rid, self._waiting.pop(rid)))  # the loop died or is stopping
                else:
                    self._running += 1
        for rid, fut in refused:  # fail the task (Dask retries it) rather than wait forever
            fut.set_exception(RuntimeError(f"hf engine refused request {rid}: its generation loop is not running"))

    def _profile(self, batches=(8, 1, 8, 32, 96), prompt: int = 8, steps: int = 24) -> list[tuple[float, float]]:
        """``[(context tokens, seconds per decode step)]`` measured through the real loop.

        Each point runs ``b`` requests that cannot stop early (no EOS) for ``steps`` tokens;
        the context is the batch's mean total. Runs before the router or static loop starts, so
        it drives the engine itself. The first batch size is a warm-up and is not kept.
        """
        ids = [self.tokenizer.bos_token_id] + [self.tokenizer.eos_token_id + 1] * (prompt - 1)
        points = []
        for i, b in enumerate(batches):
            t0 = time.perf_counter()
            if self.manager is None:  # static batching: one padded batch
                decode_batch(self.model, [ids] * b, steps, self.config.temperature, self.tokenizer.eos_token_id,
                             stop_at_eos=False)
            else:
                for k in range(b):
                    self.manager.add_request(ids, request_id=f"profile-{i}-{k}", max_new_tokens=steps, eos_token_id=-1)
                finished = 0
                while finished < b and time.perf_counter() - t0 < 60:
                    out = self.manager.get_result(timeout=0.1)
                    finished += out is not None and out.is_finished()
            if i > 0:
                points.append((b * (prompt + steps / 2), (time.perf_counter() - t0) / steps))
        return points

    def decode_latency(self):
        """The profile's least-squares affine fit (:func:`fit_decode_latency`); None without a
        profile."""
        return fit_decode_latency(self.latency_points)

    def requests_in_flight(self) -> tuple[int, int]:
        """``(running, queued)``, read together: requests decoding now (at most ``max_running``
        when it is set) and requests waiting in the engine's priority queue. Read-only, for
        monitoring and tests; reproducible mode decodes in the calling task and reports ``(0, 0)``."""
        with self._lock:
            return self._running, len(self._queue)

    def is_closed(self) -> bool:
        """Whether :meth:`close` has begun (the generation loop is stopping or has stopped)."""
        return self._closed.is_set()

    def encode(self, text: str) -> list[int]:
        """Prompt token ids as the engine feeds them: BOS, then the text."""
        return [self.tokenizer.bos_token_id] + self.tokenizer(text, add_special_tokens=False).input_ids

    def generate(self, prompt: Prompt, n: int, priority: float = 0.0) -> Group:
        """Sample ``n`` responses to ``prompt`` (blocks the calling task until all are done).

        ``priority`` orders the engine's queue (higher first); it matters once ``max_running``
        requests are running, or when many requests arrive together."""
        return self.generate_groups([prompt], n, [priority])[0]

    def generate_groups(self, prompts: list[Prompt], n: int, priorities: list[float]) -> list[Group]:
        """One group of ``n`` samples per prompt; every request is queued before the engine is
        woken, so a static batch takes them all at once."""
        if self.config.reproducible:
            return [self._generate_seeded(p, self.encode(p.text), n) for p in prompts]
        version, start = self.version, time.time()
        encoded = [self.encode(p.text) for p in prompts]  # before the lock the engine's loop shares
        asked = []
        with self._lock:
            for prompt, ids, priority in zip(prompts, encoded, priorities):
                futures = {}
                for k in range(n):
                    rid = f"{prompt.uid}-{k}"
                    futures[rid] = self._waiting[rid] = Future()
                    heapq.heappush(self._queue, (-priority, next(self._order), rid, ids))
                asked.append((prompt, ids, futures))
        if self.manager is None:  # static batching: the loop takes the queue
            with self._wake:
                self._wake.notify()
        else:
            self._admit()
        return [self._collect(prompt, ids, futures, version, start) for prompt, ids, futures in asked]

    def _collect(self, prompt: Prompt, ids: list[int], futures: dict[str, Future], version: int,
                 start: float) -> Group:
        group = []
        for rid, fut in futures.items():
            try:
                out = fut.result(timeout=self.config.request_timeout)
            except RequestTimeout:  # concurrent.futures' own class before Python 3.11
                raise RuntimeError(f"hf engine: request {rid} got no response within "
                                   f"{self.config.request_timeout:.0f} s (engine.request_timeout)") from None
            if out.error:
                raise RuntimeError(f"hf engine failed request {rid}: {out.error}")
            group.append(Sample(
                uid=rid, prompt=prompt, prompt_ids=list(ids), response_ids=list(out.generated_tokens),
                logprobs=[float(x) for x in out.logprobs],
                response_text=self.tokenizer.decode(out.generated_tokens, skip_special_tokens=True),
                policy_version=getattr(out, "version", version), times={"gen_start": start, "gen_end": time.time()},
            ))
        return group

    def _generate_seeded(self, prompt: Prompt, ids: list[int], n: int) -> Group:
        with self._model_lock:
            start, version = time.time(), self.version
            out = sample_group(self.model, ids, n, self.config.max_new_tokens, self.config.temperature,
                               self.tokenizer.eos_token_id, group_generator(self.config.seed or 0, prompt.uid))
            end = time.time()
        return [Sample(uid=f"{prompt.uid}-{k}", prompt=prompt, prompt_ids=list(ids), response_ids=tokens,
                       logprobs=logprobs, response_text=self.tokenizer.decode(tokens, skip_special_tokens=True),
                       policy_version=version, times={"gen_start": start, "gen_end": end})
                for k, (tokens, logprobs) in enumerate(out)]

    @torch.no_grad()
    def load_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """Copy new parameters in place at a step boundary of the generation loop."""
        params = dict(self.model.named_parameters())
        missing = set(params) - set(named_tensors)
        if missing:
            raise ValueError(f"weights for version {version} lack {sorted(missing)[:3]}...")
        if self.manager is None:  # reproducible or static batching: between groups / batches
            with self._model_lock:
                for name, p in params.items():
                    p.copy_(named_tensors[name].to(p.dtype))
                self.version = version
            return
        with self.manager.pause():
            for name, p in params.items():
                p.copy_(named_tensors[name].to(p.dtype))
            self.version = version

    def close(self) -> None:
        """Stop the generation loop and the router; fail requests still waiting.

        A task blocked on a request that will never finish would hang its worker thread (and
        the run) forever; failing it lets Dask retry the group on the engine that replaces this one.
        """
        self._closed.set()
        if self.manager is not None:
            self.manager.stop(block=True, timeout=5)
        elif getattr(self, "_loop", None) is not None:
            with self._wake:
                self._wake.notify()
            self._loop.join(timeout=5)
        with self._lock:
            waiting, self._waiting, self._queue = self._waiting, {}, []
        for rid, fut in waiting.items():
            fut.set_exception(RuntimeError(f"hf engine closed before request {rid} finished"))
