"""streamrl next to TRL's GRPOTrainer on the same setting, run back to back on this machine.

    pip install "trl>=1.16"          # optional: only this benchmark needs it
    python benchmarks/peer_trl.py recipes/addition.toml --steps 30 [--set trainer.lr=2e-4 ...] \
        [--variant 'async:run.mode="async" run.max_staleness=1']

Both sides get what the recipe says: the same model folder (``from_pretrained``), the task's
prompt stream (step by step, in order), the recipe's reward, prompts x samples per step, max new
tokens, temperature, learning rate, clip, KL weight and grad-norm clip. TRL runs with its own
defaults otherwise (its generation is ``model.generate`` on the whole batch, on every core), and
``loss_type="grpo"`` (per-sample token mean, like ours), float32 weights (streamrl's trainer's on
a CPU) and no activation checkpointing (ours has none). streamrl runs the recipe with
``streamrl recipe run`` as a user would, on its embedded cluster.

Samples/s counts trained samples over the training steps only, for both: streamrl from the
first step's start to the last record (cluster start and model loads excluded), TRL over
``trainer.train()`` (model load excluded, its held-out evaluations subtracted). Reward gain is
the mean reward of the last fifth of the steps minus that of the first fifth.

Held-out accuracy, when the recipe has an ``[eval]`` table and its task held-out prompts: streamrl
evaluates as the recipe says (greedy, ``eval.max_prompts``, every ``eval.every`` steps, on its
generate pool while training goes on); TRL's policy is evaluated the same way between its steps
(greedy ``model.generate`` on the same rendered prompts, scored by the same reward, pass when the
reward reaches ``eval.pass_reward``), before the first step, every ``eval.every`` steps and after
the last. streamrl's trained policy (``policy/``) is also evaluated by TRL's side's evaluator, so
the last step's figures have one yardstick (greedy decoding of a 135M model flips on small
numeric differences: the two evaluators differ by a few questions on the same weights). The table
gives pass@1 at the last step of both (equal steps) and each side's latest evaluation within the
shorter side's training time (equal wall time). Prints markdown and writes
it with ``--out`` (and the curves as JSON beside it).
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
        # the trained policy through TRL's side's evaluator too: one yardstick for both
        final = evaluate_folder(recipe, overrides, run_dir / "policy")
    start = records[0]["time"] - records[0]["step_s"]
    seconds = records[-1]["time"] - start
    samples = sum(r["samples"] for r in records)
    # the step each trained policy version finished on, from the start of training: when that
    # policy existed (its evaluation may land in a later record)
    trained_at = {0: 0.0, **{r["policy_version"]: r["time"] - start for r in records}}
    evals = sorted((r["eval/policy_version"], trained_at.get(r["eval/policy_version"], r["time"] - start), r["eval/pass@1"])
                   for r in records if "eval/pass@1" in r)
    return {"samples": samples, "seconds": seconds, "wall": wall, "rewards": [r["reward_mean"] for r in records],
            "evals": [{"step": v, "seconds": round(t, 1), "pass@1": p} for v, t, p in evals], "final_hf": final}


def evaluate_folder(recipe: str, overrides: list[str], folder: Path) -> float | None:
    """Held-out greedy pass@1 of the model in ``folder`` by :func:`greedy_pass_at_1` (float32,
    ``model.generate``), as TRL's side is evaluated; None without held-out prompts."""
    import torch
    from transformers import AutoTokenizer

    from streamrl.models import pretrained
    from streamrl.plugins.resolve import resolve
    from streamrl.recipe.recipe import load_recipe

    resolved = resolve(load_recipe(recipe, overrides))
    task, reward = resolved.task.build(), resolved.reward.build()
    held_out = held_out_prompts(resolved, task)
    if not held_out:
        return None
    model = pretrained.causal_lm(folder, torch.float32)  # (as streamrl's workers load it)
    return greedy_pass_at_1(model, AutoTokenizer.from_pretrained(folder), held_out, reward,
                            resolved.engine.config.max_new_tokens, resolved.recipe.eval.pass_reward)


