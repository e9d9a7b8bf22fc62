"""Static batching: a set of requests decoded together, as one padded batch, until all finish.

The ``hf`` engine's default is transformers' continuous batching, which admits requests at
every decode step -- what a long tail of outputs needs. When outputs are short and arrive
together (W1: 512 responses of ~4 tokens per step), its per-step bookkeeping (paged cache,
attention masks rebuilt per step) costs more than the model: one padded batch with a plain KV
cache decodes the same responses faster on one CPU thread (docs/benchmarks.md). The price: a request that arrives while a batch runs waits for the next
one, and rows that finished early ride along until the longest row ends.

Prompts are left-padded so every row's next token is in the last column; position ids count
only real tokens, so a padded row sees the positions (and hence the logits) it would see alone.

:class:`StaticEngine` (``batching = "static"``) runs one loop thread: it takes the waiting
requests from the engine's priority queue (at most ``max_running``), decodes them with
:func:`decode_batch`, hands out the results, and starts over. Weight loads wait for the batch.
"""

from __future__ import annotations

import threading

import torch

from streamrl.engines.base import HFEngineConfig, TransformersEngine
from streamrl.engines.decode import decode_batch
from streamrl.engines.request_queue import Response


class StaticEngine(TransformersEngine):
    """The ``hf`` engine decoding whatever is queued as one padded batch at a time."""

    def __init__(self, config: HFEngineConfig):
        super().__init__(config)
        self._loop: threading.Thread | None = None

    def _start(self, device: str) -> None:
        self.latency_points = self._profile() if self.config.profile else []
        # torch's thread count is per thread (OpenMP): the loop takes the one set here
        self._loop = threading.Thread(target=self._batches, args=(torch.get_num_threads(),),
                                      name="streamrl-hf-static", daemon=True)
        self._loop.start()

    def _profile_batch(self, ids: list[int], batch: int, steps: int, tag: str) -> None:
        decode_batch(self.model, [ids] * batch, steps, self.config.temperature, self.stop_ids,
                     stop_at_eos=False)

    def _batches(self, torch_threads: int) -> None:
        # Take the waiting requests (highest priority first, at most max_running), decode them as
        # one batch, hand out the results; weight loads wait for the batch (the model lock).
        torch.set_num_threads(torch_threads)
        while not self._closed.is_set():
            batch = self._queue.next_batch(self.config.max_running, self._closed)
            if not batch:
                continue
            try:
                with self._model_lock:  # the version that really generated the batch
                    version = self.version
                    out = decode_batch(self.model, [ids for _, ids in batch], self.config.max_new_tokens,
                                       self.config.temperature, self.stop_ids,
                                       self.tokenizer.pad_token_id or 0)
                responses = [Response(tokens, logprobs, version=version) for tokens, logprobs in out]
            except Exception as e:  # every request of the batch fails; the loop goes on
                responses = [Response([], [], error=f"{type(e).__name__}: {e}")] * len(batch)
            for (rid, _), response in zip(batch, responses):
                self._queue.finish(rid, response)

    def _stop(self) -> None:
        self._queue.wake()
        if self._loop is not None:  # None: closed before it loaded
            self._loop.join(timeout=5)
