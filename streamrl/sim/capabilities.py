"""What the simulator declares beyond every engine's and trainer's capabilities: its cost model.

Real engines and trainers never see these. The ``sim`` engine's capabilities carry the cost
model, so the ``sim`` trainer reads it from its context (``context.engine``) and ``streamrl
bench`` and ``streamrl plan`` read it from the recipe (``Chosen.capabilities()``): a recipe
whose engine declares :class:`SimEngineCapabilities` is simulated, and one whose trainer
declares :class:`SimTrainerCapabilities` trains on virtual devices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from streamrl.api import EngineCapabilities, TrainerCapabilities
from streamrl.sim.latency import Profile


@dataclass(frozen=True)
class SimEngineCapabilities(EngineCapabilities):
    """The ``sim`` engine: no model, and the cost model every simulated time comes from."""

    needs_model: bool = False
    """A simulator loads no model."""
    profile: Profile = field(default_factory=Profile, kw_only=True)
    """The simulated model and device of each instance (``[engine.profile]``)."""
    time_scale: float = field(kw_only=True)
    """Real seconds per simulated second: reports say SIMULATED and give simulated rates."""
    seed: int = field(default=0, kw_only=True)
    """Seed of the sampled output lengths, so the planner draws the lengths the engine will."""


@dataclass(frozen=True)
class SimTrainerCapabilities(TrainerCapabilities):
    """The ``sim`` trainer: no model, and training devices that are virtual (``trainer.gpus``)."""

    needs_model: bool = False
    """A simulator trains no model."""
    gpus: int = field(kw_only=True)
    """Simulated training GPUs behind the one train worker: the recipe's train devices."""
    device: Profile | None = field(default=None, kw_only=True)
    """The training devices when another class of hardware than the engine's (None: the same)."""

    def resize(self, gpus: int) -> list[str]:
        """``--set`` overrides that give the trainer ``gpus`` virtual training GPUs."""
        return [f"trainer.gpus={gpus}"]

    def colocated_overrides(self, generate_workers: int) -> list[str]:
        """``--set`` overrides for the ``colocated`` variant on as many devices: ``G`` instances +
        ``T`` training GPUs become ``G + T - 1`` generate workers plus the train worker (``G + T``
        instances), training on ``G + T`` GPUs (a real train worker generates too; a virtual
        device must be added)."""
        g, t = generate_workers, self.gpus
        return [f"pools.generate.workers={g + t - 1}", *self.resize(g + t)]
