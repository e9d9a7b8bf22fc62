"""The output head + log-softmax alone, forward and backward, each way the trainer can run it.

    python benchmarks/head_logprobs.py --device cuda --tokens 36864 --out head.json

Qwen2.5-0.5B's head shape (hidden 896, vocabulary 151,936) in bf16, ``--tokens`` response
positions. Each way is timed over ``--repeats`` forward + backward passes after one warm-up
(which also compiles), and compared with the first way's log-probs and gradients:

- ``checkpointed``: the chunks under activation checkpointing, float32 log-softmax of each chunk
  (the trainer before ``training/head_logprobs.py``);
- ``fused-eager`` / ``fused-compiled``: ``HeadLogprobs`` with eager or ``torch.compile``-d
  per-chunk reductions, at ``--chunk`` and at each ``--big-chunk``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.utils.checkpoint import checkpoint

from streamrl.training.head_logprobs import head_logprobs
from streamrl.training.logprobs import _head_logprobs


def checkpointed(head, h, y, chunk, mode):
    """The chunked head under activation checkpointing (the previous path)."""
    return torch.cat([checkpoint(_head_logprobs, head, h[i:i + chunk], y[i:i + chunk], 1.0, use_reentrant=False)
                      for i in range(0, h.shape[0], chunk)])


def fused(head, h, y, chunk, mode):
    """``training/head_logprobs.py``."""
    return head_logprobs(head, h, y, chunk, mode)


def measure(fn, head, h, y, g, chunk, mode, repeats, sync):
    """Seconds per forward + backward (median), peak memory over the base, and the results."""
    times = []
    for r in range(repeats + 1):
        h.grad, head.weight.grad = None, None
        sync()
        if h.is_cuda:
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if h.is_cuda else 0
        t0 = time.perf_counter()
        lp = fn(head, h, y, chunk, mode)
        (lp * g).sum().backward()
        sync()
        if r:  # the first pass warms up (and compiles)
            times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if h.is_cuda else 0.0
    times.sort()
    return times[len(times) // 2], peak, (lp.detach().float(), h.grad.float(), head.weight.grad.float())


def main() -> None:
    """Parse the flags, time each way, print and write the rows."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=36864)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--big-chunk", type=int, action="append", default=[])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False, device=dev, dtype=dtype)
    torch.nn.init.normal_(head.weight, std=0.02)
    h = torch.randn(args.tokens, args.hidden, device=dev, dtype=dtype, requires_grad=True)
    y = torch.randint(0, args.vocab, (args.tokens,), device=dev)
    g = torch.randn(args.tokens, device=dev)  # a per-token weight, as a PPO loss gives
    ways = [("checkpointed", checkpointed, args.chunk, "eager"), ("fused-eager", fused, args.chunk, "eager"),
            ("fused-compiled", fused, args.chunk, "compiled")]
    ways += [(f"fused-compiled-{c}", fused, c, "compiled") for c in args.big_chunk]
    rows, ref = [], None
    # 2 x tokens x hidden x vocab per product; forward 1, backward 3 (recompute + two products)
    flops = 2 * args.tokens * args.hidden * args.vocab * 4
    for name, fn, chunk, mode in ways:
        try:
            s, peak, res = measure(fn, head, h, y, g, chunk, mode, args.repeats, sync)
        except Exception as e:  # noqa: BLE001 -- one way failing (out of memory, no compiler) is a row
            rows.append({"way": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            print(rows[-1], flush=True)
            continue
        ref = ref or res
        diff = [float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) for a, b in zip(res, ref)]
        rows.append({"way": name, "chunk": chunk, "seconds": round(s, 4), "tflops": round(flops / s / 1e12, 1),
                     "peak_gib": round(peak, 2), "rel_diff_logprob_gradh_gradw": [round(d, 5) for d in diff]})
        print(rows[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