def run_trl(recipe: str, steps: int, overrides: list[str]) -> dict:
    """TRL's GRPOTrainer on the recipe's model, prompts, reward and hyper-parameters."""
    try:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
    except ImportError:
        sys.exit("this benchmark needs TRL: pip install 'trl>=1.16'")
    from transformers import AutoTokenizer

    from streamrl.models import pretrained
    from streamrl.plugins.resolve import resolve
    from streamrl.recipe.recipe import load_recipe

    import torch
    from transformers import TrainerCallback

    resolved = resolve(load_recipe(recipe, overrides))
    r, t = resolved.recipe, resolved.recipe.trainer
    task, reward = resolved.task.build(), resolved.reward.build()
    engine, algo = resolved.engine.config, resolved.algorithm.config
    tokenizer = AutoTokenizer.from_pretrained(resolved.model_path)
    # float32, as streamrl's trainer holds the weights on a CPU: transformers 5 loads a folder
    # saved in bfloat16 as bfloat16, where AdamW's steps at lr 1e-5 round away (measured: TRL
    # then did not learn in 20 steps; docs/benchmarks.md)
    model = pretrained.causal_lm(resolved.model_path, torch.float32)  # (as streamrl's workers load it)
    prompts = {p.uid: p for step in range(steps) for p in task.prompts(step, t.prompts_per_step)}
    # TRL tokenizes a text prompt without special tokens. A chat prompt is already rendered with
    # the model's template (its special tokens in the text); a plain one is fed by our engine
    # after a BOS, so the BOS goes into the text (the tokenizer maps it to its special id).
    rows = [{"prompt": p.text if p.token_ids is not None else tokenizer.bos_token + p.text, "uid": uid}
            for uid, p in prompts.items()]

    def score(completions, uid, **_):
        return [reward_value(reward.score(prompts[u], c))[0] for c, u in zip(completions, uid)]

    batch = t.prompts_per_step * t.samples_per_prompt
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(), use_cpu=True, report_to=[], logging_steps=1, save_strategy="no",
        disable_tqdm=True, max_steps=steps, per_device_train_batch_size=batch, num_generations=t.samples_per_prompt,
        max_completion_length=engine.max_new_tokens, temperature=engine.temperature,
        learning_rate=t.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=t.max_grad_norm, beta=algo.kl_coef, epsilon=algo.clip, loss_type="grpo",
        shuffle_dataset=False, seed=r.run.seed, bf16=False,
        # TRL recomputes activations by default; streamrl's trainer does not, and a model this
        # size needs neither, so both train with the same FLOPs
        gradient_checkpointing=False,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=score, args=config, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer)
    from transformers import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # one dict per step on stdout otherwise
    evals, eval_s = [], [0.0]
    held_out = held_out_prompts(resolved, task)
    every = r.eval.every if r.eval is not None else 0
    t0 = [0.0]

    def evaluate(step: int) -> None:
        if not held_out:
            return
        started = time.perf_counter()
        evals.append({"step": step, "seconds": round(started - t0[0] - eval_s[0], 1),
                      "pass@1": greedy_pass_at_1(model, tokenizer, held_out, reward, engine.max_new_tokens,
                                                 r.eval.pass_reward)})
        eval_s[0] += time.perf_counter() - started

    class HeldOut(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step < steps and every and state.global_step % every == 0:
                evaluate(state.global_step)

    trainer.add_callback(HeldOut())
    t0[0] = time.perf_counter()
    evaluate(0)
    trainer.train()
    evaluate(steps)
    seconds = time.perf_counter() - t0[0] - eval_s[0]
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"samples": steps * batch, "seconds": seconds, "rewards": rewards, "evals": evals,
            "final_hf": evals[-1]["pass@1"] if evals else None}


def reward_value(value):
    """(score, named values) of what a reward gave, as streamrl reads it."""
    from streamrl.rewards.scoring import reward_value as read

    return read(value)


def held_out_prompts(resolved, task) -> list:
    """The held-out prompts streamrl's evaluation uses (``eval.max_prompts`` of them), or []."""
    r = resolved.recipe
    if r.eval is None or not hasattr(task, "eval_prompts"):
        return []
    held_out = task.eval_prompts()
    return held_out[: r.eval.max_prompts] if r.eval.max_prompts else held_out


