"""The policy being trained, held on a train worker: forward/backward per micro-batch, one
optimizer step per batch.

Gradients of a batch accumulate over its micro-batches. Each micro-batch's loss is the sum of
per-sample losses times ``scale = 1 / samples in the batch``, so the accumulated gradient is the
same however the batch was cut into micro-batches and in whatever order they arrived -- which is
why ``stream`` and ``batch`` modes give the same update.
"""

from __future__ import annotations

import time

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from streamrl.sample import Group


def pad_batch(samples, pad_id: int):
    """Right-padded ``input_ids``, ``attention_mask`` and a mask of response-token positions.

    ``response_mask[i, t]`` is 1 where token ``t+1`` of row ``i`` is a response token, i.e. it
    lines up with the logits at position ``t`` that predicted it.
    """
    rows = [s.prompt_ids + s.response_ids for s in samples]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    resp = torch.zeros((len(rows), width - 1), dtype=torch.float32)
    old = torch.zeros((len(rows), width - 1), dtype=torch.float32)
    for i, (s, row) in enumerate(zip(samples, rows)):
        ids[i, : len(row)] = torch.tensor(row)
        attn[i, : len(row)] = 1
        p, r = len(s.prompt_ids), len(s.response_ids)
        resp[i, p - 1: p - 1 + r] = 1.0
        old[i, p - 1: p - 1 + r] = torch.tensor(s.logprobs, dtype=torch.float32)
    return ids, attn, resp, old


def token_logprobs(model, ids, attn, temperature: float = 1.0):
    """Log-probability of each next token (shape ``[B, T-1]``) under ``model``."""
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


class Trainer:
    """A causal LM + AdamW (+ a frozen reference model when the algorithm asks for one)."""

    def __init__(self, model_path: str, lr: float, weight_decay: float, algorithm,
                 temperature: float = 1.0, device: str = "cpu", warmup_steps: int = 0):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path = model_path
        self.algorithm = algorithm
        self.temperature = temperature
        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
        self.model.train()
        self.reference = None
        if getattr(algorithm, "needs_reference", False):
            self.reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
            self.reference.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda i: min(1.0, (i + 1) / (warmup_steps + 1)))
        self.version = 0
        self.optimizer.zero_grad(set_to_none=True)

    def micro_batch(self, groups: list[Group], scale: float) -> dict:
        """Forward/backward on whole groups; gradients accumulate until :meth:`step`."""
        t0 = time.perf_counter()
        samples, advantages = [], []
        for group in groups:
            advantages += self.algorithm.advantages([s.reward for s in group])
            samples += group
        ids, attn, resp, old = pad_batch(samples, self.tokenizer.pad_token_id)
        ids, attn, resp, old = (t.to(self.device) for t in (ids, attn, resp, old))
        adv = torch.tensor(advantages, dtype=torch.float32, device=self.device)
        new = token_logprobs(self.model, ids, attn, self.temperature)
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = token_logprobs(self.reference, ids, attn, self.temperature)
        per_sample, stats = self.algorithm.loss(new, old, ref, adv, resp)
        (per_sample.sum() * scale).backward()
        return {
            "samples": len(samples),
            "tokens": int(resp.sum().item()),
            "reward_sum": float(sum(s.reward for s in samples)),
            "loss_sum": float(per_sample.sum().item()),
            "seconds": time.perf_counter() - t0,
            **{k: float(v) for k, v in stats.items()},
        }

    def step(self, max_grad_norm: float) -> dict:
        """Clip, step the optimizer, clear gradients; the policy version goes up by one."""
        t0 = time.perf_counter()
        norm = 0.0
        if max_grad_norm > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_grad_norm))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return {"version": self.version, "grad_norm": norm, "seconds": time.perf_counter() - t0}

    @torch.no_grad()
    def export_weights(self) -> bytes:
        """Parameters as safetensors bytes (tied weights once; any dtype, no CUDA tensors)."""
        named = {n: p.detach().to("cpu").contiguous() for n, p in self.model.named_parameters()}
        return save_safetensors(named)

    @torch.no_grad()
    def logprobs(self, group: Group) -> list[list[float]]:
        """Recomputed logprobs of each response's tokens under the current weights (for checks)."""
        ids, attn, resp, _ = pad_batch(group, self.tokenizer.pad_token_id)
        lp = token_logprobs(self.model, ids.to(self.device), attn.to(self.device), self.temperature).cpu()
        return [lp[i][resp[i] > 0].tolist() for i in range(len(group))]

    def save(self, out: str) -> str:
        """Write the current policy as a transformers model folder (``from_pretrained`` reloads it)."""
        self.model.save_pretrained(out)
        self.tokenizer.save_pretrained(out)
        return out


def weights_from_bytes(blob: bytes) -> dict[str, torch.Tensor]:
    """Inverse of :meth:`Trainer.export_weights`."""
    return load_safetensors(blob)


__all__ = ["Trainer", "pad_batch", "token_logprobs", "weights_from_bytes"]
