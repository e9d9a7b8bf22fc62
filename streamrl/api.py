"""Everything a plugin touches, in one import: ``from streamrl.api import ...``.

A *component* is a named, configurable piece a recipe picks by name. There are nine kinds; each
has a base class here with its contract in typed methods, documented optional capabilities
(with the default streamrl uses when you do not override them) and ``close()``. Subclassing the
base class is the easy way to get the defaults; streamrl never probes objects with ``getattr``.

================  =====================  ==============================  ======================
kind              recipe section         base class                      lives on
================  =====================  ==============================  ======================
``task``          ``[task]``             :class:`Task`                   the ``streamrl`` process
``engine``        ``[engine]``           :class:`Engine`                 each generate worker
``reward``        ``[reward]``           :class:`Reward`                 each reward worker
``algorithm``     ``[algorithm]``        :class:`Algorithm`              inside the trainer
``trainer``       ``[trainer]``          :class:`Trainer`                the train worker
``transfer``      ``[transfer]``         :class:`Transfer`               train and generate workers
``metric_sink``   ``[[metrics]]``        :class:`MetricSink`             the ``streamrl`` process
``ranker``        ``[ranker]``           :class:`Ranker`                 the rank worker
``scheduler``     ``[scheduler]``        :class:`Scheduler`              the ``streamrl`` process
================  =====================  ==============================  ======================

Components built on workers are shipped there by value (cloudpickle), so a component defined
in a file next to the recipe works without installing anything; an installed package must be
installed wherever workers run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from pydantic import BaseModel

from streamrl import hookimpl
from streamrl.sample import Group, Prompt, Sample

if TYPE_CHECKING:  # torch is imported only where tensors are used
    import torch

#: The kinds of component, each with the hook that registers it and the recipe section naming it.
KINDS = {
    "algorithm": "register_algorithms",
    "engine": "register_engines",
    "reward": "register_rewards",
    "task": "register_tasks",
    "trainer": "register_trainers",
    "transfer": "register_transfers",
    "metric_sink": "register_metric_sinks",
    "ranker": "register_rankers",
    "scheduler": "register_schedulers",
}


@dataclass(frozen=True)
class Component:
    """A named, configurable piece handed over by a plugin's ``register_*`` hook.

    ``config`` is a pydantic model validating the component's recipe section (every key but
    ``name``); ``factory(config)`` builds the object (a trainer's factory also gets a
    :class:`TrainerContext`). ``plugin`` is filled in by streamrl.
    """

    kind: str
    name: str
    config: type[BaseModel]
    factory: Callable[..., Any]
    plugin: str = field(default="", compare=False)

    def validate(self, section: dict, path: str) -> BaseModel:
        """The recipe table at TOML ``path`` validated by :attr:`config` (one-line errors)."""
        from streamrl.recipe import validate_section

        return validate_section(self.config, section, path)

    def declared(self, base: type, name: str, default: Any) -> Any:
        """Class-level capability ``name`` of ``base`` (e.g. ``Engine.needs_model``) as the
        factory declares it, when the factory is a subclass of ``base``; else ``default``
        (a factory that is a plain function gets the base class's defaults)."""
        f = self.factory
        return getattr(f, name) if isinstance(f, type) and issubclass(f, base) else default

    def build(self, section: dict, path: str, *args) -> Any:
        """Validate ``section`` and build the component (``args`` follow the config)."""
        return self.factory(self.validate(section, path), *args)


# -- prompts and rewards ----------------------------------------------------------------------

class Task:
    """The prompt source of a run (runs in the ``streamrl`` process).

    ``prompts(step, n)`` must be deterministic in its config (``seed``) and ``step``, so a run
    can be repeated. A config field named ``seed`` that the recipe leaves unset gets ``run.seed``.
    """

    alphabet: str = ""
    """Characters of the task's text; with :meth:`example`, lets ``streamrl model init`` make a
    tiny character-level model for the task. Empty: the task cannot make one."""

    def prompts(self, step: int, n: int) -> list[Prompt]:
        """The ``n`` prompts of ``step``; every ``Prompt.uid`` unique within the run."""
        raise NotImplementedError

    def example(self, rng) -> tuple[str, str]:
        """One ``(prompt text, answer text)`` pair drawn with ``rng`` (``random.Random``), for
        the supervised warm start of ``streamrl model init``."""
        raise NotImplementedError(f"{type(self).__name__} cannot make examples for a tiny model")

    def max_prompt_chars(self) -> int:
        """Longest prompt in characters (sizes a tiny model's context)."""
        return 16

    def max_response_chars(self) -> int:
        """Longest answer in characters (sizes a tiny model's context)."""
        return 8

    def close(self) -> None:
        """Release resources at the end of the run."""


class Reward:
    """Scores one response (runs in reward tasks on the reward pool).

    Must be thread-safe: a reward worker runs several tasks at once. A reward that raises, or
    returns something that is not a finite number, scores that sample 0 and is counted in
    ``reward_errors``; the run goes on.
    """

    def score(self, prompt: Prompt, response: str) -> float:
        """The reward of ``response`` (decoded text) to ``prompt`` (``prompt.answer`` holds what
        the task put there to check it)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release resources (a reward model, a sandbox) when the worker shuts down."""


# -- generation --------------------------------------------------------------------------------

class Engine:
    """An inference engine, one per generate worker.

    Generate tasks call :meth:`generate` from several threads at once (one per task slot of the
    worker); the engine batches concurrent requests itself.
    """

    needs_model: bool = True
    """False for engines that need no ``[model]`` (a simulator)."""
    version: int = 0
    """Policy version of the weights the engine generates with (0 = the initial model)."""

    @classmethod
    def sampling_temperature(cls, config: BaseModel) -> float:
        """The temperature the engine samples at; the trainer divides its logits by the same
        value so engine and trainer logprobs agree. Default 1.0."""
        return 1.0

    @classmethod
    def simulated_time_scale(cls, config: BaseModel) -> float | None:
        """For a simulated engine: real seconds per simulated second (reports then say
        SIMULATED and give simulated rates). None (the default): a real engine."""
        return None

    def load(self, model_path: str | None) -> None:
        """Load the model (``from_pretrained``) and start generating. ``None`` when the recipe
        has no model (only for ``needs_model = False``)."""
        raise NotImplementedError

    def generate(self, prompt: Prompt, n: int, priority: float = 0.0) -> Group:
        """``n`` samples of ``prompt``, with per-token logprobs and ``policy_version`` set;
        blocks until all are done. Higher ``priority`` is admitted first when requests queue."""
        raise NotImplementedError

    def generate_groups(self, prompts: list[Prompt], n: int, priorities: list[float]) -> list[Group]:
        """One group of ``n`` samples per prompt (``pools.generate.groups_per_task`` > 1). The
        default calls :meth:`generate` for every prompt at once, from one thread each, so the
        engine batches them as it batches concurrent tasks; override to submit them directly."""
        if len(prompts) == 1:
            return [self.generate(prompts[0], n, priorities[0])]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(prompts), thread_name_prefix="streamrl-generate") as pool:
            return list(pool.map(lambda p, pr: self.generate(p, n, pr), prompts, priorities))

    def load_weights(self, named_tensors: dict[str, "torch.Tensor"], version: int) -> None:
        """Overwrite the parameters in place (names as in ``model.named_parameters()``) and set
        :attr:`version`. streamrl calls it one load at a time, only with newer versions."""
        raise NotImplementedError

    def decode_latency(self) -> Callable[[float], float] | None:
        """Optional: a picklable function giving the seconds of one decode step from the running
        batch's total context tokens (a scheduler estimates makespans with it). Default None."""
        return None

    def close(self) -> None:
        """Stop generating; requests still waiting must fail, never hang."""


