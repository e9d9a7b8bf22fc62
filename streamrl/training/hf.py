"""The factory the recipe's ``[trainer] name = "hf"`` is registered with.

It imports no torch: the ``streamrl`` process registers the trainer and reads its capabilities
but never trains, so it starts without torch. The trainer (``training/trainer.py``) is imported
when one is built, on a train worker.
"""

from __future__ import annotations

from streamrl.api import Trainer, TrainerCapabilities, TrainerContext
from streamrl.training import hf_config
from streamrl.training.hf_config import HFTrainerConfig

__all__ = ["HFTrainerConfig", "HFTrainerFactory"]


class HFTrainerFactory(Trainer):
    """``HFTrainerFactory(config, context)`` builds an
    :class:`~streamrl.training.trainer.HFTrainer`. The registered factory is this class, not the
    trainer's, so that :meth:`capabilities` can be read without importing torch; to extend the
    trainer, subclass ``HFTrainer``."""

    def __new__(cls, config: HFTrainerConfig, context: TrainerContext, *args):
        # what is built is an HFTrainer, not an instance of this class, so Python does not run
        # __init__ on it a second time
        from streamrl.training.trainer import HFTrainer

        return HFTrainer(config, context, *args)

    @classmethod
    def capabilities(cls, config: HFTrainerConfig) -> TrainerCapabilities:
        """Data parallel over the train pool (``ddp``), and shardable (``fsdp``)."""
        return hf_config.capabilities(config)
