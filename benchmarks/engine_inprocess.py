"""The ``hf`` engine's slot decoder driven in-process (no Dask), and where a decode step's time
goes: the engine's generated tokens/s at each request count, the decoder's own step alone, the
step with the finished-flags read the engine's loop does after each one, a torch.profiler table
and trace of those steps, and the engine's log-probs against a forward of the same model.

    python benchmarks/engine_inprocess.py MODEL --device cuda --requests 64,256,512,1024 \\
        --new-tokens 256 --kernels liger --finished-every 8 --profile-dir prof --out inprocess.json
    python benchmarks/engine_inprocess.py MODEL --device cpu --requests 16 --new-tokens 8   # this CPU

What ``streamrl bench engine`` measures through a cluster, less the generate tasks and Dask
around it: the difference between the two is what the dataflow costs. Per request count N
(N / 8 prompts x 8 samples, ``engine.slots = N``, end-of-sequence off so every response is
``--new-tokens`` long), one JSON row:

- ``tokens_per_s`` and ``ms_per_step``: the engine (its loop thread, admission, prefill, hand
  back), a warm group of requests first (graph capture, the allocator), then the timed one;
- ``decoder_step_ms``: the decoder's step alone, ``--steps`` of them back to back with one wait
  for the device at the end (a CUDA graph's replay each on a GPU): the pace the hardware gives
  this decoder;
- ``decoder_step_sync_ms``: the same steps, each followed by the read of the finished flags
  (one small device-to-host copy, which waits for the step) as the engine's loop does: the
  difference to the above is what that wait costs; the rest, up to ``ms_per_step``, is the
  engine's own work between steps (Python, prefill, hand-back);
- ``kv_cache_bytes``: the memory the decoder's KV cache takes at this slot count;
  ``decoder_build_s``: seconds to build the decoder (its cache, and on a GPU its graphs);
- ``prefill_ms_group`` / ``prefill_ms_all``: one prefill as the decoder does it (from its
  captured graphs on a GPU, ``engine.prefill_graphs``) of one group (1 prompt x 8 samples) and of
  every slot (N / 8 prompts x 8), against the eager prefill (``prefill_eager_ms_*``); the
  graphs' buckets, their staging memory, and on a GPU the memory a second set of them reserves
  (staging and graphs, ``prefill_graph_memory_bytes``);
- ``fused_sampling``: whether the decoder sampled with the fused kernels (``engine.fused_sampling``,
  a GPU with Triton; ``--torch-sampling`` turns them off); if so, ``decoder_step_torch_sampling_ms``
  is the step of a decoder sampling with torch ops instead, and the first row's
  ``sampling_check`` a chi-square of the kernels' draws on this GPU against the softmax;
- ``finished_every``: the engine's ``engine.finished_every`` (``--finished-every``): how many
  steps its loop queues between two looks for ended requests;
- ``logprob_absdiff_mean`` / ``_max``: the engine's log-probs against a forward of the model;
- ``engine_spans_ms``: where the engine's loop spent the timed call (:class:`Spans`): its calls
  into the decoder (the flags' reads wait for the device), its own Python between them, and
  the time before its first call and after its last.

With ``--profile-dir``, the synced steps at ``--profile-at`` requests (default: the count
nearest 256) also run under torch.profiler: ``decode-profile-N.txt`` (operators by their own
device time, or CPU time on a CPU) and ``decode-trace-N.json.gz`` (the Chrome / Perfetto trace).
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from streamrl.engines.hf import HFEngine, HFEngineConfig  # noqa: E402
from streamrl.engines.slot_decoder import SlotDecoder  # noqa: E402
from streamrl.sample import Prompt  # noqa: E402
from streamrl.training.logprobs import pad_batch, token_logprobs  # noqa: E402

#: Prompt tokens a slot holds room for (the prompts are short sums).
PROMPT_TOKENS = 64


def sync(device: str) -> None:
    """Wait for the device's queued work (nothing to wait for on a CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()


