"""Models as streamrl's workers load them: transformers' own Hub kernels are never taken (from
5.25 it swaps layers for kernels it downloads, at load and again at each ``train()``; offline, on a
GPU, that failed the engine's and the trainer's build)."""

from __future__ import annotations

import torch

from streamrl.algorithms.grpo import GRPO, GRPOConfig
from streamrl.api import EngineCapabilities, TrainerContext
from streamrl.engines.hf import HFEngine, HFEngineConfig
from streamrl.models import pretrained
from streamrl.training.critic import Critic
from streamrl.training.trainer import HFTrainer, HFTrainerConfig


def test_engine_trainer_and_critic_models_load_without_transformers_hub_kernels(tiny_model):
    engine = HFEngine(HFEngineConfig(batching="static", profile=False))
    engine.load(str(tiny_model))
    trainer = HFTrainer(HFTrainerConfig(lr=1e-2), TrainerContext(str(tiny_model), GRPO(GRPOConfig()),
                                                                  EngineCapabilities(temperature=0.7)))
    critic = Critic(str(tiny_model), lr=1e-3)
    policy = pretrained.causal_lm(str(tiny_model), torch.float32)
    policy.train()  # (transformers kernelizes again on a mode change, where kernels are on)
    for what, model in [("engine", engine.model), ("trainer", trainer.model), ("critic", critic.backbone),
                        ("loaded", policy)]:
        assert model.use_kernels is False, what
