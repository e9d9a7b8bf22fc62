"""A decoder of fixed request slots over a transformers model's own modules: what the ``slots``
engine runs (``engines/slots.py``).

transformers' generation pays ~45 ms of kernel launches per decode step of a 0.5B model on a
GPU that computes the step in ~4 ms: its caches grow and its masks are rebuilt in Python every
step. Here everything a decode step touches has a fixed shape and a fixed address, so the whole
step -- embeddings, every layer, the head, sampling, log-probs and the bookkeeping of lengths --
is captured once in a CUDA graph and replayed:

- a static KV cache of ``slots x context`` positions per layer; a request owns one slot from its
  prefill to its last token, and a freed slot takes the next request at the next step;
- per-slot state in device tensors (the last token, its position, tokens generated, the
  request's limit), updated inside the step;
- the step runs over the first ``b`` slots only, ``b`` the smallest captured size (a power of
  two) that holds the highest slot in use, so a long tail of a few requests does not pay for all;
- attention of one new token over its slot's cache, masked to the positions it has filled.

The model's own modules compute everything else (norms, projections, rotary embeddings, MLPs,
head): the weights are the model's parameters, so a weight load that copies into them in place
is seen by the next replay. Llama and Qwen2 decoders (the architectures streamrl ships) are
supported; :func:`check_supported` names what is not.

Prompts are prefilled each distinct prompt once, its cache copied into the slots of every sample
that shares it (``engines/slot_prefill.py``): on a GPU from graphs captured per bucket of prompts
and width, eagerly past the buckets. On CPU the same step and prefill run without graphs.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from contextlib import nullcontext
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from streamrl.engines.slot_prefill import PromptForward


def check_supported(model) -> None:
    """Raise ``ValueError`` naming what the slot decoder cannot decode in ``model``."""
    kind = getattr(model.config, "model_type", "?")
    if kind not in ("llama", "qwen2"):
        raise ValueError(f"engine.batching = \"slots\" decodes Llama and Qwen2 models; this model is {kind!r} "
                         "(use batching = \"continuous\")")
    for layer in model.model.layers:
        if getattr(layer.self_attn, "sliding_window", None):
            raise ValueError("engine.batching = \"slots\" does not decode sliding-window attention layers "
                             "(use batching = \"continuous\")")


class Start(NamedTuple):
    """A request to start in a slot (:meth:`SlotDecoder.prefill`)."""

    slot: int
    ids: list[int]
    """Its prompt's token ids."""
    limit: int
    """Most new tokens."""
    greedy: bool
    adapter: int = 0
    """Index of its LoRA adapter in the engine's :class:`~streamrl.engines.adapters.AdapterBank`
    (0: the base weights alone)."""


