"""Continuous batching: transformers' ``ContinuousBatchingManager`` decodes, requests join the
running batch at any decode step (the ``hf`` engine's default, ``batching = "continuous"``).

One manager per generate worker runs a background generation loop; every generate task (one
prompt group, on its own Dask worker thread) queues its requests and waits for them, so
concurrent tasks are batched together by the manager, not by us. Requests enter the manager's
batch from the engine's priority queue while fewer than ``max_running`` run; a router thread
moves finished results from the manager's single output queue to the waiting tasks, and each
one that finishes frees a slot for the next request in priority order.

Weights are updated in place between decode steps: ``manager.pause()`` stops the loop at a step
boundary (no request is dropped, caches are kept), the parameters are overwritten, and the loop
resumes with the new policy.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import AbstractContextManager

from streamrl.engines.base import HFEngineConfig, TransformersEngine
from streamrl.engines.request_queue import Response


class ContinuousEngine(TransformersEngine):
    """The ``hf`` engine on transformers' continuous batching."""

    def __init__(self, config: HFEngineConfig):
        super().__init__(config)
        self.manager = None
        """transformers' ``ContinuousBatchingManager``, running from :meth:`load` on."""
        self._router: threading.Thread | None = None

    def _start(self, device: str) -> None:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        gen = GenerationConfig(
            do_sample=True, temperature=self.config.temperature, top_k=0, top_p=1.0,
            max_new_tokens=self.config.max_new_tokens, eos_token_id=list(self.stop_ids) or -1,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        fraction = self.config.kv_memory_fraction
        cb = ContinuousBatchingConfig(
            return_logprobs=True, page_size=self.config.page_size, max_batch_tokens=self.config.max_batch_tokens,
            num_blocks=None if fraction else self.config.num_blocks, max_memory_percent=fraction,
            allow_block_sharing=False,
            # transformers captures whole forwards, which would leave the LoRA adapters' hooks
            # (engines/adapters.py) out of every replay: with adapters, no graphs here
            use_cuda_graph=self.config.cuda_graph and device == "cuda" and not self.config.adapters,
        )
        # transformers logs a dying loop's traceback, then one warning per request it drops;
        # streamrl reports the loop's error itself (a failed load, failed requests), once
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
        self.manager = self.model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        self.manager.start()
        self._wait_started()
        self.latency_points = self._profile() if self.config.profile else []
        self._router = threading.Thread(target=self._route, name="streamrl-hf-router", daemon=True)
        self._router.start()

    def _loop_error(self) -> BaseException | None:
        """The exception that killed the manager's generation loop, if one did."""
        return self.manager.background_thread_status.fatal_error

    def _wait_started(self, timeout: float = 300.0) -> None:
        # The loop builds its KV cache (and captures CUDA graphs) in its own thread; when that
        # fails (a cache that does not fit), every request would be refused and retried for ever.
        # Fail the engine's load instead, with the loop's own error.
        t0 = time.monotonic()
        while self.manager.batch_processor is None and time.monotonic() - t0 < timeout:
            if self._loop_error() is not None or not self.manager.is_running():
                break
            time.sleep(0.02)
        error = self._loop_error()
        if error is not None or not self.manager.is_running():
            raise RuntimeError(f"hf engine: transformers' continuous batching did not start: {error or 'its loop ended'}"
                               " (engine.max_batch_tokens, num_blocks or kv_memory_fraction)")

    def _profile_batch(self, ids: list[int], batch: int, steps: int, tag: str) -> None:
        # before the router starts: this reads the manager's output queue itself
        t0 = time.perf_counter()
        for k in range(batch):
            self.manager.add_request(ids, request_id=f"{tag}-{k}", max_new_tokens=steps, eos_token_id=-1)
        finished = 0
        while finished < batch and time.perf_counter() - t0 < 60:
            out = self.manager.get_result(timeout=0.1)
            finished += out is not None and out.is_finished()

    def _route(self) -> None:
        # The manager has one output queue; hand each finished request to the task waiting on it.
        while not self._closed.is_set():
            result = self.manager.get_result(timeout=0.1)
            if result is None and self._loop_error() is not None:
                # the loop died mid-run: every waiting task learns why now, not after request_timeout
                self._queue.fail_all(f"its generation loop died: {self._loop_error()}")
                continue
            if result is None or not result.is_finished():
                continue
            self._queue.finish(result.request_id, Response(result.generated_tokens, result.logprobs,
                                                          error=result.error))
            self._admit()  # a slot is free: the next request in priority order may start

    def _submitted(self) -> None:
        self._admit()

    def _admit(self) -> None:
        # add_request returns None when the manager's loop died or is stopping
        self._queue.admit(lambda rid, ids: self.manager.add_request(
            ids, request_id=rid, max_new_tokens=self.config.max_new_tokens) is not None, self.config.max_running)

    def _weights_paused(self) -> AbstractContextManager:
        # the loop stops at a step boundary; running requests keep their caches and resume
        return self.manager.pause()

    def _stop(self) -> None:
        if self.manager is not None:  # None: closed before it loaded
            self.manager.stop(block=True, timeout=5)