def decoder_pace(engine, requests: int, new_tokens: int, steps: int, device: str, profile: Path | None) -> dict:
    """The decoder's step alone and with the finished-flags read, on a decoder of its own over
    the engine's model (the engine's loop keeps its decoder); ``steps`` steps each way. Where the
    engine samples with the fused kernels, also the step of a decoder sampling with torch ops."""
    out = pace(engine, requests, new_tokens, steps, device, profile, engine.config.fused_sampling)
    if out["fused_sampling"]:
        torch.cuda.empty_cache()  # (the first decoder's KV cache and graphs, gone with its call)
        torch_ops = pace(engine, requests, new_tokens, steps, device, None, False)
        out["decoder_step_torch_sampling_ms"] = torch_ops["decoder_step_ms"]
    return out


def pace(engine, requests: int, new_tokens: int, steps: int, device: str, profile: Path | None,
         fused: bool) -> dict:
    """:func:`decoder_pace` of one decoder (``fused``: its sampling kernels if it can)."""
    t0 = time.perf_counter()
    decoder = SlotDecoder(engine.model, requests, PROMPT_TOKENS + new_tokens, new_tokens,
                          engine.config.temperature, (), graphs=engine.config.cuda_graph and device == "cuda",
                          fused=fused, prefill_graphs=engine.config.prefill_graphs)
    sync(device)
    built_s = time.perf_counter() - t0
    ids = engine.tokenizer("12+34=")["input_ids"]
    steps = min(steps, new_tokens - 1)  # (a slot stops at new_tokens)
    b = decoder.size_for(requests - 1)
    out = {"kv_cache_bytes": sum(t.numel() * t.element_size() for t in decoder.k_cache + decoder.v_cache),
           "decoder_build_s": round(built_s, 2),
           "fused_sampling": decoder.fused, **({"fused_error": decoder.fused_error} if decoder.fused_error else {}),
           **prefill_pace(decoder, ids, requests, new_tokens, device)}

    def run(read_flags: bool) -> float:
        decoder.reset()
        decoder.prefill([(s, ids, new_tokens, False) for s in range(requests)])
        sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            decoder.step(b)
            if read_flags:
                decoder.finished_slots(b)
        sync(device)
        return (time.perf_counter() - t0) / steps * 1e3

    run(False)  # warm (the allocator, cuBLAS)
    out["decoder_step_ms"] = round(run(False), 3)
    out["decoder_step_sync_ms"] = round(run(True), 3)
    if profile is not None:
        from torch.profiler import ProfilerActivity, profile as profiler

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profiler(activities=activities) as prof:
            run(True)
        key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
        profile.mkdir(parents=True, exist_ok=True)
        (profile / f"decode-profile-{requests}.txt").write_text(
            f"{steps} decode steps at {requests} requests, each followed by the finished-flags read\n"
            + prof.key_averages().table(sort_by=key, row_limit=40))
        raw = profile / f"decode-trace-{requests}.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
        out["profile"] = str(profile / f"decode-profile-{requests}.txt")
    return out