class Transfer:
    """Moves new weights from the trainer to every engine after each optimizer step.

    One object is built on the train worker and one on each generate worker. streamrl orders the
    work (export after the step, loads after the export), gives it priority over generation,
    checks versions (an engine never goes back to older weights) and calls
    ``engine.load_weights`` itself: a transfer only moves tensors.
    """

    receivers: int = 1
    """How many generate workers will call :meth:`receive` for each version; streamrl sets it on
    the train worker's object before every :meth:`send` (a collective needs the group's size).
    ``receive`` is called for every version on every generate worker, even one the engine will
    skip for a newer one, so a collective never waits for a member that is not coming."""

    def send(self, weights: dict[str, "torch.Tensor"], version: int) -> Any:
        """Train worker: the trainer's parameters (may be on a GPU). Return a payload that Dask
        carries to every generate worker (bytes, CPU tensors, or a small token when the tensors
        travel another way)."""
        raise NotImplementedError

    def receive(self, payload: Any, version: int) -> dict[str, "torch.Tensor"]:
        """Generate worker: turn the payload back into named tensors for the engine."""
        raise NotImplementedError

    def close(self) -> None:
        """Release connections or process groups when the worker shuts down."""


# -- learning ---------------------------------------------------------------------------------

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
    epochs: int = 1
    """Optimizer steps per batch of samples. The first pass streams as groups are scored; later
    passes go over the whole batch again and see samples one more update old each time, so
    ``loss`` must stay valid off-policy (a clipped ratio to ``old`` is)."""

    def advantages(self, rewards: list[float]) -> list[float]:
        """One advantage per sample of a group, from the group's rewards (same order)."""
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
        are fine): ``clip_frac_sum``, ``kl_sum``, ``behaviour_weight_sum``. ``adv`` is ``[B, T]``
        instead when the algorithm has a critic.
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
    temperature: float
    """The engine's sampling temperature (divide logits by it)."""
    engine_config: BaseModel
    """The engine's validated config (a simulated trainer reads its cost model from it)."""
    seed: int = 0
    """``run.seed``."""
    sharded: bool = False
    """The trainer will be sharded over the train pool (:meth:`Trainer.shard`): keep the model
    off the device until then (``fully_shard`` moves each rank's shard there), so a model
    that does not fit one device can still be built."""


