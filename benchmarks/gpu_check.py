"""Check the whole GPU path in one command and write one JSON plus a table.

    python benchmarks/gpu_check.py --out gpu-check.json            # on a GPU machine
    python benchmarks/gpu_check.py --device cpu --small --out x.json   # dry run on CPU

It runs, each as its own process with its own time limit (a failure or an out-of-memory in one
is recorded and the next goes on; the JSON is rewritten after each, so a check stopped from
outside still leaves what it measured), by default:

1. ``model``: ``streamrl model init --arch qwen2.5-0.5b --random`` (bfloat16 weights);
2. ``engine``: ``streamrl bench engine`` at 256 and 64 concurrent requests (prompts x 8 samples)
   of 256 new tokens: the slot decoder (one CUDA graph per decode step) and transformers'
   continuous batching with CUDA graphs, side by side in one process per request count;
3. ``recipe``: ``streamrl recipe run recipes/gpu-0.5b.toml`` for a few steps, generation and
   training on the one GPU; from its ``metrics.jsonl``: seconds per step, tokens/s, and the
   weight publication's share of a step (``weight_sync_s / step_s``);
4. ``transfer``: ``streamrl bench transfer`` with ``cuda_ipc`` and ``dask`` (seconds and GB/s of
   one publication GPU -> engine);
5. ``lora``: ``benchmarks/adapter_decode.py``: the slot decoder with 8 LoRA adapters mixed in
   one batch (and with one) against the base alone at 256 requests, and one adapter's hand-over
   (bytes against the model's, seconds to load it into the engine);
6. ``head``: the output head + log-softmax alone (``benchmarks/head_logprobs.py``), each way the
   trainer can run it, with their differences;
7. ``trainer``: ``streamrl bench trainer`` at 64 samples x 576 tokens (tokens/s, MFU, peak
   memory): the recipe, without Liger's kernels, and without them with the head of before, and a
   torch.profiler table of one step of each.

Named in ``--phases`` only:

- ``recipe_baseline``: the recipe with the engine and transfer it had before (continuous
  batching, the ``dask`` transfer);
- ``factory``: the recipe for two steps on a ``dask_cuda.LocalCUDACluster``, every pool on GPU 0;
- ``longtail``: W2 (``recipes/longtail-cpu.toml``) on two slot-decoder instances sharing the GPU,
  ``streamrl bench skew``'s ``fcfs`` against the ``longtail`` scheduler with and without moving
  stragglers;
- ``inprocess``: ``benchmarks/engine_inprocess.py`` at 64, 256, 512 and 1,024 requests, the slot
  engine without Dask, its decoder's step alone and with the finished-flags read, the KV cache's
  size, a torch.profiler table and trace of the decode steps at 256; once more for each further
  ``--finished-every`` value (``inprocess-finished-every-K``: the engine's loop looking for ended
  requests every K steps), or each ``--inprocess-run`` (the script's flags for one run, e.g.
  ``--kernels liger --finished-every 8``);
- ``anchor``: a decode-bound probe script given with ``--anchor``, at the same request counts, so
  that the engine's figures and the bound are measured in one call;
- ``serve``: ``streamrl bench serve recipes/serve.toml`` on the model's shapes, engine and trainer
  on the one GPU, inter-token latency with learning on against off (goal <= 1.05x)::

    python benchmarks/gpu_check.py --out x.json --phases inprocess,anchor,engine,serve --anchor PROBE.py

On an H100 the phases took: model 32-48 s, engine 43 + 92 s, recipe 56 s, transfer about 90 s,
head 32 s, trainer about 20 s a variant: about 7 minutes for the default phases.
``--budget-s`` and the per-phase timeouts keep a lent machine's call short.

``--small`` shrinks the model and every size so that the same phases run in minutes on a CPU:
the dry run that makes time on the GPU machine go to measuring, not debugging. ``--budget-s``
stops starting phases once that many seconds have passed.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPE = str(ROOT / "recipes" / "gpu-0.5b.toml")

#: ``--small``: a 2-layer model, and sizes a 2-core CPU gets through. Its vocabulary is 4,096, not
#: Qwen's 151,936: every phase runs the same code at either size, and at the full size the output
#: head and the sampling over it took about 40% of the dry run's CPU (docs/benchmarks.md).
SMALL_MODEL = ["vocab_size=4096", "num_hidden_layers=2", "hidden_size=64", "intermediate_size=128",
               "num_attention_heads=4", "num_key_value_heads=2"]


def device_overrides(device: str) -> list[str]:
    """Recipe overrides putting both pools on ``device`` (the recipe pins them to GPU 0)."""
    if device == "cuda":
        return []
    return ["pools.generate.device=\"cpu\"", "pools.train.device=\"cpu\"", "trainer.kernels=\"torch\"",
            "engine.kernels=\"torch\"",
            "pools.generate.cuda_visible_devices=[]", "pools.train.cuda_visible_devices=[]",
            "engine.max_batch_tokens=256", "pools.generate.threads=8"]


def sizes(small: bool) -> dict:
    """Every size the check uses: the GPU targets, or a CPU dry run's."""
    if small:
        return dict(recipe_steps=2, recipe=["trainer.prompts_per_step=2", "trainer.samples_per_prompt=2",
                                            "engine.max_new_tokens=8"],
                    engine=["trainer.prompts_per_step=2", "trainer.samples_per_prompt=4", "engine.max_new_tokens=8"],
                    engine_steps=1, trainer_samples=[4, 8], trainer_prompt=8, trainer_response=24, trainer_steps=2,
                    transfer_repeats=1, engine_requests=[8, 4], inprocess_requests=[8, 16])
    return dict(recipe_steps=10, recipe=[],
                engine=["trainer.prompts_per_step=32", "trainer.samples_per_prompt=8", "engine.max_new_tokens=256"],
                engine_steps=1, trainer_samples=[64], trainer_prompt=64, trainer_response=512, trainer_steps=3,
                transfer_repeats=3, engine_requests=[256, 64], inprocess_requests=[64, 256, 512, 1024])


