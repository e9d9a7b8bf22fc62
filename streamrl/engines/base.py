"""What the ``hf`` engine's variants share: a transformers model and tokenizer loaded with
``from_pretrained``, weight loads, prompt encoding, greedy decoding for held-out evaluation, the
decode latency profile, and -- for the two batching variants -- the priority queue of requests
(``engines/request_queue.py``). ``engines/hf.py`` picks the variant a recipe asks for.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext

import torch

from streamrl.api import Engine, fit_decode_latency
from streamrl.chat.decoding import plain_text
from streamrl.contracts.adapters import is_adapter
from streamrl.engines.adapters import POLICY, AdapterBank
from streamrl.errors import WeightShapeMismatch
from streamrl.engines.hf_config import HFEngineConfig
from streamrl.engines.decode import decode_batch
from streamrl.engines.request_queue import RequestQueue, Response, await_response
from streamrl.engines.stop_tokens import stop_ids
from streamrl.models.tokenizers import encode_text, load_tokenizer
from streamrl.sample import Group, Prompt, Sample


class TransformersEngine(Engine):
    """Generation with per-token logprobs from a transformers model (built on the worker).

    The variants subclass it and fill in the hooks: :meth:`_start` (their loop),
    :meth:`_submitted` (requests were queued), :meth:`_profile_batch`, :meth:`_weights_paused`
    and :meth:`_stop`.
    """

    def __init__(self, config: HFEngineConfig):
        self.config = config
        self.version = 0
        self.model = None
        """The transformers model, set by :meth:`load`."""
        self.tokenizer = None
        """Its tokenizer, set by :meth:`load`."""
        self.stop_ids: tuple[int, ...] = ()
        """The tokens that end a response: the tokenizer's EOS and the model's generation config's
        (``engines/stop_tokens.py``), set by :meth:`load`."""
        self.adapters: AdapterBank | None = None
        """The LoRA adapters it holds over the base weights (``engine.adapters`` of them; None
        with 0), set by :meth:`load`: a LoRA learner's publication loads into :data:`POLICY`."""
        self.latency_points: list[tuple[float, float]] = []
        """The decode latency profile: ``[(context tokens, seconds per decode step)]``."""
        self._queue = RequestQueue()  # requests waiting for (or in) the batching loop
        self._closed = threading.Event()
        # held while a batch or group decodes and while weights are copied in, so a batch or
        # group never sees two policies (static batching, seeded)
        self._model_lock = threading.Lock()

    def load(self, model_path: str | None, device: str | None = None) -> None:
        """Load model + tokenizer with ``from_pretrained`` onto ``device`` (default: the pool's,
        ``streamrl.devices.worker_device``) and start the generation loop."""
        from streamrl.models import pretrained

        from streamrl.devices import worker_device

        device = device or worker_device()
        dtype = self.config.dtype if self.config.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
        self.tokenizer = load_tokenizer(model_path)
        self.model = pretrained.causal_lm(model_path, getattr(torch, dtype))
        self.model.to(device).eval()
        self.stop_ids = stop_ids(self.tokenizer, getattr(self.model, "generation_config", None))
        if self.config.kernels == "liger":  # (before the loop's decoder takes the modules' functions)
            from streamrl.training.kernels import use_liger_kernels

            use_liger_kernels(self.model, device, field="engine.kernels", workers="generate workers")
        if self.config.adapters:
            self.adapters = AdapterBank(self.model, self.config.adapters)
        self._start(device)

    def _start(self, device: str) -> None:
        """Start the variant's generation loop (and profile it) once the model is loaded.
        Default: nothing runs between requests."""

    def _profile(self, batches=(8, 1, 8, 32, 96), prompt: int = 8, steps: int = 24) -> list[tuple[float, float]]:
        """``[(context tokens, seconds per decode step)]`` measured through the real loop.

        Each point runs ``b`` requests that cannot stop early (no EOS) for ``steps`` tokens
        (:meth:`_profile_batch`); the context is the batch's mean total. Runs before the loop
        takes requests, so it drives the engine itself. The first batch size is a warm-up and
        is not kept.
        """
        # (a token that ends nothing, inside the vocabulary: GPT-2's EOS is its last id)
        vocab = self.model.get_input_embeddings().num_embeddings
        filler = next(t for t in range(vocab) if t not in self.stop_ids)
        ids = self.encode("")[:1] + [filler] * (prompt - 1)
        points = []
        for i, b in enumerate(batches):
            t0 = time.perf_counter()
            self._profile_batch(ids, b, steps, f"profile-{i}")
            if i > 0:
                points.append((b * (prompt + steps / 2), (time.perf_counter() - t0) / steps))
        return points

    def _profile_batch(self, ids: list[int], batch: int, steps: int, tag: str) -> None:
        """Decode ``batch`` copies of ``ids`` for ``steps`` tokens each, ignoring EOS (request
        ids, if the loop needs any, start with ``tag``)."""
        raise NotImplementedError

    def decode_latency(self):
        """The profile's least-squares affine fit (:func:`fit_decode_latency`); None without a
        profile."""
        return fit_decode_latency(self.latency_points)

    def requests_in_flight(self) -> tuple[int, int]:
        """``(running, queued)``, read together: requests decoding now (at most ``max_running``
        when it is set) and requests waiting in the engine's priority queue. Read-only, for
        monitoring and tests; reproducible mode decodes in the calling task and reports ``(0, 0)``."""
        return self._queue.counts()

    def is_closed(self) -> bool:
        """Whether :meth:`close` has begun (the generation loop is stopping or has stopped)."""
        return self._closed.is_set()

    def encode(self, text: str) -> list[int]:
        """Prompt token ids of plain text as the engine feeds them: as the model's tokenizer
        encodes it, a BOS in front where it adds one (``models/tokenizers.py``)."""
        return encode_text(self.tokenizer, text)

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """What the engine feeds for ``prompt``: its ``token_ids`` when the task tokenized it (a
        chat template applied, its special tokens in place), else :meth:`encode` of its text.
        ``ValueError`` naming it when that is no token at all (an empty text on a tokenizer
        without a BOS token): there is no last token to sample the first one from, and the
        trainer's batch of it would have no position to score its response from."""
        ids = list(prompt.token_ids) if prompt.token_ids is not None else self.encode(prompt.text)
        if not ids:
            raise ValueError(f"hf engine: prompt {prompt.uid} has no tokens; a prompt needs at least one")
        return ids

    def generate_greedy(self, prompts: list[Prompt]) -> list[Group]:
        """One greedy (argmax) response per prompt, for held-out evaluation: the prompts decoded
        as one padded batch while the generation loop waits (as for a weight load)."""
        ids = [self.prompt_ids(p) for p in prompts]
        # paused like a weight load: transformers' forward writes the model's config while it
        # runs, so two forwards at once (this and continuous batching's loop) corrupt each other
        with self._model_lock, self._weights_paused():
            start, version = time.time(), self.version
            out = decode_batch(self.model, ids, self.config.max_new_tokens, 1.0, self.stop_ids,
                               pad_id=self.tokenizer.pad_token_id or 0, greedy=True)
        end = time.time()
        return [[self.make_sample(p, i, f"{p.uid}-0", tokens, logprobs, version, start, end)]
                for p, i, (tokens, logprobs) in zip(prompts, ids, out)]

    def generate(self, prompt: Prompt, n: int, priority: float = 0.0) -> Group:
        """Sample ``n`` responses to ``prompt`` (blocks the calling task until all are done).

        ``priority`` orders the engine's queue (higher first); it matters once ``max_running``
        requests are running, or when many requests arrive together."""
        return self.generate_groups([prompt], n, [priority])[0]

    def generate_groups(self, prompts: list[Prompt], n: int, priorities: list[float]) -> list[Group]:
        """One group of ``n`` samples per prompt; every request is queued before the loop is
        woken, so a static batch takes them all at once."""
        version, start = self.version, time.time()
        asked = [(p, self.prompt_ids(p), [f"{p.uid}-{k}" for k in range(n)], priority)
                 for p, priority in zip(prompts, priorities)]
        futures = self._queue.put([(rid, ids, priority) for _, ids, rids, priority in asked for rid in rids])
        self._submitted()
        return [self._collect(p, ids, [(rid, futures[rid]) for rid in rids], version, start)
                for p, ids, rids, _ in asked]

    def _submitted(self) -> None:
        """Requests were just queued. Default: nothing to do (a loop waiting on the queue wakes
        by itself)."""

    def _collect(self, prompt: Prompt, ids: list[int], futures: list[tuple[str, Future]], version: int,
                 start: float) -> Group:
        return [self.sample_of(prompt, ids, rid, await_response(rid, fut, self.config.request_timeout), version,
                               start, time.time()) for rid, fut in futures]

    def sample_of(self, prompt: Prompt, ids: list[int], rid: str, out: Response, version: int, start: float,
                  end: float) -> Sample:
        """:meth:`make_sample` of a finished request: under the version that began it where the
        loop knows it (else ``version``, the one it was asked under), each token's version where a
        weight load came mid-response (the slot loop), and whether the watch ended it early."""
        sample = self.make_sample(prompt, ids, rid, out.tokens, out.logprobs,
                                  version if out.version is None else out.version, start, end)
        if out.token_versions:
            sample.token_versions = list(out.token_versions)
        if out.stopped_early:
            sample.times["stopped_early"] = 1.0
        return sample

    def response_text(self, tokens: list[int]) -> str:
        """``tokens`` as text, special tokens left out (:func:`plain_text`)."""
        return plain_text(self.tokenizer, tokens)

    def make_sample(self, prompt: Prompt, ids: list[int], rid: str, tokens: list[int], logprobs: list[float],
                version: int, start: float, end: float) -> Sample:
        """One response as a :class:`Sample` (its text decoded, generated between ``start`` and
        ``end`` under policy ``version``)."""
        return Sample(uid=rid, prompt=prompt, prompt_ids=list(ids), response_ids=list(tokens),
                      logprobs=[float(x) for x in logprobs],
                      response_text=self.response_text(tokens),
                      policy_version=version, times={"gen_start": start, "gen_end": end})

    @torch.no_grad()
    def load_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """Copy new parameters in place while the generation loop is paused (between decode
        steps, batches or groups, :meth:`_weights_paused`). A LoRA learner's adapter
        (``contracts/adapters.py``) loads as the served policy's adapter instead, the base weights
        untouched (:meth:`load_adapter`)."""
        if is_adapter(named_tensors):
            self.load_adapter(POLICY, named_tensors, version)
            return
        params = dict(self.model.named_parameters())
        missing = set(params) - set(named_tensors)
        if missing:
            raise ValueError(f"weights for version {version} lack {sorted(missing)[:3]}...")
        # checked before anything is copied, so the engine keeps its last whole version; torch's
        # own message would name neither the parameter nor where the weights came from
        wrong = [(name, tuple(p.shape), tuple(named_tensors[name].shape)) for name, p in params.items()
                 if named_tensors[name].shape != p.shape]
        if wrong:
            name, expected, received = wrong[0]
            more = f" ({len(wrong) - 1} more parameters differ)" if len(wrong) > 1 else ""
            raise WeightShapeMismatch(f"weights for version {version}: parameter {name!r} is {expected} in the "
                                      f"engine but {received} was received{more}")
        with self._model_lock, self._weights_paused():  # (greedy evaluation decodes under the lock too)
            for name, p in params.items():
                p.copy_(named_tensors[name].to(p.dtype))
            self.version = version

    @torch.no_grad()
    def load_adapter(self, name: str, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """Load adapter publication ``named_tensors`` as adapter ``name`` (:data:`POLICY`: the
        policy this engine samples for training; a learner's name: its served variant), between
        two decode steps like a weight load. The engine's version follows the policy's adapter."""
        if self.adapters is None:
            raise ValueError(f"adapter {name!r} for version {version}: this engine holds no adapters "
                             "(engine.adapters = 0)")
        with self._model_lock, self._weights_paused():
            self.adapters.load(name, named_tensors, version, self._adapters_in_use())
            if name == POLICY:  # (the bank keeps the newer of two loads)
                self.version = self.adapters.versions[POLICY]

    def _adapters_in_use(self) -> frozenset[int]:
        """The adapter indices running requests decode with (read while the loop waits). Default:
        none (the loops that hold no request across a load)."""
        return frozenset()

    def unload_adapter(self, name: str) -> None:
        """Forget adapter ``name`` between two decode steps, as a load is made (the loop reads
        the bank's indices and stacks while it runs)."""
        if self.adapters is None:
            return
        with self._model_lock, self._weights_paused():
            self.adapters.unload(name)

    def _weights_paused(self) -> AbstractContextManager:
        """Held, inside the model lock, while weights are copied in. Default: nothing more (the
        static and seeded variants decode under the model lock)."""
        return nullcontext()

    def close(self) -> None:
        """Stop the generation loop; fail requests still waiting.

        A task blocked on a request that will never finish would hang its worker thread (and
        the run) forever; failing it lets Dask retry the group on the engine that replaces this one.
        """
        self._closed.set()
        self._stop()
        self._queue.fail_all()

    def _stop(self) -> None:
        """Stop the variant's generation loop (:attr:`is_closed` is already set). Default:
        nothing runs."""