class Trainer:
    """The policy being trained and its optimizer, on the train worker.

    Gradients accumulate over :meth:`micro_batch` calls until :meth:`step`; each micro-batch's
    loss is scaled by ``scale = 1 / samples in the batch``, so the update does not depend on how
    the batch was cut or in what order the pieces arrived (``stream`` equals ``batch``).
    """

    needs_model: bool = True
    """False for trainers that need no ``[model]`` (a simulator)."""
    version: int = 0
    """Policy version: the number of optimizer steps taken."""

    @classmethod
    def colocated_overrides(cls, config: BaseModel, generate_workers: int) -> list[str]:
        """``--set`` overrides that give the ``colocated`` variant of a recipe (in ``streamrl
        bench modes``) as many devices as the disaggregated one. Default none: real train
        workers generate too. A simulator whose devices are virtual adds them here."""
        return []

    def micro_batch(self, groups: list[Group], scale: float) -> dict[str, float]:
        """Forward/backward on whole groups. Returns sums over the samples: ``samples``,
        ``tokens`` (response tokens), ``reward_sum``, ``loss_sum``, ``seconds``, and the
        algorithm's ``*_sum`` stats."""
        raise NotImplementedError

    def step(self) -> dict[str, float]:
        """One optimizer step; returns ``version`` (the new one), ``grad_norm``, ``seconds``."""
        raise NotImplementedError

    def named_weights(self) -> dict[str, "torch.Tensor"]:
        """The parameters a transfer sends to the engines (empty for a simulator)."""
        raise NotImplementedError

    data_parallel: bool = False
    """True: the trainer can train on several train workers at once (``pools.train.workers >
    1``): streamrl joins them in one ``torch.distributed`` group before the run, gives each its
    share of the micro-batches, and runs ``step()`` on every rank together, which must then sum
    the gradients over the group (the ``hf`` trainer does)."""

    sharded: bool = False
    """True once :meth:`shard` has run."""

    def shard(self) -> None:
        """Optional (``trainer.strategy = "fsdp"``): called on every rank together once the train
        pool's process group is joined, before any step: split parameters, gradients and
        optimizer state over the group and set :attr:`sharded`. From then on every forward/backward
        is a collective: streamrl pairs the ranks' :meth:`micro_batch` calls (a rank with nothing to
        train gets ``groups = []`` and must still take part), and runs :meth:`step`,
        :meth:`save_checkpoint`, :meth:`load_checkpoint` and :meth:`save` on every rank together."""
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

    def close(self) -> None:
        """Release the model and optimizer."""


