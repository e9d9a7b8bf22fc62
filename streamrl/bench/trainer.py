"""``streamrl bench trainer RECIPE``: the recipe's trainer on synthetic batches, in this process.

It builds the trainer the recipe names (on ``streamrl.devices.worker_device()``: the GPU when this
process sees one), makes ``--samples`` samples of ``--prompt-tokens + --response-tokens`` random
token ids in groups of ``trainer.samples_per_prompt`` with rewards that give every group a
signal, cuts them into micro-batches by the recipe's token budget exactly as train tasks do,
and times forward/backward + optimizer step. It reports tokens/s, model FLOPs utilisation
(6 x parameters x tokens / s against the device's bf16 dense peak, when the device is known)
and peak memory (CUDA's allocator peak; on CPU the process's resident memory, model
included). Nothing here is distributed: it measures the trainer, not the dataflow.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from streamrl.errors import UserError
from streamrl.run import runner
from streamrl.on_worker.microbatch import group_tokens, pack
from streamrl.flow.placement import trainer_context
from streamrl.recipe.recipe import load_recipe
from streamrl.sample import Prompt, Sample

#: bf16 dense peak FLOP/s by device name fragment (vendor datasheets; no sparsity).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "4090": 165e12}


def peak_flops(device: str) -> tuple[str, float | None]:
    """``(device name, bf16 peak FLOP/s or None when unknown, e.g. a CPU)``."""
    import torch

    if device != "cuda":
        return "cpu", None
    name = torch.cuda.get_device_name()
    return name, next((v for k, v in PEAK_FLOPS.items() if k in name), None)


class RSSPeak:
    """The process's largest resident memory while it runs, sampled every 5 ms (on CPU there is no
    allocator statistic like CUDA's, and ``ru_maxrss`` never goes down between variants)."""

    def __init__(self):
        import psutil

        self.process, self.peak, self.done = psutil.Process(), 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.done.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            self.done.wait(0.005)

    def stop(self) -> int:
        """Stop sampling; the peak in bytes."""
        self.done.set()
        self.thread.join()
        return self.peak


def synthetic_groups(n_samples: int, per_group: int, prompt: int, response: int, vocab: int, seed: int = 0):
    """Groups of random-token samples; rewards alternate inside a group so advantages are not 0."""
    rng = random.Random(seed)
    groups = []
    for g in range(max(1, n_samples // per_group)):
        p = Prompt(uid=f"bench-{g}", text="", answer="")
        ids = [rng.randrange(3, vocab) for _ in range(prompt)]
        group = []
        for k in range(per_group):
            resp = [rng.randrange(3, vocab) for _ in range(response)]
            group.append(Sample(uid=f"bench-{g}-{k}", prompt=p, prompt_ids=ids, response_ids=resp,
                                logprobs=[-1.0] * response, reward=float(k % 2)))
        groups.append(group)
    return groups


def profile_step(trainer, groups, cuts, n: int, device: str, path: str) -> None:
    """One more optimizer step under ``torch.profiler``; its operators by device time (the GPU's
    when there is one) written to ``path`` as a table: where a step's time goes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for idx in cuts:
            trainer.micro_batch([groups[j] for j in idx], 1.0 / n)
        trainer.step()
        if device == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=70))


def measure(file: str, overrides: list[str], samples: int, prompt: int, response: int, steps: int, warmup: int,
            profile_out: str | None = None, resolved=None) -> dict:
    """Build the trainer and time ``warmup + steps`` optimizer steps on one synthetic batch
    (then, with ``profile_out``, profile one more step into that file). ``resolved``: the
    recipe with ``overrides`` resolved already."""
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    loaded = load_recipe(file, overrides) if resolved is None else resolved.loaded
    resolved = resolved or runner.resolve(loaded)
    r = loaded.recipe
    t = r.trainer
    trainer = resolved.trainer.build(trainer_context(resolved))
    held = trainer.footprint()
    device, params = held.device, held.parameters
    groups = synthetic_groups(samples, t.samples_per_prompt, prompt, response, held.vocab_size or 1000, r.run.seed)
    cuts = pack([group_tokens(g) for g in groups], t.micro_batch_tokens, t.groups_per_micro_batch)
    n = sum(len(g) for g in groups)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sampler = RSSPeak() if device != "cuda" else None
    seconds = []
    for i in range(warmup + steps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for idx in cuts:
            trainer.micro_batch([groups[j] for j in idx], 1.0 / n)
        trainer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            seconds.append(time.perf_counter() - t0)
    tokens = n * (prompt + response)
    name, peak = peak_flops(device)
    step_s = statistics.median(seconds)
    peak_mem = torch.cuda.max_memory_allocated() if device == "cuda" else sampler.stop()
    if profile_out:
        profile_step(trainer, groups, cuts, n, device, profile_out)
    return {"device": name, "trainer": r.trainer.name, "precision": held.precision,
            "parameters": params, "samples": n, "tokens_per_step": tokens, "micro_batches": len(cuts),
            "step_s_median": step_s, "tokens_per_s": tokens / step_s,
            "mfu": 6 * params * tokens / step_s / peak if peak else None,
            "peak_memory_gib": peak_mem / 2**30, "steps": seconds}


def bench(file: str, overrides: list[str], variants: list[str], samples: int, prompt: int, response: int,
          steps: int, warmup: int, out: str | None, profile_dir: str | None = None) -> list[dict]:
    """Measure each variant (``LABEL:KEY=VALUE;...``, as ``bench engine``), print, optionally write
    JSON; with ``profile_dir``, each variant's profiled step as ``trainer-profile-<label>.txt`` there."""
    from streamrl.bench.engine import parse_variant

    results = []
    parsed = [parse_variant(v) for v in variants] or [("recipe", [])]
    # Liger's kernels patch transformers' module classes for the whole process: a variant without
    # them measured after one with them would run them anyway, under its own label
    liger = None
    resolved = [runner.resolve(load_recipe(file, [*overrides, *extra])) for _, extra in parsed]  # (once each)
    for (label, _), each in zip(parsed, resolved):
        kernels = getattr(each.trainer.config, "kernels", "torch")
        if kernels == "liger":
            liger = liger or label
        elif liger is not None:
            raise UserError(f"bench trainer: variant {label!r} (trainer.kernels = {kernels!r}) comes after {liger!r} "
                            "(liger): Liger's kernels patch transformers' modules for the whole process, so it would "
                            "be measured with them; put the variants without them first")
    for (label, extra), each in zip(parsed, resolved):
        profile_out = None
        if profile_dir:
            Path(profile_dir).mkdir(parents=True, exist_ok=True)
            profile_out = str(Path(profile_dir) / f"trainer-profile-{label}.txt")
        row = measure(file, [*overrides, *extra], samples, prompt, response, steps, warmup, profile_out,
                      resolved=each)
        results.append({"variant": label, **row})
    table = Table(title=f"trainer, {file}: {samples} samples x {prompt}+{response} tokens per step")
    for col in ("variant", "device", "precision", "params", "micro-batches", "s/step", "tokens/s", "MFU", "peak GiB"):
        table.add_column(col)
    for r in results:
        table.add_row(r["variant"], r["device"], str(r["precision"]), f"{r['parameters'] / 1e6:.1f} M",
                      str(r["micro_batches"]), f"{r['step_s_median']:.3f}", f"{r['tokens_per_s']:,.0f}",
                      "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%", f"{r['peak_memory_gib']:.2f}")
    Console().print(table)
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=2)
    return results