#: The recipe's engine and transfer before the slot decoder and the CUDA IPC hand-over: the
#: baseline each is measured against in the same call.
BASELINE = ['engine.batching="continuous"', "engine.finished_every=1", "engine.max_batch_tokens=8192",
            "engine.kv_memory_fraction=0.3", 'transfer.name="dask"']


def streamrl(*args: str) -> list[str]:
    """The command line of ``python -m streamrl ARGS``."""
    return [sys.executable, "-m", "streamrl", *args]


def sets(overrides: list[str]) -> list[str]:
    """``--set`` flags for each override."""
    return [x for o in overrides for x in ("--set", o)]


#: What the phases import, beyond torch (and Liger's kernels on a GPU: the recipe's
#: ``kernels = "liger"``). A GPU machine's own Python had older ones of some -- transformers that
#: needs a newer huggingface-hub, a ``typing_extensions`` without what FastAPI imports, no
#: ``httptools`` for the endpoint -- and each showed as a phase failing seconds in, one by one.
NEEDED = ("transformers", "huggingface_hub", "tokenizers", "safetensors", "dask", "distributed", "pydantic",
          "pluggy", "rich", "fastapi", "uvicorn", "httptools", "openai")


def missing_packages(names: tuple[str, ...] = NEEDED) -> list[str]:
    """The modules among ``names`` this Python cannot import, each with its error's first line."""
    import importlib

    missing = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 -- an import that fails any way is missing here
            missing.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return missing