# -- length ranking and dispatch ----------------------------------------------------------------

class Ranker:
    """Predicts which prompts will have long outputs (StreamRL's output-length ranker).

    Lives on one worker for the whole run (the ``rank`` pool, else the first reward worker), so
    it may keep state. Its recall of the longest 20% is logged every step (``ranker_recall``).
    """

    def predict(self, prompts: list[Prompt]) -> list[float]:
        """One score per prompt, higher = longer output (any scale)."""
        raise NotImplementedError

    def observe(self, prompts: list[Prompt], lengths: list[list[int]]) -> None:
        """After a step: each prompt's observed output lengths (one per sample)."""

    def close(self) -> None:
        """Release resources."""


@dataclass
class Assignment:
    """Where and how one prompt group is generated (what a scheduler returns per prompt)."""

    index: int
    """Position of the prompt in the list given to ``dispatch``."""
    worker: str
    """Name of the generate worker (engine instance), one of ``workers``."""
    priority: float = 0.0
    """Higher is admitted first by the engine."""


@dataclass
class DispatchContext:
    """What a scheduler knows when it dispatches a step."""

    samples_per_prompt: int
    """Samples generated per prompt (requests per group)."""
    observed_lengths: list[int] = field(default_factory=list)
    """Output lengths seen so far in the run (all samples, most recent 8192), for estimates."""
    prompt_tokens: float = 0.0
    """Typical prompt length in tokens (mean over the last step)."""
    step_latency: Callable[[float], float] | None = None
    """Seconds of one decode step given the running batch's total context tokens (from
    :meth:`Engine.decode_latency`); None when the engine has no profile."""


class Scheduler:
    """Places a step's prompt groups on generate workers and orders them (on the client)."""

    def dispatch(self, prompts: list[Prompt], scores: list[float], workers: list[str],
                 ctx: DispatchContext) -> list[Assignment]:
        """One :class:`Assignment` per prompt: ``scores`` are the ranker's (all 0.0 without
        one), ``workers`` the generate workers' names."""
        raise NotImplementedError

    def metrics(self) -> dict[str, float]:
        """Optional: numbers about the last dispatch, merged into the step's metrics record."""
        return {}

    def close(self) -> None:
        """Release resources."""


# -- observing --------------------------------------------------------------------------------

class MetricSink:
    """Receives every step's metrics record in the ``streamrl`` process (``metrics.jsonl`` is
    always written besides). A sink that raises is reported and dropped; the run goes on."""

    def open(self, run_dir: Path) -> None:
        """Called once before the first step with the run folder."""

    def write(self, record: dict) -> None:
        """One step's record (the same dict as a ``metrics.jsonl`` line)."""
        raise NotImplementedError

    def close(self) -> None:
        """Called once at the end of the run, also after a failure."""


__all__ = [
    "KINDS", "Component", "hookimpl", "Prompt", "Sample", "Group",
    "Task", "Reward", "Engine", "Transfer", "Algorithm", "Trainer", "TrainerContext",
    "Ranker", "Scheduler", "Assignment", "DispatchContext", "MetricSink",
]
