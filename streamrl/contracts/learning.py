"""Learning: the ``algorithm`` and ``trainer`` contracts.

Plugins import these from ``streamrl.api``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel

from streamrl.contracts.generation import EngineCapabilities
from streamrl.sample import Group

if TYPE_CHECKING:  # torch is imported only where tensors are used
    import torch


class Algorithm:
    """Advantages and a policy-gradient loss (runs inside the trainer).

    Shapes: ``B`` samples of a micro-batch, ``T`` the padded sequence length minus one. Token
    tensors are float32 and aligned so that position ``t`` holds the log-probability of token
    ``t + 1``; ``mask[b, t]`` is 1 on response tokens.
    """

    needs_reference: bool = False
    """True: the trainer keeps a frozen copy of the initial policy and passes its logprobs as
    ``ref`` (e.g. for a KL penalty); False: ``ref`` is None."""
    needs_critic: bool = False
    """True: the trainer keeps a critic (a value model trained beside the policy) and gets the
    advantages from :meth:`token_advantages` instead of :meth:`advantages`, and a value loss
    from :meth:`value_loss`."""
    critic_warmup_steps: int = 0
    """With a critic: optimizer steps at the start in which only the critic learns."""
    zero_advantage_no_gradient: bool = False
    """True when a sample whose advantage is exactly 0 adds nothing to the loss's gradient (no
    KL, entropy or value term): the trainer then skips its forward/backward -- the same update
    for less work (GRPO groups whose samples all got the same reward). Its stats count it as a
    sample with zero loss."""
    min_group_size: int = 1
    """Fewest samples per prompt (``trainer.samples_per_prompt``) the advantages need. 2 for a
    group baseline (GRPO, RLOO, Dr. GRPO, REINFORCE++'s group mean): a sample alone in its group
    is its own baseline, its advantage is 0 and nothing is learned -- a recipe that asks for
    fewer is refused at validation."""
    pairs: bool = False
    """True when the loss pairs samples of a group by their advantages (DPO's chosen and
    rejected): an agent's rollout split into several segments then takes part with its last
    segment alone, the one that ends with its answer. False: every segment of a rollout
    trains with the rollout's advantage."""
    epochs: int = 1
    """Optimizer steps per batch of samples. The first pass streams as groups are scored; later
    passes go over the whole batch again and see samples one more update old each time, so
    ``loss`` must stay valid off-policy (a clipped ratio to ``old`` is)."""

    def advantages(self, rewards: list[float]) -> list[float]:
        """One advantage per rollout of a group, from the group's rewards (same order). An
        agent's rollout split into segments is one rollout here, with one reward: its segments
        are not baselines of each other."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """State that changes during a run (e.g. running statistics), for checkpoints."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (a resumed run)."""

    def loss(self, new: "torch.Tensor", old: "torch.Tensor", ref: "torch.Tensor | None",
             adv: "torch.Tensor", mask: "torch.Tensor") -> tuple["torch.Tensor", dict[str, "torch.Tensor"]]:
        """``(per_sample [B], stats)`` from the policy's logprobs ``new [B, T]`` (with grad), the
        generating policy's ``old [B, T]``, the reference's ``ref [B, T]`` or None, advantages
        ``adv [B]`` and the response ``mask [B, T]``.

        The trainer backpropagates ``sum(per_sample) / samples in the batch``, so per-sample
        losses are averaged over the batch however it is cut into micro-batches. How tokens
        reduce into a sample is yours: ``sum_t(l * mask) / sum_t(mask)`` is a sequence-level mean
        (GRPO); ``sum_t(l * mask) / L`` with a constant ``L`` is a token-level loss (Dr. GRPO).

        ``stats`` are per-sample sums (scalars); each key ``<name>_sum`` is reported in
        ``metrics.jsonl`` as ``<name>`` averaged over samples. Reported by default (missing keys
        are fine): ``clip_frac_sum``, ``kl_sum``, ``behaviour_weight_sum``. One key is not a
        sum: ``"token_flags"`` (``algorithms.off_policy.TOKEN_FLAGS``), bool ``[B, T]`` tensors
        ``clipped`` / ``truncated`` / ``masked`` that the trainer counts by token staleness in
        the record's ``offpolicy/...`` fields. ``adv`` is ``[B, T]`` instead when the algorithm
        has a critic.
        """
        raise NotImplementedError

    def token_advantages(self, rewards: "torch.Tensor", values: "torch.Tensor",
                         mask: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
        """With a critic: ``(advantages [B, T], returns [B, T])`` from the sequence rewards
        ``[B]`` and the critic's ``values [B, T]`` (detached), e.g. GAE."""
        raise NotImplementedError(f"{type(self).__name__} has no critic")

    def value_loss(self, values: "torch.Tensor", old_values: "torch.Tensor", returns: "torch.Tensor",
                   mask: "torch.Tensor") -> "torch.Tensor":
        """With a critic: the per-sample value loss ``[B]`` (it is summed and scaled by
        1 / samples like the policy loss)."""
        raise NotImplementedError(f"{type(self).__name__} has no critic")


@dataclass
class TrainerContext:
    """What a trainer's factory gets besides its config: ``factory(config, context)``."""

    model_path: str | None
    """The policy model folder (``from_pretrained``), None when the recipe has none."""
    algorithm: Algorithm
    """The recipe's algorithm, built."""
    engine: EngineCapabilities
    """What the recipe's engine declares (:meth:`Engine.capabilities`): divide logits by
    ``engine.temperature``."""
    seed: int = 0
    """``run.seed``."""
    sharded: bool = False
    """The trainer will be sharded over the train pool (:meth:`Trainer.shard`): keep the model
    off the device until then (``fully_shard`` moves each rank's shard there), so a model
    that does not fit one device can still be built."""
    learner: str = ""
    """A side learner's name (``[[learners]]``), empty for the run's main learner. Side learners
    may share a worker (``worker`` in their tables): a LoRA trainer there shares the process's
    copy of the base weights with the others, its adapter named after its learner."""


@dataclass(frozen=True)
class TrainerCapabilities:
    """What a trainer declares about itself before it is built (:meth:`Trainer.capabilities`).
    The defaults describe a trainer of a real model on one train worker."""

    needs_model: bool = True
    """False for a trainer that needs no ``[model]`` (a simulator)."""
    data_parallel: bool = False
    """True: the trainer can train on several train workers at once (``pools.train.workers >
    1``): streamrl joins them in one ``torch.distributed`` group before the run, gives each its
    share of the micro-batches, and runs ``step()`` on every rank together, which must then sum
    the gradients over the group (the ``hf`` trainer does)."""
    shardable: bool = False
    """True: the trainer implements :meth:`Trainer.shard`, so it can run with ``trainer.strategy
    = "fsdp"`` over several train workers (with ``data_parallel``)."""
    adapter: bool = False
    """True: the trainer trains a LoRA adapter over frozen base weights, and publishes the adapter
    alone to an engine that holds adapters (``EngineCapabilities.adapters``;
    ``contracts/adapters.py``). A served learner's variant is then one more adapter in the
    generate pool's engines, not an engine of its own."""

    def refuses(self, name: str, workers: int, strategy: str) -> str:
        """Why trainer ``name`` cannot train on a train pool of ``workers`` with
        ``trainer.strategy = strategy`` (one line naming the field), or "" when it can. Checked
        before the cluster starts where the recipe sets the pool's size, and against the workers
        there are on a cluster someone else started."""
        if workers > 1 and not self.data_parallel:
            return (f"pools.train.workers: trainer {name!r} trains on one worker; "
                    f"set pools.train.workers = 1 (got {workers})")
        if workers > 1 and strategy == "fsdp" and not self.shardable:
            return f'trainer.strategy: trainer {name!r} cannot shard its state; set trainer.strategy = "ddp"'
        return ""


@dataclass(frozen=True)
class TrainerFootprint:
    """What a built trainer holds, as benchmarks report it (:meth:`Trainer.footprint`). The
    defaults describe a trainer with no model (a simulator)."""

    device: str = "cpu"
    """Where it computes (``cuda`` or ``cpu``)."""
    precision: str | None = None
    """The precision it trains in (``fp32``, ``bf16-autocast``, ...; ``auto`` resolved), None
    when that does not apply."""
    parameters: int = 0
    """The policy's parameters (the whole model's, sharded or not)."""
    vocab_size: int | None = None
    """The policy's vocabulary (token ids below it are valid), None without a model."""
    params_bytes: int = 0
    """Bytes of trained parameters this rank holds (policy and critic; a shard's local part only)."""
    optimizer_bytes: int = 0
    """Bytes of optimizer state this rank holds (a shard's local part only)."""


class Trainer:
    """The policy being trained and its optimizer, on the train worker.

    Gradients accumulate over :meth:`micro_batch` calls until :meth:`step`; each micro-batch's
    loss is scaled by ``scale = 1 / samples in the batch``, so the update does not depend on how
    the batch was cut or in what order the pieces arrived (``stream`` equals ``batch``).
    """

    version: int = 0
    """Policy version: the number of optimizer steps taken."""

    @classmethod
    def capabilities(cls, config: BaseModel) -> TrainerCapabilities:
        """What the trainer declares for its validated ``config``, before it is built (a model,
        data parallel, sharding). Default: :class:`TrainerCapabilities` as it is."""
        return TrainerCapabilities()

    def micro_batch(self, groups: list[Group], scale: float) -> dict[str, float]:
        """Forward/backward on whole groups. Returns sums over the samples: ``samples``,
        ``tokens`` (response tokens), ``reward_sum``, ``loss_sum``, ``seconds``, and the
        algorithm's ``*_sum`` stats (the train task adds them up into a
        ``telemetry.stats.TrainTaskStats``)."""
        raise NotImplementedError

    def step(self) -> dict[str, float]:
        """One optimizer step; returns ``version`` (the new one), ``grad_norm``, ``seconds``, and
        anything else to record (read into a ``telemetry.stats.StepStats``)."""
        raise NotImplementedError

    def named_weights(self) -> dict[str, "torch.Tensor"]:
        """The parameters a transfer sends to the engines (empty for a simulator)."""
        raise NotImplementedError

    sharded: bool = False
    """True once :meth:`shard` has run."""

    def shard(self) -> None:
        """Optional (``trainer.strategy = "fsdp"``, for a trainer declaring ``shardable=True``):
        called on every rank together once the train pool's process group is joined, before any
        step: split parameters, gradients and optimizer state over the group and set
        :attr:`sharded`. From then on every forward/backward is a collective: streamrl pairs the
        ranks' :meth:`micro_batch` calls (a rank with nothing to train gets ``groups = []`` and
        must still take part), and runs :meth:`step`, :meth:`save_checkpoint`,
        :meth:`load_checkpoint` and :meth:`save` on every rank together."""
        raise NotImplementedError(f"{type(self).__name__} cannot shard its state")

    def save_checkpoint(self, path: str) -> None:
        """Optional: write everything needed to continue training exactly (weights, optimizer,
        schedules, RNG states) into the folder ``path``. streamrl writes it into a temporary
        folder and renames it when the controller's state is beside it."""
        raise NotImplementedError(f"{type(self).__name__} cannot write checkpoints")

    def load_checkpoint(self, path: str) -> None:
        """Optional: restore what :meth:`save_checkpoint` wrote into this freshly built trainer."""
        raise NotImplementedError(f"{type(self).__name__} cannot load checkpoints")

    def logprobs(self, group: Group) -> list[list[float]]:
        """Optional: each response's token logprobs under the current weights (consistency
        checks)."""
        raise NotImplementedError(f"{type(self).__name__} does not recompute logprobs")

    def save(self, out: str) -> str:
        """Write the policy to folder ``out`` (a transformers model folder for real models)."""
        raise NotImplementedError

    def footprint(self) -> TrainerFootprint:
        """Optional: device, precision, model size and the training state held, for benchmarks
        (``streamrl bench trainer``, ``bench trainpool``). Default: :class:`TrainerFootprint` as
        it is (no model)."""
        return TrainerFootprint()

    def close(self) -> None:
        """Release the model and optimizer."""
