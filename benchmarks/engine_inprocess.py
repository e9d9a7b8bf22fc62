"""The ``hf`` engine's slot decoder driven in-process (no Dask): generated tokens/s at 256 and 64
requests of N new tokens, and its log-probs against a forward of the same model.

    python benchmarks/engine_inprocess.py MODEL_DIR [NEW_TOKENS]     # e.g. 256 on a GPU, 8 on CPU

What ``streamrl bench engine`` measures through a cluster, less the generate tasks and Dask
around it: the difference between the two is what the dataflow costs. Each size decodes one warm
group of requests first (graph capture, allocator), then the timed one; EOS is turned off so every
response is NEW_TOKENS long. Prints one JSON line per size.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from streamrl.engines.hf import HFEngine, HFEngineConfig
from streamrl.sample import Prompt
from streamrl.training.logprobs import pad_batch, token_logprobs


def main() -> None:
    """Measure both sizes and print their JSON lines."""
    path = sys.argv[1]
    new_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    for n_prompts, slots in [(32, 256), (8, 64)]:
        engine = HFEngine(HFEngineConfig(max_new_tokens=new_tokens, batching="slots", slots=slots,
                                         max_prompt_tokens=64, profile=True))
        t0 = time.time()
        engine.load(path)
        load_s = time.time() - t0
        engine.decoder.eos_id.fill_(-1)
        prompts = [Prompt(uid=f"p{i}", text=f"{i}+{i * 3}=", answer="") for i in range(n_prompts)]
        engine.generate_groups(prompts, 8, [0.0] * n_prompts)  # warm
        t0 = time.time()
        groups = engine.generate_groups(prompts, 8, [0.0] * n_prompts)
        seconds = time.time() - t0
        tokens = sum(len(s.response_ids) for g in groups for s in g)
        samples = [g[0] for g in groups[:4]]
        ids, attn, resp, old = pad_batch(samples, engine.tokenizer.pad_token_id or 0)
        with torch.no_grad():
            new = token_logprobs(engine.model, ids.to(engine.model.device), attn.to(engine.model.device)).float().cpu()
        diff = (new[resp.bool()] - old[resp.bool()]).abs()
        print(json.dumps({"requests": n_prompts * 8, "slots": slots, "load_s": round(load_s, 2), "tokens": tokens,
                          "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds),
                          "logprob_absdiff_mean": float(diff.mean()), "logprob_absdiff_max": float(diff.max()),
                          "latency_profile": engine.latency_points}), flush=True)
        engine.close()


if __name__ == "__main__":
    main()
