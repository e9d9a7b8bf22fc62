"""The slot engine decoding with many LoRA adapters against the base model alone, and what one
adapter's hand-over costs.

    python benchmarks/adapter_decode.py MODEL --device cuda --requests 256 --adapters 8 --out x.json
    python benchmarks/adapter_decode.py MODEL --device cpu --requests 16 --tokens 32   # this CPU

One engine (``engine.batching = "slots"``, CUDA graphs on a GPU), ``--requests`` requests of
``--tokens`` new tokens each (end-of-sequence off, so every request decodes them all), run three
ways, ``--repeats`` times each (``base``'s first, the others interleaved):

- ``base``: the engine holds no adapter (no hook on any layer: the plain model), measured before
  any is loaded (a loaded adapter's hooks stay on the model; ``hooked_base`` is the base through
  them);
- ``one``: every request decodes with one adapter (the served LoRA policy);
- ``mixed``: the requests spread round-robin over ``--adapters`` adapters, decoded in the same
  steps (the per-row gather and two batched products per adapted layer).

Adapters are random (rank ``--rank`` on every linear layer but the head, as a LoRA learner trains
them); only their shapes matter to the speed. Reported: decode tokens/s of each way (the best of
the repeats), their ratios to ``base``, and one adapter's publication: its bytes against the
whole model's and the seconds :meth:`load_adapter` takes (the copy into the engine's stacks,
between two decode steps).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from streamrl.contracts import adapters as payload  # noqa: E402
from streamrl.engines.base import HFEngineConfig  # noqa: E402
from streamrl.engines.slots import SlotEngine  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_adapter(model, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """An adapter publication of rank ``rank`` on every targeted linear layer of ``model``."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS:
            out[name + payload.A] = torch.randn(rank, module.in_features, generator=g) * 0.01
            out[name + payload.B] = torch.randn(module.out_features, rank, generator=g) * 0.01
            out[name + payload.SCALE] = torch.tensor(2.0)
    return out


def decode(engine: SlotEngine, requests: int, tokens: int, adapters: list[str]) -> float:
    """Decode tokens per second of ``requests`` requests at once, request ``i`` with adapter
    ``adapters[i % len(adapters)]`` (an empty list: none)."""
    ids = [engine.tokenizer.bos_token_id or 1] + [7] * 15
    t0 = time.perf_counter()
    futures = [engine.stream(f"r{time.monotonic_ns()}-{i}", ids, tokens,
                             **({"adapter": adapters[i % len(adapters)]} if adapters else {}))
               for i in range(requests)]
    got = sum(len(f.result(timeout=3600).tokens) for f in futures)
    return got / (time.perf_counter() - t0)


def main() -> int:
    """Parse the flags, measure, print and write the figures."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a model folder (Llama or Qwen2)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats: {args.repeats}; expected 1 or more")
    engine = SlotEngine(HFEngineConfig(batching="slots", slots=args.requests, max_prompt_tokens=16,
                                       # (+1: the served policy's index, reserved)
                                       max_new_tokens=args.tokens, profile=False, adapters=args.adapters + 1,
                                       cuda_graph=True))
    engine.load(args.model, device=args.device)
    engine.decoder.stop_ids.fill_(-1)  # every request decodes all its tokens
    names = [f"a{k}" for k in range(args.adapters)]
    publications = [random_adapter(engine.model, args.rank, k) for k in range(args.adapters)]
    full_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    adapter_bytes = sum(t.numel() * t.element_size() for t in publications[0].values())
    decode(engine, args.requests, min(8, args.tokens), [])  # warm-up: the base, before any hook
    rates: dict[str, list[float]] = {"base": [], "one": [], "mixed": []}
    # the base alone, every repeat before any adapter is loaded: once one is, its hooks stay on
    # the model and a request without an adapter goes through them (that is hooked_base below)
    rates["base"] = [decode(engine, args.requests, args.tokens, []) for _ in range(args.repeats)]
    for _ in range(args.repeats):
        if not engine.adapters.versions:  # the adapters loaded once, timed (the first load allocates the stacks)
            loads = []
            for name, pub in zip(names, publications):
                t0 = time.perf_counter()
                engine.load_adapter(name, pub, 1)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                loads.append(time.perf_counter() - t0)
            decode(engine, args.requests, min(8, args.tokens), names)  # (a graph captured again, here)
        rates["one"].append(decode(engine, args.requests, args.tokens, names[:1]))
        rates["mixed"].append(decode(engine, args.requests, args.tokens, names))
        # the base again with the hooks in place but no adapter for the requests: what the hooks cost
        rates.setdefault("hooked_base", []).append(decode(engine, args.requests, args.tokens, ["none"]))
    engine.close()
    best = {k: max(v) for k, v in rates.items()}
    result = {"model": args.model, "device": args.device, "requests": args.requests, "tokens": args.tokens,
              "adapters": args.adapters, "rank": args.rank, "repeats": args.repeats,
              "tokens_per_s": best, "all": rates,
              "one_over_base": best["one"] / best["base"], "mixed_over_base": best["mixed"] / best["base"],
              "adapter_bytes": adapter_bytes, "model_bytes": full_bytes, "adapter_over_model": adapter_bytes / full_bytes,
              "adapter_load_s": {"first": loads[0], "later_median": sorted(loads[1:] or loads)[len(loads[1:] or loads) // 2]}}
    print(json.dumps({k: v for k, v in result.items() if k != "all"}, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
