"""The ``hf`` engine: a transformers model sampling with per-token logprobs, on CPU or GPU.

Four variants share this base (model and tokenizer loading, weight loads, encoding, the decode
latency profile, closing) and, for the two batching ones, the priority queue of requests
(``engines/request_queue.py``); the recipe picks one with ``batching`` and ``reproducible``:

- ``engines/continuous.py``: transformers' continuous batching, requests join the running batch
  at any decode step (the default);
- ``engines/static.py``: the requests waiting when a batch starts are decoded together as one
  padded batch;
- ``engines/slots.py``: streamrl's own decode loop over fixed request slots and a static KV
  cache, one captured CUDA graph per decode step on a GPU;
- ``engines/seeded.py`` (``reproducible = true``): each group decoded alone with its own seeded
  random generator, so a seed gives the same samples every run.

``HFEngine(config)`` builds the variant ``config`` asks for: it is the factory the recipe's
``[engine] name = "hf"`` is registered with, and its :meth:`HFEngine.capabilities` is read before
any engine is built. This module and the config (``engines/hf_config.py``) import no torch: the
``streamrl`` process registers and validates the engine but never generates, so it starts without
torch; the variants are imported when one is built, on a generate worker.
"""

from __future__ import annotations

from streamrl.api import Engine, EngineCapabilities
from streamrl.engines.hf_config import HFEngineConfig, kv_capacity_tokens

__all__ = ["HFEngine", "HFEngineConfig"]


class HFEngine(Engine):
    """The ``hf`` engine as a recipe names it: ``HFEngine(config)`` builds the variant
    ``config`` asks for (:meth:`variant`). To extend the engine, subclass a variant or
    ``engines.base.TransformersEngine``."""

    def __new__(cls, config: HFEngineConfig):
        # The registered factory is this class (Component.capabilities reads a class's own
        # capabilities before anything is built); building it builds the variant, which is not
        # an HFEngine, so Python does not run __init__ a second time.
        return cls.variant(config)(config)

    @staticmethod
    def variant(config: HFEngineConfig) -> type[Engine]:
        """The engine class ``config`` asks for: seeded when ``reproducible`` (whatever
        ``batching`` says), else continuous, static or slot batching."""
        if config.reproducible:
            from streamrl.engines.seeded import SeededEngine

            return SeededEngine
        if config.batching == "static":
            from streamrl.engines.static import StaticEngine

            return StaticEngine
        if config.batching == "slots":
            from streamrl.engines.slots import SlotEngine

            return SlotEngine
        from streamrl.engines.continuous import ContinuousEngine

        return ContinuousEngine

    @classmethod
    def capabilities(cls, config: HFEngineConfig) -> EngineCapabilities:
        """``engine.temperature`` (the trainer divides its logits by it), ``max_running``,
        ``max_new_tokens`` (and ``max_prompt_tokens``: slot batching's slots hold no more), the KV cache's tokens when the config fixes them
        (:func:`~streamrl.engines.hf_config.kv_capacity_tokens`), and whether a seed repeats the
        samples (``reproducible``); every variant decodes greedily for evaluation, and slot
        batching streams each response's tokens (``streams``: an endpoint serves from it) and can
        hand a running sample to another instance (``moves_samples``); every variant holds
        ``adapters`` LoRA adapters."""
        return EngineCapabilities(temperature=config.temperature, max_running=config.max_running,
                                  max_new_tokens=config.max_new_tokens,
                                  max_prompt_tokens=config.max_prompt_tokens if config.batching == "slots" else None,
                                  kv_capacity_tokens=kv_capacity_tokens(config),
                                  repeatable=config.reproducible, greedy=True,
                                  stops_early=config.stop_early_every > 0,
                                  streams=config.batching == "slots" and not config.reproducible,
                                  moves_samples=config.batching == "slots" and not config.reproducible,
                                  adapters=config.adapters)