def greedy_pass_at_1(model, tokenizer, prompts: list, reward, max_new_tokens: int, pass_reward: float,
                     batch: int = 16) -> float:
    """Share of ``prompts`` whose greedy answer (``model.generate``, left-padded batches) the
    reward scores at ``pass_reward`` or more."""
    import torch

    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    passed = 0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            chunk = prompts[i:i + batch]
            ids = [p.token_ids if p.token_ids is not None else
                   [tokenizer.bos_token_id, *tokenizer(p.text, add_special_tokens=False).input_ids] for p in chunk]
            width = max(map(len, ids))
            input_ids = torch.tensor([[pad] * (width - len(x)) + list(x) for x in ids])
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=pad)
            for p, row in zip(chunk, out[:, width:]):
                answer = tokenizer.decode(row, skip_special_tokens=True)
                passed += reward_value(reward.score(p, answer))[0] >= pass_reward
    model.train()
    tokenizer.padding_side = side
    return passed / max(1, len(prompts))


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
    ap.add_argument("--out", type=Path, help="also write the table to this file (and the figures to its .json)")
    ap.add_argument("--render", type=Path, metavar="JSON", help="print the table of runs measured before (their .json)")
    a = ap.parse_args()
    from streamrl.errors import UserError
    from streamrl.recipe.recipe import load_recipe

    variants = {"streamrl": a.overrides} if a.only != "trl" else {}
    for v in a.variant if a.only != "trl" else []:
        label, _, extra = v.partition(":")
        variants[f"streamrl {label}"] = a.overrides + extra.split()
    for name, overrides in variants.items():  # a typo is found now, not after the runs before it
        try:
            load_recipe(a.recipe, overrides)
        except UserError as e:
            sys.exit(f"{name}: {e}")
    results = {}

    def keep(name: str, result: dict) -> None:  # (each run's figures saved as it ends)
        results[name] = result
        if a.out:
            a.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")

    if a.render:  # the table of runs measured before
        results.update(json.loads(a.render.read_text()))
    else:
        for name, overrides in variants.items():
            keep(name, run_streamrl(a.recipe, a.steps, overrides))
        if a.only != "streamrl":
            keep("TRL GRPOTrainer", run_trl(a.recipe, a.steps, a.overrides))
    text = table(results, f"{a.recipe}, {a.steps} steps {' '.join(a.overrides)} -- {platform.machine()}, "
                          f"{os.cpu_count()} cores; {versions()}", a.steps)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


def table(results: dict, title: str, steps: int) -> str:
    """The markdown table of ``results`` (name -> a run's figures), with the ratios to TRL."""
    lines = [title, ""]
    with_evals = all(res.get("evals") for res in results.values())
    shortest = min(res["seconds"] for res in results.values())
    if with_evals:
        lines += [f"| system | samples/s | train s | reward first -> last fifth | held-out pass@1: start -> "
                  f"step {steps} (own evaluator) | step {steps}, one evaluator (`model.generate`) | "
                  f"held-out pass@1 at {shortest:.0f} s (step) |", "|---|---|---|---|---|---|---|"]
    else:
        lines += ["| system | samples/s | train s | reward first -> last fifth |", "|---|---|---|---|"]
    for name, res in results.items():
        first, last = gain(res["rewards"])
        row = (f"| {name} | {res['samples'] / res['seconds']:.2f} | {res['seconds']:.1f} | "
               f"{first:.3f} -> {last:.3f} |")
        if with_evals:
            evals = res["evals"]
            within = [e for e in evals if e["seconds"] <= shortest + 0.05] or evals[:1]  # (rounded to 0.1 s)
            final = res.get("final_hf")
            row += (f" {evals[0]['pass@1']:.3f} -> {evals[-1]['pass@1']:.3f} |"
                    f" {'-' if final is None else f'{final:.3f}'} |"
                    f" {within[-1]['pass@1']:.3f} ({within[-1]['step']}) |")
        lines.append(row)
    if "TRL GRPOTrainer" in results and len(results) > 1:
        peer = results["TRL GRPOTrainer"]
        lines.append("")
        for name, res in results.items():
            if name != "TRL GRPOTrainer":
                lines.append(f"{name} / TRL: {res['samples'] / res['seconds'] / (peer['samples'] / peer['seconds']):.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
