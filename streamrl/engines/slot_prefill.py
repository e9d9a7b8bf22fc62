"""Prompts into the slot decoder's cache: each distinct prompt through the model once, its keys
and values copied into every slot that asks for it, and the logits its requests draw their first
token from (``SlotDecoder.prefill``).

Eagerly, a prefill launches every layer's kernels one by one -- some 300-400 for a 0.5B model,
milliseconds of the host's time that the decode steps of every running request wait for, at each
admission. On a GPU with CUDA graphs the forward is instead captured once per *bucket* (a power of
two of prompts, by a width that is 16 times a power of two), over fixed input and output buffers,
and replayed: the prompts are padded to the smallest bucket that holds them (padded rows and
positions compute what no one reads: attention is causal and right-padded), their keys and values
land in a staging buffer shared by every bucket, and the eager rest is one copy per layer into the
slots, the output head over the real prompts' last positions and the draw. Buckets hold at most :data:`GRAPH_TOKENS` positions (a bigger prefill spends
its time computing, not launching, and the staging buffer and the graphs' memory stay bounded);
a prefill past them, or with LoRA adapters, runs eagerly (in parts of at most :data:`EAGER_TOKENS`
positions: a burst of long prompts in one forward could run out of memory).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

#: Most positions (prompts x width) a captured prefill bucket holds.
GRAPH_TOKENS = 8192

#: Most positions (prompts x width) one eager prefill forward holds; more are prefilled in parts.
EAGER_TOKENS = 16384

#: Prompt positions a prefill's width is a multiple of (few shapes for the allocator and the graphs).
WIDTH_STEP = 16


class PromptForward:
    """The prefill's forward over distinct prompts, eager or from captured graphs.

    ``static``: pad to the buckets and use the fixed buffers (what the graphs replay); on a CPU
    only the tests ask for it, to check the padded path against the eager one. ``graphs``:
    capture each bucket (a GPU)."""

    def __init__(self, decoder, static: bool, graphs: bool):
        self.d = decoder
        self.static = static and decoder.adapters is None
        self.graphs = graphs and self.static and decoder.device.type == "cuda"
        self.error: str | None = None
        """Why the graphs were asked for and not used (their capture failed)."""
        self.replays = 0
        """Prefills run from a captured graph so far (the engine's loop counts them)."""
        self.buckets: list[tuple[int, int]] = []
        """The (prompts, width) shapes a static prefill pads to, smallest first."""
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        if self.static:
            try:
                self._allocate()
            except torch.OutOfMemoryError as e:  # (the eager prefill needs none of it)
                self._give_up(e)
                return
            if self.graphs:
                self._capture()

    # -- the buffers and the graphs ---------------------------------------------------------------

    def _allocate(self) -> None:
        d = self.d
        longest = max(1, d.context - d.max_new_tokens)  # (the engine's max_prompt_tokens)
        widest = min(d.context, -(-longest // WIDTH_STEP) * WIDTH_STEP)
        widths = [w for w in (WIDTH_STEP * 2 ** k for k in range(12)) if w < widest] + [widest]
        counts = [p for p in (2 ** k for k in range(16)) if p < d.slots] + [d.slots]
        self.buckets = sorted(((p, w) for w in widths for p in counts if p * w <= GRAPH_TOKENS),
                              key=lambda b: (b[0] * b[1], b[1]))
        if not self.buckets:
            self.static = self.graphs = False
            return
        most = max(p * w for p, w in self.buckets)
        widest_count = max(p for p, _ in self.buckets)
        dev, dtype = d.device, d.dtype
        # one staging area per layer for every bucket's keys and values (one bucket runs at a time)
        size = most * d.kv_heads * d.head_dim
        self._k = [torch.zeros(size, device=dev, dtype=dtype) for _ in d.model.model.layers]
        self._v = [torch.zeros(size, device=dev, dtype=dtype) for _ in d.model.model.layers]
        self._ids = torch.zeros(most, dtype=torch.long, device=dev)
        self._last = torch.zeros(widest_count, dtype=torch.long, device=dev)
        self._rows = torch.arange(widest_count, device=dev)
        # each prompt's last hidden state: the head runs eagerly on the real prompts alone (a
        # captured head would keep [prompts, vocabulary] logits for every padded row too)
        self._hidden = torch.zeros(widest_count, d.model.config.hidden_size, device=dev, dtype=dtype)

    def _staged(self, flat: torch.Tensor, p: int, w: int) -> torch.Tensor:
        return flat[:p * self.d.kv_heads * w * self.d.head_dim].view(p, self.d.kv_heads, w, self.d.head_dim)

    def _body(self, p: int, w: int) -> None:
        """A bucket's forward over the fixed buffers: what a graph captures."""
        d = self.d
        m = d.model.model
        positions = d._span[:w][None].expand(p, -1)

        def attend(i, q, k, v):
            self._staged(self._k[i], p, w).copy_(k)
            self._staged(self._v[i], p, w).copy_(v)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d.scaling,
                                                  enable_gqa=d.kv_heads != d.heads)

        x = d._layers(m.embed_tokens(self._ids[:p * w].view(p, w)), positions, attend)
        self._hidden[:p].copy_(x[self._rows[:p], self._last[:p]])

    @torch.no_grad()
    def _capture(self) -> None:
        # each bucket warmed up on a side stream (cuBLAS picks its kernels per shape, Triton compiles
        # each shape), then captured; the graphs share one memory pool with the decode step's (one
        # graph runs at a time, on one stream, and none leaves anything in the pool past its replay:
        # every output is a buffer made before the capture). A capture that fails leaves the eager
        # prefill, said once.
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for p, w in self.buckets:
                    self._body(p, w)
            torch.cuda.current_stream().wait_stream(stream)
            decode = next(iter(self.d._graphs.values()), None)
            pool = decode.pool() if decode is not None else None
            for p, w in reversed(self.buckets):  # (the largest first: the pool grows least)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._body(p, w)
                pool = graph.pool()
                self._graphs[(p, w)] = graph
        except Exception as e:  # noqa: BLE001 -- the eager prefill computes the same, only slower
            self._give_up(e)

    def _give_up(self, e: BaseException) -> None:
        # the eager prefill from now on, the buffers given back, said once in the log
        self._graphs.clear()
        self.graphs = self.static = False
        self.buckets, self._k, self._v = [], [], []
        self._hidden = self._ids = self._last = self._rows = None
        self.error = f"{type(e).__name__}: {e}"
        logging.getLogger(__name__).warning("engine.prefill_graphs: the prefill's graphs failed (%s); prompts "
                                            "prefill eagerly", self.error)

    # -- a prefill -----------------------------------------------------------------------------------

    def bucket(self, prompts: int, width: int) -> tuple[int, int] | None:
        """The smallest bucket holding ``prompts`` prompts of ``width`` positions (None: none does)."""
        return next(((p, w) for p, w in self.buckets if p >= prompts and w >= width), None)

    def __call__(self, prompts: list[list[int]], adapters: torch.Tensor, slots: torch.Tensor,
                 rows: torch.Tensor) -> torch.Tensor:
        """Prefill ``prompts`` (distinct token-id lists; ``adapters``: each one's adapter index):
        every layer's keys and values of prompt ``rows[j]`` written into slot ``slots[j]``; the
        logits after each one's last token, one row per ``rows`` entry."""
        d = self.d
        n = len(prompts)
        width = min(-(-max(len(p) for p in prompts) // WIDTH_STEP) * WIDTH_STEP, d.context)
        bucket = self.bucket(n, width) if self.static else None
        if bucket is None:
            return self._eager_in_parts(prompts, adapters, slots, rows)
        p, w = bucket
        ids = torch.zeros(p, w, dtype=torch.long)  # (built here, then one copy to the device)
        last = torch.zeros(p, dtype=torch.long)
        for r, prompt in enumerate(prompts):
            ids[r, :len(prompt)] = torch.tensor(prompt)
            last[r] = len(prompt) - 1
        self._ids[:p * w].copy_(ids.view(-1))
        self._last[:p].copy_(last)
        graph = self._graphs.get(bucket)
        if graph is not None:
            graph.replay()
            self.replays += 1
        else:
            self._body(p, w)
        for i in range(len(d.k_cache)):
            d.k_cache[i][slots, :, :w] = self._staged(self._k[i], p, w)[rows]
            d.v_cache[i][slots, :, :w] = self._staged(self._v[i], p, w)[rows]
        return d.model.lm_head(self._hidden[:n])[rows]

    def _eager_in_parts(self, prompts, adapters, slots, rows) -> torch.Tensor:
        # at most EAGER_TOKENS positions a forward: a burst of long distinct prompts (every free
        # slot's, hundreds x thousands of tokens) in one forward ran a GPU out of memory on its
        # activations; each part is its prompts' own width
        n = len(prompts)
        parts, lo = [], 0
        while lo < n:
            hi, width = lo, 0
            while hi < n:
                w = min(-(-max(width, len(prompts[hi])) // WIDTH_STEP) * WIDTH_STEP, self.d.context)
                if hi > lo and (hi + 1 - lo) * w > EAGER_TOKENS:
                    break
                hi, width = hi + 1, w
            parts.append((lo, hi, width))
            lo = hi
        if len(parts) == 1:
            return self._eager(prompts, adapters, slots, rows, parts[0][2])
        out = None
        for lo, hi, width in parts:
            pick = ((rows >= lo) & (rows < hi)).nonzero().squeeze(1)  # the requests of these prompts
            logits = self._eager(prompts[lo:hi], adapters[lo:hi], slots[pick], rows[pick] - lo, width)
            if out is None:
                out = logits.new_empty(len(rows), logits.shape[-1])
            out[pick] = logits
        return out

    def _eager(self, prompts, adapters, slots, rows, width) -> torch.Tensor:
        # each distinct prompt over itself, right-padded to ``width``, its cache copied to every
        # slot asking for it
        d = self.d
        m = d.model.model
        n = len(prompts)
        lengths = torch.tensor([len(p) for p in prompts], device=d.device)
        ids = torch.zeros(n, width, dtype=torch.long)  # (built here, then one copy to the device)
        for r, p in enumerate(prompts):
            ids[r, :len(p)] = torch.tensor(p)
        ids = ids.to(d.device)
        positions = torch.arange(width, device=d.device)[None].expand(n, -1)

        def attend(i, q, k, v):
            d.k_cache[i][slots, :, :width] = k[rows]
            d.v_cache[i][slots, :, :width] = v[rows]
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d.scaling,
                                                  enable_gqa=d.kv_heads != d.heads)

        with d._with_adapters(adapters):
            x = d._layers(m.embed_tokens(ids), positions, attend)
            last = x[torch.arange(n, device=d.device), lengths - 1]
            return d.model.lm_head(last)[rows]