def prefill_pace(decoder, ids: list[int], requests: int, new_tokens: int, device: str, repeats: int = 5) -> dict:
    """Milliseconds of one prefill (median of ``repeats``, waited for) as the decoder does it
    (``prefill_ms``: from its captured graphs where it has them) and eagerly (``prefill_eager_ms``),
    at two admissions: one group (1 prompt x 8 samples) and every slot (N / 8 distinct prompts x 8);
    and the prefill graphs' buckets and staging memory."""
    from streamrl.engines.slot_prefill import PromptForward

    def timed(prompts: int) -> float:
        starts = [(s, ids + [s // 8 + 1], new_tokens, False) for s in range(min(requests, prompts * 8))]
        times = []
        for _ in range(repeats):
            decoder.reset()
            sync(device)
            t0 = time.perf_counter()
            decoder.prefill(starts)
            sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
        decoder.reset()
        return round(sorted(times)[len(times) // 2], 3)

    built = decoder.prompts
    out = {"prefill_graphs": built.graphs, "prefill_buckets": len(built.buckets),
           "prefill_staging_bytes": sum(t.numel() * t.element_size()
                                        for t in getattr(built, "_k", []) + getattr(built, "_v", []))
           + (built._hidden.numel() * built._hidden.element_size() if built.static else 0),
           **({"prefill_error": built.error} if built.error else {})}
    for name, prompts in (("group", 1), ("all", max(1, requests // 8))):
        out[f"prefill_ms_{name}"] = timed(prompts)
    if built.graphs:  # what a second set of them takes on the device: staging and the graphs' pool
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        again = PromptForward(decoder, static=True, graphs=True)
        torch.cuda.synchronize()
        out["prefill_graph_memory_bytes"] = torch.cuda.memory_reserved() - before
        del again
    decoder.prompts = PromptForward(decoder, static=False, graphs=False)
    try:
        for name, prompts in (("group", 1), ("all", max(1, requests // 8))):
            out[f"prefill_eager_ms_{name}"] = timed(prompts)
    finally:
        decoder.prompts = built
    return out


def sampling_check(vocab: int, temperature: float, rows: int = 8192, device: str = "cuda") -> dict:
    """The fused kernels' draws on this GPU against ``softmax(logits / T)``: ``rows`` draws of
    one row of logits (a peaked one, so its top tokens are drawn often), a chi-square over its
    ten likeliest tokens and the rest (10 degrees of freedom: above 29.6 happens by chance once
    in a thousand), and the log-probs against torch's log-softmax."""
    from streamrl.engines import fused_sampling

    g = torch.Generator().manual_seed(0)
    row = (torch.randn(vocab, generator=g) * 4).to(torch.bfloat16).to(device)
    logits = row.expand(rows, vocab).contiguous()
    tok, lp = fused_sampling.sample(logits, torch.zeros(rows, dtype=torch.bool, device=device), temperature,
                                    fused_sampling.new_seed(device))
    ref = torch.log_softmax(row.float() / temperature, -1)
    top = ref.topk(10).indices
    want = torch.cat([ref[top].exp(), 1 - ref[top].exp().sum()[None]]) * rows
    got = torch.stack([(tok == t).sum() for t in top] + [(~torch.isin(tok, top)).sum()]).float()
    chi2 = float(((got - want) ** 2 / want.clamp(min=1e-9)).sum())
    return {"chi2_top10": round(chi2, 2), "draws": rows, "top_share": round(float(got[0] / rows), 4),
            "top_p": round(float(want[0] / rows), 4),
            "logprob_absdiff_max": float((ref[tok] - lp).abs().max())}


class Spans:
    """Where the engine's loop thread spent the timed call, from wrappers on its decoder: each
    call's own seconds (``step`` queues a graph replay and returns; ``finished_slots`` waits for
    the device, so its seconds are the device's lead over the loop), and the time before the
    first prefill (the caller's tokenizing and queueing) and after the last release (the
    samples built and handed back)."""

    CALLS = ("prefill", "step", "finished_slots", "release")

    def __init__(self, decoder):
        self.decoder, self.real = decoder, {}
        self.seconds = dict.fromkeys(self.CALLS, 0.0)
        self.count = dict.fromkeys(self.CALLS, 0)
        self.first = self.last = None
        for name in self.CALLS:
            self.real[name] = real = getattr(decoder, name)
            setattr(decoder, name, self._timed(name, real))

    def _timed(self, name, real):
        def call(*args, **kwargs):
            t = time.time()
            try:
                return real(*args, **kwargs)
            finally:
                end = time.time()
                self.seconds[name] += end - t
                self.count[name] += 1
                self.first = t if self.first is None else self.first
                self.last = end
        return call

    def undo(self) -> None:
        """Take the wrappers off (the decoder's own methods again)."""
        for name in self.CALLS:
            delattr(self.decoder, name)

    def summary(self, start: float, end: float) -> dict:
        """Milliseconds of each part, and the calls' counts."""
        out = {f"{k}_ms": round(v * 1e3, 2) for k, v in self.seconds.items()}
        out.update({f"{k}_calls": v for k, v in self.count.items()})
        if self.first is not None:
            out["before_first_call_ms"] = round((self.first - start) * 1e3, 2)
            out["after_last_call_ms"] = round((end - self.last) * 1e3, 2)
            out["loop_other_ms"] = round((self.last - self.first - sum(self.seconds.values())) * 1e3, 2)
        return out


def measure(model: str, requests: int, new_tokens: int, steps: int, device: str, profile: Path | None,
            finished_every: int = 1, fused_sampling: bool = True, kernels: str = "torch") -> dict:
    """One request count's row (see the module docstring)."""
    n_prompts = max(1, requests // 8)
    engine = HFEngine(HFEngineConfig(max_new_tokens=new_tokens, batching="slots", slots=n_prompts * 8,
                                     max_prompt_tokens=PROMPT_TOKENS, profile=False, finished_every=finished_every,
                                     fused_sampling=fused_sampling, kernels=kernels))
    t0 = time.time()
    engine.load(model, device=device)
    load_s = time.time() - t0
    try:
        engine.decoder.stop_ids.fill_(-1)  # every response decodes new_tokens tokens
        prompts = [Prompt(uid=f"p{i}", text=f"{i}+{i * 3}=", answer="") for i in range(n_prompts)]
        engine.generate_groups(prompts, 8, [0.0] * n_prompts)  # warm
        spans = Spans(engine.decoder)
        t0 = time.time()
        groups = engine.generate_groups(prompts, 8, [0.0] * n_prompts)
        seconds = time.time() - t0
        spans.undo()
        tokens = sum(len(s.response_ids) for g in groups for s in g)
        samples = [g[0] for g in groups[:4]]
        ids, attn, resp, old = pad_batch(samples, engine.tokenizer.pad_token_id or 0)
        with torch.no_grad():
            new = token_logprobs(engine.model, ids.to(engine.model.device), attn.to(engine.model.device)).float().cpu()
        diff = (new[resp.bool()] - old[resp.bool()]).abs()
        row = {"requests": n_prompts * 8, "device": device, "new_tokens": new_tokens, "load_s": round(load_s, 2),
               "finished_every": finished_every, "kernels": kernels,
               "tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds),
               "ms_per_step": round(seconds / new_tokens * 1e3, 3),
               "logprob_absdiff_mean": float(diff.mean()), "logprob_absdiff_max": float(diff.max()),
               "engine_spans_ms": spans.summary(t0, t0 + seconds)}
        row.update(decoder_pace(engine, n_prompts * 8, new_tokens, steps, device, profile))
        return row
    finally:
        engine.close()


def main() -> int:
    """Measure each request count, print a JSON line for each, write them all to ``--out``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a model folder (from_pretrained)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--requests", default="256,64", help="comma-separated request counts (each a multiple of 8)")
    ap.add_argument("--new-tokens", type=int, default=256, help="tokens each response decodes")
    ap.add_argument("--steps", type=int, default=100, help="decoder steps timed each way")
    ap.add_argument("--profile-dir", help="write the profiler table and trace here")
    ap.add_argument("--profile-at", type=int, help="the request count profiled (default: the one nearest 256)")
    ap.add_argument("--finished-every", type=int, default=1,
                    help="the engine's engine.finished_every: look for ended requests every this many steps")
    ap.add_argument("--torch-sampling", action="store_true",
                    help="the engine samples with torch ops (engine.fused_sampling = false)")
    ap.add_argument("--kernels", default="torch", choices=["torch", "liger"],
                    help="the engine's engine.kernels (liger: Liger's fused RMSNorm, SwiGLU and rotary; a GPU)")
    ap.add_argument("--out", help="write the rows as a JSON list here")
    args = ap.parse_args()
    counts = [int(x) for x in args.requests.split(",") if x.strip()]
    at = args.profile_at or min(counts, key=lambda n: abs(n - 256))
    rows = []
    for n in counts:
        profile = Path(args.profile_dir) if args.profile_dir and n == at else None
        row = measure(args.model, n, args.new_tokens, args.steps, args.device, profile, args.finished_every,
                      not args.torch_sampling, args.kernels)
        if row["fused_sampling"] and n == counts[0]:
            vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
            row["sampling_check"] = sampling_check(vocab, temperature=1.0)
        print(json.dumps(row), flush=True)
        rows.append(row)
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
