"""Supervised warm start: teach a fresh tiny model the answer format before RL.

RL needs a policy that is sometimes right, or every group has zero reward variance and GRPO has
no signal. A short run of next-token cross-entropy on (prompt, answer) pairs gets there; stop it
early (well short of solving the task: docs/benchmarks.md has what a short warm start gives) and
let RL do the rest.
"""

from __future__ import annotations

import math
import random
import time

import torch


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt as the engine feeds it: BOS and its tokens, or its tokens alone when a chat
    template already put BOS in front."""
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    bos = tokenizer.bos_token_id
    return ids if bos is None or ids[:1] == [bos] else [bos] + ids


def encode_pair(tokenizer, prompt: str, answer: str) -> tuple[list[int], int]:
    """Token ids of ``<bos> prompt answer <eos>`` and the number of prompt tokens (with BOS)."""
    p = prompt_ids(tokenizer, prompt)
    a = tokenizer(answer, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    return p + a, len(p)


def warm_start(model, tokenizer, example, steps: int, batch_size: int = 64, lr: float = 3e-3,
               seed: int = 0, log=print) -> dict:
    """Train ``model`` for ``steps`` AdamW steps on pairs from ``example(rng)``; loss on answers only."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    # Short linear warm-up then cosine decay: a constant rate makes the tiny model's loss
    # oscillate late in training (measured: greedy accuracy bouncing between 1% and 28%).
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps)))
    model.train()
    t0 = time.perf_counter()
    loss_value = float("nan")
    for step in range(steps):
        rows = [encode_pair(tokenizer, *example(rng)) for _ in range(batch_size)]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.full((batch_size, width), tokenizer.pad_token_id)
        labels = torch.full((batch_size, width), -100)
        for i, (row, n_prompt) in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
            labels[i, n_prompt: len(row)] = torch.tensor(row[n_prompt:])
        loss = model(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long(), labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_value = loss.item()
        if log and (step % 100 == 0 or step == steps - 1):
            log(f"warm start step {step}: loss {loss_value:.3f}")
    model.eval()
    return {"steps": steps, "loss": loss_value, "seconds": time.perf_counter() - t0}


@torch.no_grad()
def greedy_accuracy(model, tokenizer, example, n: int = 200, max_new_tokens: int = 8, seed: int = 1) -> float:
    """Share of ``n`` fresh examples the model answers exactly with greedy decoding."""
    rng = random.Random(seed)
    right = 0
    for _ in range(n):
        prompt, answer = example(rng)
        ids = torch.tensor([prompt_ids(tokenizer, prompt)])
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        right += text.strip() == answer
    return right / n
