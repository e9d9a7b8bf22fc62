"""Static batching: a set of requests decoded together, as one padded batch, until all finish.

The ``hf`` engine's default is transformers' continuous batching, which admits requests at
every decode step -- what a long tail of outputs needs. When outputs are short and arrive
together (W1: 512 responses of ~4 tokens per step), its per-step bookkeeping (paged cache,
attention masks rebuilt per step) costs more than the model: one padded batch with a plain KV
cache decodes the same 512 responses 2-3x faster on one CPU thread (measured in
docs/benchmarks.md). The price: a request that arrives while a batch runs waits for the next
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

from streamrl.engines.hf import HFEngine, HFEngineConfig
from streamrl.engines.request_queue import Response


@torch.no_grad()
def decode_batch(model, prompts: list[list[int]], max_new_tokens: int, temperature: float, eos_id: int,
                 pad_id: int = 0, generator: torch.Generator | None = None,
                 stop_at_eos: bool = True) -> list[tuple[list[int], list[float]]]:
    """Sample one response per prompt: ``[(tokens, logprobs)]``, each ending at its first EOS
    (included) or after ``max_new_tokens``. Logprobs are of the tempered distribution, as the
    trainer computes them. ``generator`` (a CPU generator) makes the draws reproducible;
    ``stop_at_eos=False`` decodes every row to ``max_new_tokens`` (latency profiles)."""
    device = next(model.parameters()).device
    # Samples of one group share their prompt: prefill each distinct prompt once, then give
    # every row a copy of its prompt's KV cache (8 samples per prompt: 1/8 of the prefill)
    distinct: dict[tuple[int, ...], int] = {}
    row_of = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
    unique = [list(p) for p in distinct]
    width = max(len(p) for p in unique)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in unique], device=device)
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in unique], device=device)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True)
    past, logits, pos = out.past_key_values, out.logits[:, -1], pos[:, -1:]
    if len(unique) < len(prompts):
        rows = torch.tensor(row_of, device=device)
        past.reorder_cache(rows)
        logits, attn, pos = logits[rows], attn[rows], pos[rows]
    tokens, logps = [], []
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    for _ in range(max_new_tokens):
        lp = torch.log_softmax(logits.float() / temperature, dim=-1)
        if generator is not None:  # a CPU generator draws on the CPU
            lp = lp.cpu()
        nxt = torch.multinomial(lp.exp(), 1, generator=generator).squeeze(1).to(device)
        tokens.append(nxt)
        logps.append(lp.gather(1, nxt[:, None].to(lp.device)).squeeze(1))
        done |= nxt == eos_id
        if stop_at_eos and bool(done.all()):
            break
        attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
        pos = pos + 1
        out = model(input_ids=nxt[:, None], attention_mask=attn, position_ids=pos, past_key_values=past,
                    use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1]
    tok, lps = torch.stack(tokens, 1).tolist(), torch.stack(logps, 1).tolist()
    responses = []
    for row, lrow in zip(tok, lps):
        end = row.index(eos_id) + 1 if stop_at_eos and eos_id in row else len(row)  # cut after the first EOS
        responses.append((row[:end], lrow[:end]))
    return responses


class StaticEngine(HFEngine):
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
        decode_batch(self.model, [ids] * batch, steps, self.config.temperature, self.tokenizer.eos_token_id,
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
                                       self.config.temperature, self.tokenizer.eos_token_id,
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