class Check:
    """Runs the phases, keeps their results and rewrites ``out`` after each."""

    def __init__(self, args):
        self.args, self.work = args, Path(args.work).resolve()
        self.work.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.result = {"device": args.device, "small": args.small, "host": platform.node(),
                       "python": platform.python_version(), "phases": {}}

    def save(self) -> None:
        """Write what is known so far (atomically: a killed check leaves a whole file)."""
        tmp = Path(self.args.out).with_suffix(".tmp")
        tmp.write_text(json.dumps(self.result, indent=2))
        os.replace(tmp, self.args.out)

    def run(self, name: str, cmd: list[str], timeout: float, outputs: tuple[Path, ...] = ()) -> dict:
        """Run one phase's command with a time limit; its exit status, seconds and log's tail.
        ``outputs``: the files (or folders) it writes, removed first, so that a phase that fails,
        runs out of time or is skipped leaves nothing of an earlier call for its figures. The
        whole process group goes when it ends (a timed-out phase's cluster, workers and
        endpoint kept the GPU and their ports through the later phases)."""
        for path in outputs:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        left = self.args.budget_s - (time.monotonic() - self.t0)
        if left < 20:
            row = {"ok": False, "skipped": f"budget spent ({self.args.budget_s:.0f} s)"}
            self.result["phases"][name] = row
            self.save()
            return row
        log = self.work / f"{name}.log"
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        t0 = time.monotonic()
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
            try:
                rc = proc.wait(timeout=min(timeout, left))
            except subprocess.TimeoutExpired:
                rc = "timeout"
            finally:
                try:  # (its own session: the phase's every process, whatever it left running)
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
        text = log.read_text(errors="replace")
        row = {"ok": rc == 0, "rc": rc, "seconds": round(time.monotonic() - t0, 1),
               "log_tail": text[-3000:] if rc != 0 else text[-1200:]}
        print(text[-2500:], flush=True)
        self.result["phases"][name] = row
        self.save()
        return row

    def env(self) -> None:
        """torch, CUDA and the device, as this process sees them, and what the phases need that
        this machine's Python lacks (``missing``: the check stops before any phase runs)."""
        import torch

        row = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available()}
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            row.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count)
        try:
            import transformers

            row["transformers"] = transformers.__version__
        except ImportError as exc:
            row["transformers"] = f"missing: {exc}"
        row["missing"] = missing_packages(NEEDED + (("liger_kernel",) if self.args.device == "cuda" else ()))
        self.result["env"] = row
        self.save()

    def model(self) -> str:
        """The random Qwen2.5-0.5B-shaped model folder."""
        path = self.work / "qwen2.5-0.5b-random"
        if (path / "config.json").exists():  # made by an earlier call on this machine
            self.result["phases"]["model"] = {"ok": True, "seconds": 0, "reused": str(path)}
            return str(path)
        extra = sets(SMALL_MODEL) if self.args.small else []
        self.run("model", streamrl("model", "init", "--arch", "qwen2.5-0.5b", "--random", "--dtype", "bfloat16",
                                   "--init-device", self.args.device, "--out", str(path), *extra), 300)
        return str(path)

    def recipe(self, model: str, name: str = "recipe", extra: tuple[str, ...] = ()) -> None:
        """``recipe run`` for a few steps; per-step figures from the run folder's metrics."""
        s = sizes(self.args.small)
        runs = self.work / f"runs-{name}"
        over = [f"model.path=\"{model}\"", f"run.steps={s['recipe_steps']}", f"run.out_dir=\"{runs}\"",
                "run.checkpoint_every=0", "cluster.dashboard_port=0",
                *device_overrides(self.args.device), *s["recipe"], *extra]
        row = self.run(name, streamrl("recipe", "run", RECIPE, "--plain", "--no-report", *sets(over)),
                       self.args.recipe_timeout, outputs=(runs,))
        found = sorted(glob.glob(str(runs / "*" / "metrics.jsonl")), key=os.path.getmtime)
        if not found:
            return
        recs = [json.loads(line) for line in open(found[-1]) if line.strip()]
        recs = [r for r in recs if "step_s" in r]
        row["steps"] = [{k: r.get(k) for k in ("step", "step_s", "generate_s", "train_s", "weight_sync_s",
                                               "tokens_per_s", "samples_per_s", "response_len_mean")} for r in recs]
        later = recs[1:] or recs  # the first step carries start-up (CUDA graphs, allocator)
        if later:
            step = sum(r["step_s"] for r in later)
            # (the mean, not the median: with run.max_staleness = k the steps after the first
            # come in runs of short ones, their samples decoded ahead, and one that waits)
            row["later_mean_s"] = step / len(later)
            row["weight_sync_share"] = sum(r["weight_sync_s"] for r in later) / step if step else None
            # (tokens over seconds, not the mean of each step's rate: a run of short steps whose
            # samples were decoded ahead would count each as fast)
            tokens = sum(r["tokens_per_s"] * r["step_s"] for r in later if r.get("tokens_per_s") is not None)
            row["tokens_per_s"] = tokens / step if step else None
        self.save()

    def recipe_baseline(self, model: str) -> None:
        """The recipe with the engine and transfer it had before (:data:`BASELINE`)."""
        self.recipe(model, "recipe-baseline", tuple(o for o in BASELINE if self.args.device == "cuda"
                                                    or "kv_memory" not in o and "max_batch" not in o))

    def factory(self, model: str) -> None:
        """The recipe on a cluster made by ``dask_cuda.LocalCUDACluster`` (``distributed.LocalCluster``
        on CPU), every pool on GPU 0: streamrl labels the library's workers."""
        factory = "dask_cuda.LocalCUDACluster" if self.args.device == "cuda" else "distributed.LocalCluster"
        options = ('{CUDA_VISIBLE_DEVICES="0", host="127.0.0.1", dashboard_address="127.0.0.1:0"}'
                   if self.args.device == "cuda" else '{host="127.0.0.1", dashboard_address="127.0.0.1:0"}')
        gpus = ['pools.reward.cuda_visible_devices=["0"]'] if self.args.device == "cuda" else []
        self.recipe(model, "factory", (f'cluster.factory="{factory}"', f"cluster.factory_options={options}", *gpus,
                                       "run.steps=2"))

    def engine(self, model: str) -> None:
        """``bench engine`` at each request count: the slot decoder and transformers' continuous
        batching (both with CUDA graphs on a GPU), in one process per count so their ratio is
        measured in one run; a count that fails or runs out of time keeps the others' figures."""
        s = sizes(self.args.small)
        over = [f"model.path=\"{model}\"", *device_overrides(self.args.device), *s["engine"]]
        continuous = 'engine.batching="continuous";engine.finished_every=1;engine.cuda_graph=true'
        if self.args.device == "cuda":
            continuous += ";engine.max_batch_tokens=8192;engine.kv_memory_fraction=0.3"
        for n in self.args.engine_requests or s["engine_requests"]:
            prompts = max(1, n // 8)
            variants = [f'slots:engine.batching="slots";engine.slots={prompts * 8};engine.max_prompt_tokens=64',
                        f"continuous-graphs:{continuous}"]
            variants = [v for v in variants if v.split(":")[0] in (self.args.engine_batching or ["slots",
                                                                                                 "continuous-graphs"])]
            out = self.work / f"engine-{n}.json"
            row = self.run(f"engine-{n}", streamrl("bench", "engine", RECIPE, *sets(over),
                                                   *sets([f"trainer.prompts_per_step={prompts}",
                                                          "trainer.samples_per_prompt=8"]),
                                                   *[x for v in variants for x in ("--variant", v)],
                                                   "--steps", str(s["engine_steps"]), "--warmup", "1",
                                                   "--out", str(out)), 2 * self.args.engine_timeout, outputs=(out,))
            if out.exists():
                row["variants"] = [{k: v for k, v in r.items() if k != "steps"} for r in json.loads(out.read_text())]
                self.save()

    def trainer(self, model: str) -> None:
        """``bench trainer`` at each batch size; variants and a profile at the largest."""
        s = sizes(self.args.small)
        over = [f"model.path=\"{model}\"", *device_overrides(self.args.device)]
        rows = []
        for n in self.args.trainer_samples or s["trainer_samples"]:
            out = self.work / f"trainer-{n}.json"
            variants = []
            extra = []
            if n == max(self.args.trainer_samples or s["trainer_samples"]):
                # Liger's kernels patch transformers' modules for the whole process: the variants
                # without them run first
                variants = self.args.trainer_variant or [
                    "torch-kernels:trainer.kernels=\"torch\"",
                    "torch-kernels+checkpointed-head:trainer.kernels=\"torch\";trainer.logprob_kernels=\"checkpointed\"",
                    "recipe"]
                extra = ["--profile-dir", str(self.work)]
            row = self.run(f"trainer-{n}", streamrl("bench", "trainer", RECIPE, *sets(over),
                                                    *[x for v in variants for x in ("--variant", v)],
                                                    "--samples", str(n), "--prompt-tokens", str(s["trainer_prompt"]),
                                                    "--response-tokens", str(s["trainer_response"]),
                                                    "--steps", str(s["trainer_steps"]), "--warmup", "1",
                                                    "--out", str(out), *extra),
                           self.args.trainer_timeout,
                           outputs=(out, *(self.work.glob("trainer-profile-*.txt") if extra else ())))
            if out.exists():
                row["variants"] = [{k: v for k, v in r.items() if k != "steps"} for r in json.loads(out.read_text())]
                rows.extend(row["variants"])
            self.save()
        profiles = sorted(self.work.glob("trainer-profile-*.txt"))
        if profiles:
            self.result["trainer_profile"] = {p.stem: p.read_text()[:6000] for p in profiles}
            self.save()

    def head(self, model: str) -> None:
        """``benchmarks/head_logprobs.py``: the output head + log-softmax alone, each way."""
        small = self.args.small
        out = self.work / "head.json"
        s = sizes(small)
        tokens = s["trainer_samples"][-1] * s["trainer_response"]
        cmd = [sys.executable, str(ROOT / "benchmarks" / "head_logprobs.py"), "--device", self.args.device,
               "--tokens", str(tokens), "--out", str(out), "--big-chunk", "4096", "--big-chunk", "8192"]
        if small:
            cmd += ["--hidden", "64", "--dtype", "float32", "--repeats", "1"]
        row = self.run("head", cmd, self.args.trainer_timeout, outputs=(out,))
        if out.exists():
            row["ways"] = json.loads(out.read_text())
            self.save()

    def longtail(self, model: str) -> None:
        """W2 on the GPU engine: ``bench skew recipes/longtail-cpu.toml`` (countdown, lengths set
        by the prompt with a long tail) with two slot-decoder instances sharing the GPU, so
        ``fcfs`` and the ``longtail`` scheduler with and without moving stragglers run side by
        side. Three of the bench's six variants (``--variants``), 3 measured steps after 2 of
        warm-up (the learned ranker's), within 4 minutes: on a GPU each variant starts a cluster
        of its own (its engine captures its graphs again), and all six for 5 steps did not finish
        in 239 s on an H200. Its model (``model init --task countdown``, warm-started) is made
        here; ``model`` is unused."""
        small = self.args.small
        path = self.work / "tiny-countdown"
        if not (path / "config.json").exists():
            self.run("longtail-model", streamrl("model", "init", "--task", "countdown", "--out", str(path),
                                                "--warmstart-steps", "20" if small else "120"), 600)
        gpu = ([f'pools.{p}.device="cuda"' for p in ("generate", "train")]
               + [f'pools.{p}.cuda_visible_devices=["0"]' for p in ("generate", "train")]
               if self.args.device == "cuda" else [])
        prompts = 4 if small else 32
        # 32 task threads an instance: chunks of 4 then run as many requests at once as fcfs's whole
        # groups do (128). With the recipe's 16, chunks ran half as many, and on the CPU slot
        # decoder that alone made a 1.5x "gain" (fcfs with max_running = 64 matched it)
        over = [f"model.path=\"{path}\"", 'engine.batching="slots"', f"engine.slots={16 * 8}",
                "engine.max_prompt_tokens=32", f"engine.cuda_graph={'true' if self.args.device == 'cuda' else 'false'}",
                f"trainer.prompts_per_step={prompts}", "pools.generate.threads=32", "cluster.dashboard_port=0", *gpu]
        out = self.work / "longtail.json"
        steps, warmup = ("2", "1") if small else ("3", "2")
        row = self.run("longtail", streamrl("bench", "skew", str(ROOT / "recipes" / "longtail-cpu.toml"), *sets(over),
                                            "--variants", "fcfs,longtail-learned,longtail-learned +moves",
                                            "--steps", steps, "--warmup", warmup, "--out", str(out)),
                       self.args.longtail_timeout, outputs=(out,))
        if out.exists():
            found = json.loads(out.read_text())["variants"]
            row["skew"] = {name: {k: r.get(k) for k in ("generate_makespan_s", "speedup_generate", "samples_per_s",
                                                         "speedup_end_to_end", "moves/moved", "ranker_recall")}
                           for name, r in found.items()}
            self.save()

    def lora(self, model: str) -> None:
        """``benchmarks/adapter_decode.py``: the slot engine decoding with 8 LoRA adapters mixed in
        one batch (and with one) against the base model alone, and one adapter's hand-over."""
        small = self.args.small
        out = self.work / "lora.json"
        cmd = [sys.executable, str(ROOT / "benchmarks" / "adapter_decode.py"), model, "--device", self.args.device,
               "--requests", "8" if small else "256", "--tokens", "16" if small else "128",
               "--repeats", "1" if small else "3", "--out", str(out)]
        row = self.run("lora", cmd, self.args.engine_timeout * 2, outputs=(out,))
        if out.exists():
            found = json.loads(out.read_text())
            row["result"] = {k: v for k, v in found.items() if k != "all"}
            self.save()

    def inprocess(self, model: str) -> None:
        """``benchmarks/engine_inprocess.py``: the slot engine driven in this machine's process (no
        Dask) at each ``--inprocess-requests`` count, its decoder's step alone and with the
        finished-flags read after each, the KV cache's size, and a torch.profiler table and trace
        of the steps at 256 requests (kept in the work folder)."""
        small = self.args.small
        counts = self.args.inprocess_requests or sizes(small)["inprocess_requests"]
        runs = ([r.split() for r in self.args.inprocess_run]
                or [["--finished-every", str(k)] for k in self.args.finished_every or [1]])
        for i, extra in enumerate(runs):
            # (each run its own rows; the first one's name is the phase's, the others' say their flags)
            name = "inprocess" if i == 0 else "inprocess-" + "-".join(x.lstrip("-") for x in extra)
            out = self.work / f"{name}.json"
            cmd = [sys.executable, str(ROOT / "benchmarks" / "engine_inprocess.py"), model, "--device",
                   self.args.device, "--requests", ",".join(map(str, counts)), "--new-tokens", "8" if small else "256",
                   "--steps", "4" if small else "100", *extra, "--out", str(out),
                   *(["--profile-dir", str(self.work / "decode-profile")] if name == "inprocess" else [])]
            row = self.run(name, cmd, self.args.engine_timeout * 3,
                           outputs=(out, *([self.work / "decode-profile"] if name == "inprocess" else [])))
            if out.exists():
                row["rows"] = json.loads(out.read_text())
                profiles = sorted((self.work / "decode-profile").glob("decode-profile-*.txt"))
                if profiles:
                    self.result["decode_profile"] = {p.stem: p.read_text()[:8000] for p in profiles}
                self.save()

    def anchor(self, model: str) -> None:
        """The decode anchor, ``--anchor SCRIPT``: a probe of how fast this device decodes the
        model's shapes at all (a plain-torch decoder, its whole step one CUDA graph), run in the
        same call as the engine's figures at the same request counts. It prints JSON lines with
        ``what = "decode_step"``, ``batch``, ``graph`` and ``tokens_per_s``; ``model`` is unused
        (the probe makes random weights of the same shapes)."""
        if not self.args.anchor:
            self.result["phases"]["anchor"] = {"ok": False, "skipped": "no --anchor script given"}
            self.save()
            return
        counts = self.args.inprocess_requests or sizes(self.args.small)["inprocess_requests"]
        cmd = [sys.executable, self.args.anchor, self.args.device, *(["--small"] if self.args.small else []),
               "--batches", ",".join(map(str, counts))]
        row = self.run("anchor", cmd, self.args.engine_timeout * 3)
        if row.get("skipped"):  # (its log is an earlier call's, or none)
            return
        lines = [json.loads(line) for line in (self.work / "anchor.log").read_text().splitlines()
                 if line.startswith("{")]
        steps = [r for r in lines if r.get("what") == "decode_step"]
        # the fastest way the probe measured at each count (its graph on a GPU, eager on a CPU)
        best: dict[int, dict] = {}
        for r in steps:
            if r["batch"] not in best or r["tokens_per_s"] > best[r["batch"]]["tokens_per_s"]:
                best[r["batch"]] = r
        row["rows"] = [best[b] for b in sorted(best)]
        self.save()

    def serve(self, model: str) -> None:
        """Serving while learning: ``streamrl bench serve recipes/serve.toml`` on the model's
        shapes, the engine and the trainer on the one GPU, streaming clients answered with
        learning off and on (alternating passes); the figure is the inter-token p50 with learning
        on against off (goal <= 1.05x)."""
        small = self.args.small
        out = self.work / "serve.json"
        gpu = ([f'pools.{p}.device="cuda"' for p in ("generate", "train")]
               + [f'pools.{p}.cuda_visible_devices=["0"]' for p in ("generate", "train")]
               + ["pools.train.nice=0",  # (the GPU is not shared through the CPU's scheduler)
                  'transfer.name="cuda_ipc"']
               if self.args.device == "cuda" else [])
        sizes = (["engine.slots=16", "engine.max_new_tokens=8", "trainer.prompts_per_step=2",
                  "trainer.samples_per_prompt=8", "serve.samples_per_step=16", "eval.every=0"] if small else
                 ["engine.slots=256", "engine.max_new_tokens=128", "engine.max_prompt_tokens=64",
                  "trainer.prompts_per_step=32", "trainer.samples_per_prompt=8", "serve.samples_per_step=256",
                  "eval.every=0"])
        over = [f"model.path=\"{model}\"", "cluster.dashboard_port=0", "engine.cuda_graph=true", *gpu, *sizes]
        # (64 client threads in one process read their streams slower than the GPU engine writes
        # them: on an H200 they paced every pass at ~50 ms a token; 8 processes of 8 threads)
        clients, seconds, repeats, procs = ("2", "2", "1", "2") if small else ("64", "20", "2", "8")
        row = self.run("serve", streamrl("bench", "serve", str(ROOT / "recipes" / "serve.toml"), *sets(over),
                                         "--clients", clients, "--seconds", seconds, "--repeats", repeats,
                                         "--n", "4", "--client-processes", procs, "--out", str(out)),
                       self.args.serve_timeout, outputs=(out,))
        if out.exists():
            found = json.loads(out.read_text())
            row["ratios"], row["training_steps"] = found["ratios"], found["training_steps"]
            row["rows"] = found["rows"]
            self.save()

    def transfer(self, model: str) -> None:
        """``bench transfer``: one weight publication, train worker's GPU -> the engine."""
        s = sizes(self.args.small)
        out = self.work / "transfer.json"
        over = [f"model.path=\"{model}\"", *device_overrides(self.args.device)]
        row = self.run("transfer", streamrl("bench", "transfer", RECIPE, *sets(over), "--transfers", "cuda_ipc,dask",
                                            "--repeats", str(s["transfer_repeats"]), "--out", str(out)),
                       self.args.transfer_timeout, outputs=(out,))
        if out.exists():
            row["result"] = json.loads(out.read_text())
            self.save()


def table(result: dict) -> str:
    """The check's figures as a markdown table."""
    lines = ["| phase | figure | value |", "|---|---|---|"]
    env = result.get("env", {})
    lines.append(f"| env | device | {env.get('gpu', 'cpu')} (torch {env.get('torch')}, transformers {env.get('transformers')}) |")
    for name, row in result["phases"].items():
        status = "ok" if row.get("ok") else f"FAILED ({row.get('skipped') or row.get('rc')})"
        lines.append(f"| {name} | status, seconds | {status}, {row.get('seconds', '-')} |")
        if name.startswith(("recipe", "factory")) and row.get("steps"):
            med = sorted(r["step_s"] for r in row["steps"])[len(row["steps"]) // 2]
            sync = sorted(r["weight_sync_s"] or 0 for r in row["steps"])[len(row["steps"]) // 2]
            lines.append(f"| {name} | s/step (median; mean after the first), tokens/s, weight sync s (median) | "
                         f"{med:.2f}; {row.get('later_mean_s', 0):.2f}, {row.get('tokens_per_s', 0):,.0f}, {sync:.3f} |")
            if row.get("weight_sync_share") is not None:
                lines.append(f"| {name} | weight publication share of a step | {100 * row['weight_sync_share']:.1f}% |")
        for v in row.get("variants", []):
            if "response_tokens_per_s" in v:
                lines.append(f"| {name} | {v['variant']}: tokens/s, s/step | {v['response_tokens_per_s']:,.0f}, "
                             f"{v['step_s_median']:.2f} |")
                if "dispatch_s_per_step" in v:  # (a step's mean: where the seconds went through Dask)
                    lines.append(f"| {name} | {v['variant']}: s a step to the first task, tasks' spread, "
                                 f"generating, collecting | {v['dispatch_s_per_step']:.3f}, "
                                 f"{v['spread_s_per_step']:.3f}, {v['generate_s_per_step']:.3f}, "
                                 f"{v['collect_s_per_step']:.3f} |")
                if "admissions_per_step" in v:  # (the slot engine's loop, a step's mean)
                    lines.append(f"| {name} | {v['variant']}: admissions (from graphs), prefill s, loop idle s a step | "
                                 f"{v['admissions_per_step']:.1f} ({v.get('prefill_graphed_per_step', 0):.1f}), "
                                 f"{v['prefill_s_per_step']:.3f}, "
                                 f"{v['idle_s_per_step']:.3f} |")
            elif "mfu" in v:
                mfu = "n/a" if v["mfu"] is None else f"{100 * v['mfu']:.1f}%"
                lines.append(f"| trainer | {v['samples']} x {v['tokens_per_step'] // v['samples']} {v['variant']}: "
                             f"tokens/s, MFU, peak GiB | {v['tokens_per_s']:,.0f}, {mfu}, {v['peak_memory_gib']:.1f} |")
        for w in row.get("ways", []):
            lines.append(f"| head | {w['way']}: s fwd+bwd, TFLOP/s, peak GiB, rel. diff (logp, dh, dW) | "
                         + (w["error"] if "error" in w else
                            f"{w['seconds']:.4f}, {w['tflops']}, {w['peak_gib']}, {w['rel_diff_logprob_gradh_gradw']}") + " |")
        for variant, r in row.get("skew", {}).items():
            lines.append(f"| longtail | {variant}: gen makespan s, x fcfs (gen), x fcfs (e2e), moved/step | "
                         f"{r['generate_makespan_s']:.3f}, {r['speedup_generate']:.2f}, {r['speedup_end_to_end']:.2f}, "
                         f"{r.get('moves/moved') or 0:.1f} |")
        if name == "lora" and row.get("result"):
            r = row["result"]
            t = r["tokens_per_s"]
            lines.append(f"| lora | decode tokens/s base, one adapter, {r['adapters']} mixed ({r['requests']} requests) | "
                         f"{t['base']:,.0f}, {t['one']:,.0f} ({r['one_over_base']:.2f}x), {t['mixed']:,.0f} "
                         f"({r['mixed_over_base']:.2f}x) |")
            lines.append(f"| lora | adapter publication: MB (share of the model), s to load | "
                         f"{r['adapter_bytes'] / 1e6:.1f} ({100 * r['adapter_over_model']:.1f}%), "
                         f"{r['adapter_load_s']['later_median']:.4f} |")
        if name.startswith("inprocess"):
            for r in row.get("rows", []):
                lines.append(f"| {name} | {r['requests']} requests: tokens/s, ms/step; decoder step ms alone, "
                             f"with the flags read; KV GiB | {r['tokens_per_s']:,}, {r['ms_per_step']:.2f}; "
                             f"{r['decoder_step_ms']:.2f}, {r['decoder_step_sync_ms']:.2f}; {r['kv_cache_bytes'] / 2**30:.3f} |")
                if "prefill_ms_all" in r:
                    lines.append(f"| {name} | {r['requests']} requests: prefill ms of one group, of all "
                                 f"({'graphs' if r['prefill_graphs'] else 'eager'}, then eager); buckets, staging "
                                 f"MiB | {r['prefill_ms_group']:.2f}, {r['prefill_ms_all']:.2f} vs "
                                 f"{r['prefill_eager_ms_group']:.2f}, {r['prefill_eager_ms_all']:.2f}; "
                                 f"{r['prefill_buckets']}, {r['prefill_staging_bytes'] / 2**20:.0f} |")
                if "decoder_step_torch_sampling_ms" in r:
                    lines.append(f"| {name} | {r['requests']} requests: decoder step ms, fused sampling against "
                                 f"torch ops | {r['decoder_step_ms']:.2f} vs {r['decoder_step_torch_sampling_ms']:.2f} |")
                if "sampling_check" in r:
                    c = r["sampling_check"]
                    lines.append(f"| {name} | fused draws: chi-square over the top 10 (10 dof, < 29.6), top share "
                                 f"vs p, log-prob max diff | {c['chi2_top10']}, {c['top_share']} vs {c['top_p']}, "
                                 f"{c['logprob_absdiff_max']:.1e} |")
        if name == "anchor":
            for r in row.get("rows", []):
                lines.append(f"| anchor | {r['batch']} requests: tokens/s, ms/step ({'graph' if r.get('graph') else 'eager'}) "
                             f"| {r['tokens_per_s']:,}, {r['ms_per_step']:.2f} |")
        if name == "serve" and row.get("ratios"):
            r = row["ratios"]
            off = [x for x in row["rows"] if x["learning"] == "off"]
            lines.append(f"| serve | learning on / off: inter-token p50, time to first token p50, inter-token p99 "
                         f"(goal <= 1.05x) | {r['itl_p50_ms']}x, {r['ttft_p50_ms']}x, {r['itl_p99_ms']}x |")
            if off:
                lines.append(f"| serve | learning off: tokens/s, inter-token p50 ms; steps trained | "
                             f"{off[0]['tokens_per_s']:,.0f}, {off[0]['itl_p50_ms']}; {row['training_steps']} |")
                # the serving process's host CPU per streamed token: its HTTP thread and decode loop
                # share one interpreter lock, so their sum bounds the tokens/s it can stream
                lines.append(f"| serve | learning off: host us per streamed token: HTTP thread CPU, decode loop CPU, "
                             f"its hand-over | {off[0].get('http_cpu_us')}, {off[0].get('loop_cpu_us')}, "
                             f"{off[0].get('emit_us')} |")
        if name == "transfer" and row.get("result"):
            for r in row["result"] if isinstance(row["result"], list) else [row["result"]]:
                lines.append(f"| transfer | {r.get('transfer')}: MB, s/publication, memcpy GB/s | "
                             f"{r.get('model_bytes', 0) / 1e6:.0f}, {r.get('publish_s_median', 0):.3f}, "
                             f"{r.get('memcpy_gb_s', 0):.1f} |")
    return "\n".join(lines)


def main() -> int:
    """Parse the flags, run every phase (or those named), print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the JSON result")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--small", action="store_true", help="a tiny model and sizes (the CPU dry run)")
    ap.add_argument("--work", default="gpu-check-work", help="folder for the model, runs and logs")
    ap.add_argument("--phases", default="engine,lora,recipe,transfer,head,trainer",
                    help="comma-separated phases to run (also: recipe_baseline, the recipe with the engine and "
                         "transfer of before; factory, the recipe on a dask-cuda cluster; longtail, W2's "
                         "scheduling variants on the GPU engine; inprocess, the engine without Dask and where a "
                         "decode step's time goes; anchor, the --anchor probe at the same request counts; serve, "
                         "serving latency with learning on against off)")
    ap.add_argument("--engine-requests", type=int, action="append", default=[],
                    help="concurrent requests of an engine measurement (repeatable; default 256 and 64)")
    ap.add_argument("--inprocess-requests", type=int, action="append", default=[],
                    help="a request count of the in-process engine and the anchor (repeatable; default 64, 256, "
                         "512 and 1024)")
    ap.add_argument("--finished-every", type=int, action="append", default=[],
                    help="the inprocess phase's engine.finished_every (repeatable: a run each, the first one "
                         "profiled; default 1): how many decode steps the engine's loop queues between two looks "
                         "for ended requests")
    ap.add_argument("--inprocess-run", action="append", default=[], metavar="ARGS",
                    help="the inprocess phase's engine_inprocess.py flags for one run (repeatable: a run each, the "
                         "first one profiled; e.g. \"--kernels liger --finished-every 8\"); given, --finished-every "
                         "is not used")
    ap.add_argument("--engine-batching", action="append", default=[], choices=["slots", "continuous-graphs"],
                    help="an engine phase variant (repeatable; default both, side by side in one process)")
    ap.add_argument("--anchor", help="the decode anchor probe script (the anchor phase; see Check.anchor)")
    ap.add_argument("--trainer-samples", type=int, action="append", default=[],
                    help="a trainer batch size in samples (repeatable; default 64)")
    ap.add_argument("--trainer-variant", action="append", default=[], metavar="LABEL:KEY=VALUE;...",
                    help="a trainer variant at the largest batch (repeatable; default: the recipe, without "
                         "Liger's kernels, and without them with the head of before)")
    ap.add_argument("--budget-s", type=float, default=3600, help="start no phase after this many seconds")
    ap.add_argument("--recipe-timeout", type=float, default=180, help="seconds for the recipe run")
    ap.add_argument("--engine-timeout", type=float, default=100, help="seconds for each engine variant")
    ap.add_argument("--trainer-timeout", type=float, default=120, help="seconds for each trainer batch size")
    ap.add_argument("--transfer-timeout", type=float, default=90, help="seconds for the transfer bench")
    ap.add_argument("--longtail-timeout", type=float, default=240, help="seconds for the long-tail bench")
    ap.add_argument("--serve-timeout", type=float, default=240, help="seconds for the serving bench")
    args = ap.parse_args()
    check = Check(args)
    check.env()
    if check.result["env"]["missing"]:  # (every phase would fail on it, one after another)
        print("gpu_check: this Python lacks what the phases import: " + "; ".join(check.result["env"]["missing"]),
              file=sys.stderr)
        return 2
    model = check.model()
    for phase in [p.strip() for p in args.phases.split(",") if p.strip()]:
        getattr(check, phase)(model)
    check.result["seconds"] = round(time.monotonic() - check.t0, 1)
    check.save()
    text = table(check.result)
    Path(args.out).with_suffix(".md").write_text(text + "\n")
    print(text)
    return 0 if all(r.get("ok") for r in check.result["phases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