class SlotDecoder:
    """The KV cache, the per-slot state and the decode step of ``slots`` requests at once.

    Not thread-safe: one loop thread drives it (``engines/slots.py``)."""

    def __init__(self, model, slots: int, context: int, max_new_tokens: int, temperature: float,
                 stop_ids: Sequence[int], graphs: bool, adapters=None, fused: bool = True, prefill_graphs: bool = True):
        check_supported(model)
        self.model, self.slots, self.context = model, slots, context
        self.adapters = adapters
        """The engine's :class:`~streamrl.engines.adapters.AdapterBank` (None: no adapters): each
        slot's request computes with its own adapter, in the same step as the others."""
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        cfg = model.config
        first = model.model.layers[0].self_attn
        self.head_dim = first.head_dim
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.scaling = first.scaling
        # the modeling module's own rotary application (Llama's and Qwen2's are the same function)
        self._rotate = importlib.import_module(type(first).__module__).apply_rotary_pos_emb
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        dev = self.device
        shape = (slots, self.kv_heads, context, self.head_dim)
        self.k_cache = [torch.zeros(shape, device=dev, dtype=self.dtype) for _ in model.model.layers]
        self.v_cache = [torch.zeros(shape, device=dev, dtype=self.dtype) for _ in model.model.layers]
        # per-slot state, read and written by the step (inactive slots decode garbage that no
        # one reads, at position 0 of their own cache)
        self.token = torch.zeros(slots, dtype=torch.long, device=dev)
        self.position = torch.zeros(slots, dtype=torch.long, device=dev)
        self.generated = torch.zeros(slots, dtype=torch.long, device=dev)
        self.limit = torch.ones(slots, dtype=torch.long, device=dev)
        self.active = torch.zeros(slots, dtype=torch.bool, device=dev)
        self.greedy = torch.zeros(slots, dtype=torch.bool, device=dev)
        self.adapter = torch.zeros(slots, dtype=torch.long, device=dev)
        self.finished = torch.zeros(slots, dtype=torch.bool, device=dev)
        self.out_tokens = torch.zeros(slots, max_new_tokens, dtype=torch.long, device=dev)
        self.out_logprobs = torch.zeros(slots, max_new_tokens, dtype=torch.float32, device=dev)
        # (-1, no token, stands for none: a model without an EOS decodes to its limits)
        self.stop_ids = torch.tensor(list(stop_ids) or [-1], dtype=torch.long, device=dev)
        """The tokens that end a response (``engines/stop_tokens.py``), a tensor so a latency
        profile can turn them off (-1) under a captured graph."""
        self.fused_error: str | None = None
        """Why the fused kernels were asked for and not used (they failed at their first call)."""
        self.fused = False
        """Whether the step samples with :mod:`~streamrl.engines.fused_sampling`'s kernels (asked
        for, on a GPU, Triton here) rather than torch ops."""
        if fused and dev.type == "cuda":  # (a CPU process never imports Triton)
            from streamrl.engines import fused_sampling

            self.fused = fused_sampling.available()
            self._fused_sample = fused_sampling.sample
            self._seed = fused_sampling.new_seed(dev) if self.fused else None
            if self.fused:
                self._try_fused(model.lm_head.out_features)
        self._span = torch.arange(context, device=dev)
        self._rows = torch.arange(slots, device=dev)
        self.sizes = [b for b in (2 ** i for i in range(16)) if b < slots] + [slots]
        """The batch sizes a step runs at (a graph each on a GPU): powers of two, then ``slots``."""
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._captured_layout = adapters.layout if adapters is not None else 0
        self.graphs = graphs and self.device.type == "cuda"
        if self.graphs:
            self._capture()
        self.prompts = PromptForward(self, static=self.graphs and prefill_graphs, graphs=self.graphs and prefill_graphs)
        """The prefill's forward (:class:`~streamrl.engines.slot_prefill.PromptForward`): from
        graphs captured per bucket where the decode step has its graphs, else eager."""

    def _try_fused(self, vocab: int) -> None:
        # the kernels compile at their first call: one that fails here (a Triton too old for
        # them, a head they cannot read) leaves the torch ops in place, said once in the log
        try:
            self._fused_sample(torch.zeros(2, vocab, dtype=self.dtype, device=self.device),
                               torch.zeros(2, dtype=torch.bool, device=self.device), self.temperature, self._seed)
        except Exception as e:  # noqa: BLE001 -- the torch ops sample the same way, only slower
            self.fused = False
            self.fused_error = f"{type(e).__name__}: {e}"
            logging.getLogger(__name__).warning("engine.fused_sampling: the kernels failed (%s); the slot decoder "
                                                "samples with torch ops", self.fused_error)

    # -- the decode step ------------------------------------------------------------------------

    def _layers(self, x: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """The decoder's layers over hidden states ``x`` (``[n, t, hidden]`` at ``positions``
        ``[n, t]``), then its final norm: norms, projections, rotary embeddings and MLPs are the
        model's own modules. ``attend(i, q, k, v)`` stores layer ``i``'s new keys and values in the
        cache and returns the attention output (``[n, heads, t, head_dim]``): the one place a
        decode step and a prefill differ."""
        m = self.model.model
        n, t = x.shape[:2]
        cos, sin = m.rotary_emb(x, positions)
        for i, layer in enumerate(m.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(n, t, self.heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(n, t, self.kv_heads, self.head_dim).transpose(1, 2)
            v = attn.v_proj(h).view(n, t, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = self._rotate(q, k, cos, sin)
            o = attend(i, q, k, v)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(n, t, self.heads * self.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return m.norm(x)

    def _with_adapters(self, rows: torch.Tensor):
        """Within: each row of a forward adds its own adapter (``rows``: their indices)."""
        return self.adapters.rows(rows) if self.adapters is not None else nullcontext()

    def _step(self, b: int) -> None:
        """One token for each of the first ``b`` slots: the body a graph captures."""
        with self._with_adapters(self.adapter[:b]):
            self._decode(b)

    def _decode(self, b: int) -> None:
        m = self.model.model
        tok, pos, act = self.token[:b], self.position[:b], self.active[:b]
        # a slot sees its cache up to (and with) the position it writes now
        mask = (self._span[None] <= pos[:, None])[:, None, None, :]
        rows = self._rows[:b]

        def attend(i, q, k, v):  # one new token per slot, over its slot's cache
            kc, vc = self.k_cache[i], self.v_cache[i]
            kc[rows, :, pos] = k[:, :, 0]
            vc[rows, :, pos] = v[:, :, 0]
            return F.scaled_dot_product_attention(q, kc[:b], vc[:b], attn_mask=mask, scale=self.scaling,
                                                  enable_gqa=self.kv_heads != self.heads)

        x = self._layers(m.embed_tokens(tok)[:, None], pos[:, None], attend)  # [b, 1, hidden]
        logits = self.model.lm_head(x[:, 0])
        nxt, lp = self._sample(logits, self.greedy[:b])
        col = self.generated[:b].clamp(max=self.max_new_tokens - 1)
        # (an ended request, not released yet, keeps its last token where the clamp points)
        self.out_tokens[rows, col] = torch.where(act, nxt, self.out_tokens[rows, col])
        self.out_logprobs[rows, col] = torch.where(act, lp, self.out_logprobs[rows, col])
        step = act.long()
        self.token[:b] = torch.where(act, nxt, tok)
        self.generated[:b] += step
        self.position[:b] = (pos + step).clamp(max=self.context - 1)
        # an ended request stops decoding here and stays finished until it is released: the
        # loop may read the flags only every few steps (engine.finished_every)
        done = act & (self._stops(nxt) | (self.generated[:b] >= self.limit[:b]))
        self.finished[:b] |= done
        self.active[:b] = act & ~done

    def _stops(self, tokens: torch.Tensor) -> torch.Tensor:
        # (a comparison against the few stop ids, not torch.isin: the same kernels every call,
        # which a captured graph needs)
        return (tokens[:, None] == self.stop_ids).any(-1)

    def _sample(self, logits: torch.Tensor, greedy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Next tokens and their log-probs under the tempered distribution (as the trainer
        computes them): a draw by the Gumbel-max trick, or the argmax where ``greedy``; in two
        Triton kernels when :attr:`fused`, else in torch ops."""
        if self.fused:
            return self._fused_sample(logits, greedy, self.temperature, self._seed)
        lp = torch.log_softmax(logits.float() / self.temperature, dim=-1)
        # argmax(lp + Gumbel noise) is a draw from softmax(lp); exponential_ is graph-safe
        noise = -torch.empty_like(lp).exponential_().log()
        nxt = torch.where(greedy, lp.argmax(-1), (lp + noise).argmax(-1))
        return nxt, lp.gather(1, nxt[:, None]).squeeze(1)

    def size_for(self, highest_slot: int) -> int:
        """The smallest step size that covers slot ``highest_slot``."""
        return next(b for b in self.sizes if b > highest_slot)

    @torch.no_grad()
    def step(self, b: int) -> None:
        """Decode one token for the first ``b`` slots (``b`` one of :attr:`sizes`): a graph's
        replay on a GPU, the eager step elsewhere."""
        if self.graphs and self.adapters is not None and self.adapters.layout != self._captured_layout:
            self._capture_again()  # (new adapter layers, or a higher rank: stacks the graphs do not read)
        graph = self._graphs.get(b)
        if graph is not None:
            graph.replay()
        else:
            self._step(b)

    @torch.no_grad()
    def _capture(self) -> None:
        # warm up on a side stream (cuBLAS handles, the allocator), then capture every size into
        # one memory pool: graphs run one at a time, so they can share their intermediates
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(self.slots)
        torch.cuda.current_stream().wait_stream(stream)
        pool = None
        for b in reversed(self.sizes):  # the largest first: the pool is sized by it
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._step(b)
            pool = graph.pool()
            self._graphs[b] = graph
        self.reset()

    def _capture_again(self) -> None:
        """Capture every size anew, the requests in their slots kept: the dry steps write only
        each slot's state, kept here and put back, and cache positions from the one a slot
        writes next (written again before they are read)."""
        kept = [t.clone() for t in (self.token, self.position, self.generated, self.limit, self.active,
                                    self.greedy, self.adapter, self.finished, self.out_tokens, self.out_logprobs)]
        self._graphs.clear()
        self._captured_layout = self.adapters.layout
        self._capture()
        for t, k in zip((self.token, self.position, self.generated, self.limit, self.active, self.greedy,
                         self.adapter, self.finished, self.out_tokens, self.out_logprobs), kept):
            t.copy_(k)

    # -- requests in and out ----------------------------------------------------------------------

    def reset(self) -> None:
        """Every slot free (after a capture's dry steps, or to start over)."""
        for t in (self.token, self.position, self.generated, self.out_tokens):
            t.zero_()
        self.active.zero_()
        self.finished.zero_()

    @torch.no_grad()
    def prefill(self, requests: list[Start | tuple]) -> None:
        """Start requests (:class:`Start`, or ``(slot, prompt ids, max new tokens, greedy)``) in
        their slots: each distinct prompt (and adapter) runs through the model once, its cache
        is copied into every slot that asks for it, and each slot draws its first token. A prompt
        must leave room in the context for its tokens (the engine checks)."""
        requests = [Start(*r) for r in requests]
        distinct: dict[tuple, int] = {}
        row_of = [distinct.setdefault((tuple(r.ids), r.adapter), len(distinct)) for r in requests]
        prompts = [ids for ids, _ in distinct]
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        slots = torch.tensor([r.slot for r in requests], device=self.device)
        rows = torch.tensor(row_of, device=self.device)
        adapters = torch.tensor([a for _, a in distinct], device=self.device)
        # right-padded, causal: every real token is kept from seeing the padding after it
        logits = self.prompts(prompts, adapters, slots, rows)
        greedy = torch.tensor([r.greedy for r in requests], device=self.device)
        nxt, lp = self._sample(logits, greedy)
        limits = torch.tensor([r.limit for r in requests], device=self.device)
        self.token[slots] = nxt
        self.position[slots] = lengths[rows]
        self.generated[slots] = 1
        self.limit[slots] = limits
        self.greedy[slots] = greedy
        self.adapter[slots] = adapters[rows]
        self.out_tokens[slots, 0] = nxt
        self.out_logprobs[slots, 0] = lp
        done = self._stops(nxt) | (limits <= 1)
        self.finished[slots] = done
        self.active[slots] = ~done

    def finished_slots(self, b: int) -> np.ndarray:
        """Slots among the first ``b`` whose request ended since they were last released (one
        small copy from the device, which waits for the steps queued before it)."""
        return np.flatnonzero(self.finished[:b].cpu().numpy())

    def release(self, slots) -> list[tuple[list[int], list[float]]]:
        """The ``(tokens, log-probs)`` of each of ``slots`` (finished), which become free."""
        if len(slots) == 0:
            return []
        idx = torch.as_tensor(slots, dtype=torch.long, device=self.device)
        counts = self.generated[idx].tolist()
        tokens, logprobs = self.out_tokens[idx].tolist(), self.out_logprobs[idx].tolist()
        self.active[idx] = False
        self.finished[idx] = False
        self.generated[idx] = 0
        self.position[idx] = 0
        return [(t[:n], lp[:n]) for t, lp, n in zip(tokens, logprobs, counts)]
