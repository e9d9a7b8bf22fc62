"""streamrl next to TRL's GRPOTrainer on the same setting, run back to back on this machine.

    pip install "trl>=1.16"          # optional: only this benchmark needs it
    python benchmarks/peer_trl.py recipes/addition.toml --steps 30 [--set trainer.lr=2e-4 ...] \
        [--variant 'async:run.mode="async" run.max_staleness=1']

Both sides get what the recipe says: the same model folder (``from_pretrained``), the task's
prompt stream (step by step, in order), the recipe's reward, prompts x samples per step, max new
tokens, temperature, learning rate, clip, KL weight and grad-norm clip. TRL runs with its own
defaults otherwise (its generation is ``model.generate`` on the whole batch, on every core), and
``loss_type="grpo"`` (per-sample token mean, like ours). streamrl runs the recipe with
``streamrl recipe run`` as a user would, on its embedded cluster.

Samples/s counts trained samples over the training steps only, for both: streamrl from the
first step's start to the last record (cluster start and model loads excluded), TRL over
``trainer.train()`` (model load excluded). Reward gain is the mean reward of the last fifth of
the steps minus that of the first fifth. Prints a markdown table and writes it with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def gain(rewards: list[float]) -> tuple[float, float]:
    """(mean of the first fifth, mean of the last fifth) of a reward curve."""
    k = max(1, len(rewards) // 5)
    return sum(rewards[:k]) / k, sum(rewards[-k:]) / k


def run_streamrl(recipe: str, steps: int, overrides: list[str]) -> dict:
    """``streamrl recipe run`` with ``run.steps=steps``; its samples/s over the steps."""
    with tempfile.TemporaryDirectory() as out:
        args = [sys.executable, "-m", "streamrl", "recipe", "run", recipe, "--set", f"run.steps={steps}",
                "--set", "cluster.dashboard_port=0", "--set", f'run.out_dir="{out}"']
        for o in overrides:
            args += ["--set", o]
        t0 = time.perf_counter()
        proc = subprocess.run(args, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode:
            sys.exit(f"streamrl run failed: {proc.stderr.strip().splitlines()[-1:]}")
        (run_dir,) = Path(out).iterdir()
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    seconds = records[-1]["time"] - (records[0]["time"] - records[0]["step_s"])
    samples = sum(r["samples"] for r in records)
    return {"samples": samples, "seconds": seconds, "wall": wall, "rewards": [r["reward_mean"] for r in records]}


def run_trl(recipe: str, steps: int, overrides: list[str]) -> dict:
    """TRL's GRPOTrainer on the recipe's model, prompts, reward and hyper-parameters."""
    try:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
    except ImportError:
        sys.exit("this benchmark needs TRL: pip install 'trl>=1.16'")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from streamrl.plugins.resolve import resolve
    from streamrl.recipe.recipe import load_recipe
    from streamrl.sample import Prompt

    resolved = resolve(load_recipe(recipe, overrides))
    r, t = resolved.recipe, resolved.recipe.trainer
    task, reward = resolved.task.build(), resolved.reward.build()
    engine, algo = resolved.engine.config, resolved.algorithm.config
    tokenizer = AutoTokenizer.from_pretrained(resolved.model_path)
    model = AutoModelForCausalLM.from_pretrained(resolved.model_path)
    # our engine feeds BOS + the prompt's characters; TRL tokenizes the text without special
    # tokens, so the BOS goes into the text (the tokenizer maps "<bos>" to its special id)
    rows = [{"prompt": tokenizer.bos_token + p.text, "text": p.text, "answer": json.dumps(p.answer), "uid": p.uid}
            for step in range(steps) for p in task.prompts(step, t.prompts_per_step)]

    def score(completions, text, answer, uid, **_):
        return [reward.score(Prompt(uid=u, text=x, answer=json.loads(a)), c)
                for c, x, a, u in zip(completions, text, answer, uid)]

    batch = t.prompts_per_step * t.samples_per_prompt
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(), use_cpu=True, report_to=[], logging_steps=1, save_strategy="no",
        disable_tqdm=True, max_steps=steps, per_device_train_batch_size=batch, num_generations=t.samples_per_prompt,
        max_completion_length=engine.max_new_tokens, temperature=engine.temperature,
        learning_rate=t.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=t.max_grad_norm, beta=algo.kl_coef, epsilon=algo.clip, loss_type="grpo",
        shuffle_dataset=False, seed=r.run.seed, bf16=False,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=score, args=config, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer)
    from transformers import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # one dict per step on stdout otherwise
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"samples": steps * batch, "seconds": seconds, "rewards": rewards}


def versions() -> str:
    """The library versions both sides ran with."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for pkg in ["streamrl", "trl", "torch", "transformers", "dask"]:
        try:
            out.append(f"{pkg} {version(pkg)}")
        except PackageNotFoundError:
            pass
    return ", ".join(out)


def main() -> None:
    """Run both, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL:KEY=VALUE ...",
                    help="also run streamrl with these overrides, e.g. 'async:run.mode=\"async\" run.max_staleness=1'")
    ap.add_argument("--only", choices=["streamrl", "trl"], help="run one side only")
    ap.add_argument("--out", type=Path, help="also write the table to this file")
    a = ap.parse_args()
    results = {}
    if a.only != "trl":
        results["streamrl"] = run_streamrl(a.recipe, a.steps, a.overrides)
        for v in a.variant:
            label, _, extra = v.partition(":")
            results[f"streamrl {label}"] = run_streamrl(a.recipe, a.steps, a.overrides + extra.split())
    if a.only != "streamrl":
        results["TRL GRPOTrainer"] = run_trl(a.recipe, a.steps, a.overrides)
    lines = [f"{a.recipe}, {a.steps} steps {' '.join(a.overrides)} -- {platform.machine()}, {os.cpu_count()} cores; "
             f"{versions()}", "",
             "| system | samples/s | train s | reward first -> last fifth |", "|---|---|---|---|"]
    for name, res in results.items():
        first, last = gain(res["rewards"])
        lines.append(f"| {name} | {res['samples'] / res['seconds']:.0f} | {res['seconds']:.1f} | "
                     f"{first:.3f} -> {last:.3f} |")
    if "TRL GRPOTrainer" in results and len(results) > 1:
        peer = results["TRL GRPOTrainer"]
        lines.append("")
        for name, res in results.items():
            if name != "TRL GRPOTrainer":
                lines.append(f"{name} / TRL: {res['samples'] / res['seconds'] / (peer['samples'] / peer['seconds']):.2f}x")
    text = "\n".join(lines)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
