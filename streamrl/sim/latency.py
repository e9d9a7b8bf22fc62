"""The hardware/model cost model of the ``sim`` engine and trainer (the W3 workload, ``docs/architecture.md``).

Decoding is memory-bound: each decode step reads the weights once plus the KV cache of every
running sequence, so the per-token latency of a step grows with the batch's total context:

    ptl = c0 + (W + kv * sum_context) / (eff * BW)

Prefill is compute-bound (``2 * params`` FLOPs per prompt token). Training costs
``train_flops_per_token`` per token (6 x params for the actor; x2 with a critic) at
``peak_flops * train_eff`` per GPU.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Profile(BaseModel):
    """A model on a device. Defaults: Qwen2.5-7B-like in bf16 on an H800-class GPU."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    params: float = Field(7.6e9, gt=0)
    """Model parameters."""
    weight_bytes: float = Field(15.2e9, gt=0)
    """Bytes of weights read per decode step (bf16: 2 x params)."""
    kv_bytes_per_token: float = Field(57_344, gt=0)
    """KV-cache bytes per context token (layers x 2 x kv heads x head dim x 2 bytes)."""
    mem_bw: float = Field(3.35e12, gt=0)
    """Device memory bandwidth, bytes/s."""
    bw_eff: float = Field(0.8, gt=0, le=1)
    """Share of the bandwidth decoding achieves."""
    step_overhead_s: float = Field(0.002, ge=0)
    """c0: fixed cost of one decode step (kernel launches, sampling, scheduling)."""
    memory_bytes: float = Field(80e9, gt=0)
    """Device memory; the KV cache gets ``0.9 * memory - weights``."""
    peak_flops: float = Field(989e12, gt=0)
    """Dense bf16 FLOP/s of the device."""
    prefill_eff: float = Field(0.5, gt=0, le=1)
    """Share of peak FLOP/s prefill achieves."""
    train_flops_per_token: float = Field(2 * 6 * 7.6e9, gt=0)
    """Training FLOPs per token: 6 x params for the actor, doubled for PPO's critic."""
    train_eff: float = Field(0.4, gt=0, le=1)
    """Share of peak FLOP/s training achieves (MFU)."""
    weight_sync_gbps: float = Field(400.0, gt=0)
    """Bandwidth of the trainer -> generator weight broadcast, Gbit/s."""

    @model_validator(mode="after")
    def _weights_fit(self):
        # (a negative KV capacity ran every simulated instance one request at a time, and the
        # planner with it, without a word)
        if kv_capacity_tokens(self) < 1:
            raise ValueError(f"weight_bytes = {self.weight_bytes:.4g} leaves no KV cache in 0.9 x memory_bytes = "
                             f"{0.9 * self.memory_bytes:.4g}; expected weights that fit with room for a token's "
                             f"kv_bytes_per_token = {self.kv_bytes_per_token:.4g}")
        return self


def kv_capacity_tokens(p: Profile) -> int:
    """Context tokens the KV cache of one instance holds."""
    return int((0.9 * p.memory_bytes - p.weight_bytes) / p.kv_bytes_per_token)


def step_latency(p: Profile, sum_context: float) -> float:
    """Seconds of one decode step with ``sum_context`` tokens of context in the running batch."""
    return p.step_overhead_s + (p.weight_bytes + p.kv_bytes_per_token * sum_context) / (p.bw_eff * p.mem_bw)


def decode_coefficients(p: Profile) -> tuple[float, float]:
    """``(c0, per_context_token)``: :func:`step_latency` as ``c0 + per_context_token * context``."""
    bw = p.bw_eff * p.mem_bw
    return p.step_overhead_s + p.weight_bytes / bw, p.kv_bytes_per_token / bw


def decode_time(p: Profile, sum_context: float, running: int, steps: int) -> float:
    """Seconds for ``steps`` decode steps of ``running`` sequences starting at ``sum_context``:
    each step adds one token to every sequence, so the context grows by ``running`` a step."""
    a = step_latency(p, sum_context)
    b = p.kv_bytes_per_token * running / (p.bw_eff * p.mem_bw)
    return steps * a + b * steps * (steps - 1) / 2


def steps_within(p: Profile, sum_context: float, running: int, seconds: float) -> int:
    """Most whole decode steps that fit in ``seconds`` (inverse of :func:`decode_time`)."""
    a = step_latency(p, sum_context)
    b = p.kv_bytes_per_token * running / (p.bw_eff * p.mem_bw)
    if b == 0:
        return int(seconds / a)
    # b/2 k^2 + (a - b/2) k - seconds = 0
    h = a - b / 2
    k = (-h + math.sqrt(h * h + 2 * b * seconds)) / b
    return max(int(k), 0)


def prefill_time(p: Profile, prompt_tokens: int) -> float:
    """Seconds to prefill ``prompt_tokens`` (compute-bound)."""
    return prompt_tokens * 2 * p.params / (p.peak_flops * p.prefill_eff)


def train_time(p: Profile, tokens: int, gpus: int) -> float:
    """Seconds to train on ``tokens`` with ``gpus`` devices (perfect data parallelism)."""
    return tokens * p.train_flops_per_token / (gpus * p.peak_flops * p.train_eff)


def weight_sync_time(p: Profile) -> float:
    """Seconds to broadcast the weights once."""
    return p.weight_bytes * 8 / (p.weight_sync_gbps * 1e9)
