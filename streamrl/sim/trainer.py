"""The sim trainer: the train pool's cost model, paired with the ``sim`` engine.

It sleeps what training the samples would take on ``train_gpus`` simulated GPUs
(:func:`streamrl.sim.latency.train_time`) and keeps the policy version, so the controller,
accounting and weight publication run unchanged. No model, no gradients: *simulated*.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from streamrl.sim import latency


class SimTrainer:
    """Stands in for :class:`streamrl.training.trainer.Trainer` on the train worker."""

    def __init__(self, config, gpus: int):
        self.config = config
        self.profile = config.profile
        self.gpus = gpus
        self.version = 0

    def micro_batch(self, groups, scale: float) -> dict:
        """Sleep the forward/backward time of the groups' tokens."""
        t0 = time.perf_counter()
        samples = [s for g in groups for s in g]
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        time.sleep(latency.train_time(self.profile, tokens, self.gpus) * self.config.time_scale)
        return {"samples": len(samples), "tokens": sum(len(s.response_ids) for s in samples),
                "reward_sum": float(sum(s.reward for s in samples)), "loss_sum": 0.0,
                "clip_frac_sum": 0.0, "kl_sum": 0.0, "seconds": time.perf_counter() - t0}

    def step(self, max_grad_norm: float) -> dict:
        """Sleep an Adam update (memory-bound: ~16 bytes per parameter, sharded over the GPUs)."""
        t0 = time.perf_counter()
        p = self.profile
        time.sleep(p.params * 16 / (p.mem_bw * p.bw_eff * self.gpus) * self.config.time_scale)
        self.version += 1
        return {"version": self.version, "grad_norm": 0.0, "seconds": time.perf_counter() - t0}

    def export_weights(self) -> dict:
        """No tensors: the sim engine sleeps the broadcast time when it loads."""
        return {}

    def save(self, out: str) -> str:
        """Write a note saying what was simulated (there is no model to save)."""
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "simulated.json").write_text(json.dumps(
            {"simulated": True, "policy_version": self.version, "train_gpus": self.gpus,
             "profile": self.profile.model_dump()}, indent=2))
        return out
