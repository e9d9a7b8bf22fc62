"""The ``sim`` trainer: the train pool's cost model, paired with the ``sim`` engine.

It sleeps what training the samples would take on ``gpus`` simulated GPUs
(:func:`streamrl.sim.latency.train_time`) with the cost model the ``sim`` engine declares
(``[engine.profile]``, ``engine.time_scale``; it reaches the trainer as ``context.engine``) and
keeps the policy version, so the controller, accounting and weight publication run unchanged.
No model, no gradients: *simulated*.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from streamrl.api import Trainer, TrainerContext
from streamrl.sim import latency
from streamrl.sim.capabilities import SimEngineCapabilities, SimTrainerCapabilities
from streamrl.sim.latency import Profile


class SimTrainerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    gpus: int = Field(8, ge=1)
    """Simulated training GPUs behind the train worker (training cost is divided by them)."""
    device: Profile | None = None
    """The training devices (``[trainer.device]``) when they are another class of hardware than
    the generating instances (heterogeneous pools); unset: the engine's ``[engine.profile]``."""


class SimTrainer(Trainer):
    """Stands in for the ``hf`` trainer on the train worker (``[trainer] name = "sim"``)."""

    @classmethod
    def capabilities(cls, config: SimTrainerConfig) -> SimTrainerCapabilities:
        """No model; ``gpus`` virtual training devices."""
        return SimTrainerCapabilities(gpus=config.gpus, device=config.device)

    def __init__(self, config: SimTrainerConfig, context: TrainerContext):
        if not isinstance(context.engine, SimEngineCapabilities):
            raise ValueError('trainer.name = "sim" needs engine.name = "sim" (it uses the engine\'s cost model)')
        self.time_scale = context.engine.time_scale
        self.profile = config.device or context.engine.profile
        self.gpus = config.gpus
        self.version = 0

    def micro_batch(self, groups, scale: float) -> dict:
        """Sleep the forward/backward time of the groups' tokens."""
        t0 = time.perf_counter()
        samples = [s for g in groups for s in g]
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        time.sleep(latency.train_time(self.profile, tokens, self.gpus) * self.time_scale)
        return {"samples": len(samples), "tokens": sum(len(s.response_ids) for s in samples),
                "reward_sum": float(sum(s.reward for s in samples)), "loss_sum": 0.0,
                "clip_frac_sum": 0.0, "kl_sum": 0.0, "seconds": time.perf_counter() - t0}

    def step(self) -> dict:
        """Sleep an Adam update (memory-bound: ~16 bytes per parameter, sharded over the GPUs)."""
        t0 = time.perf_counter()
        p = self.profile
        time.sleep(p.params * 16 / (p.mem_bw * p.bw_eff * self.gpus) * self.time_scale)
        self.version += 1
        return {"version": self.version, "grad_norm": 0.0, "seconds": time.perf_counter() - t0}

    def save_checkpoint(self, path: str) -> None:
        """Only the optimizer-step count is simulated state."""
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "sim_trainer.json").write_text(json.dumps({"version": self.version}))

    def load_checkpoint(self, path: str) -> None:
        """Restore the optimizer-step count."""
        self.version = json.loads((Path(path) / "sim_trainer.json").read_text())["version"]

    def named_weights(self) -> dict:
        """No tensors: the sim engine sleeps the broadcast time when it loads."""
        return {}

    def save(self, out: str) -> str:
        """Write a note saying what was simulated (there is no model to save)."""
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "simulated.json").write_text(json.dumps(
            {"simulated": True, "policy_version": self.version, "gpus": self.gpus,
             "profile": self.profile.model_dump()}, indent=2))
        return out
