"""``streamrl model init``: a tiny model + tokenizer for a task, warm-started, saved locally."""

from __future__ import annotations

import json
import random
from pathlib import Path

from streamrl.errors import UserError


def init_model(task_name: str, out: str, warmstart_steps: int, seed: int = 0, overrides=()) -> dict:
    """Build the task's tokenizer and a tiny Llama, warm-start it, save it to ``out``."""
    import torch
    from transformers.utils import logging as hf_logging

    from streamrl.plugins.registry import build_registry
    from streamrl.recipe.recipe import apply_overrides, with_run_defaults
    from streamrl.recipe.toml_input import check_finite
    from streamrl.tasks.tiny import char_tokenizer, save, tiny_llama
    from streamrl.training.warmstart import greedy_accuracy, warm_start

    hf_logging.disable_progress_bar()
    # (as a recipe's [task] table: a dotted key reaches into a nested option, inf and nan refused)
    options = apply_overrides({}, list(overrides))
    check_finite(options)
    component = build_registry().get("task", task_name, "--task")
    task = _built(component, options, task_name)
    if not task.alphabet:
        raise UserError(f"--task {task_name}: this task cannot build a tiny model (it has no alphabet)")
    torch.manual_seed(seed)
    tokenizer = char_tokenizer(task.alphabet)
    if "model_path" in component.config.model_fields and "model_path" not in options:
        # a task that reads the model's tokenizer (chat templates) reads the one made here
        tokenizer.save_pretrained(out)
        task = _built(component, with_run_defaults(component.config, options, seed, Path(out)), task_name)
    # context: BOS + prompt + response + EOS, rounded up (tasks without lengths keep the default)
    longest = task.max_response_chars()
    positions = max(64, -(-(task.max_prompt_chars() + longest + 2) // 32) * 32)
    model = tiny_llama(len(tokenizer), max_positions=positions, seed=seed)
    report = {"task": task_name, "options": options, "parameters": sum(p.numel() for p in model.parameters())}
    if warmstart_steps > 0:
        report["warm_start"] = warm_start(model, tokenizer, task.example, warmstart_steps, seed=seed)
        report["greedy_accuracy"] = greedy_accuracy(model, tokenizer, task.example, n=200, max_new_tokens=longest + 1,
                                                    seed=random.Random(seed).randint(1, 10**6))
    save(model, tokenizer, out)
    with open(f"{out}/streamrl_init.json", "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report))
    return report


def _built(component, options: dict, task_name: str):
    # the task's own checks of its options (a range whose low end is above its high end) are
    # the user's to fix: one line naming --task, not a traceback
    try:
        return component.build(options, "task")
    except UserError:
        raise
    except (ValueError, TypeError, OverflowError) as e:
        raise UserError(f"--task {task_name} (--set): {str(e).splitlines()[0] if str(e) else type(e).__name__}") \
            from None
