"""Generation and weights: the ``engine`` and ``transfer`` contracts.

Plugins import these from ``streamrl.api``."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

from pydantic import BaseModel

from streamrl.sample import Group, Prompt, Sample

if TYPE_CHECKING:  # torch is imported only where tensors are used
    import torch


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine declares about itself before any is built (:meth:`Engine.capabilities`).

    streamrl reads it in the ``streamrl`` process to check the recipe, to tell the trainer the
    sampling temperature and to plan; the defaults describe an ordinary engine that loads a
    model. A simulator declares a subclass with its cost model (``streamrl/sim``)."""

    needs_model: bool = True
    """False for an engine that needs no ``[model]`` (a simulator)."""
    temperature: float = 1.0
    """The temperature the engine samples at; the trainer divides its logits by the same value
    so engine and trainer logprobs agree."""
    max_running: int = 0
    """Most requests decoding at once on one engine (0: no cap but the KV cache); ``streamrl
    plan`` models the engine's batch with it."""
    kv_capacity_tokens: int = 0
    """Context tokens one engine's KV cache holds, when fixed by the config (0: not known before
    the engine starts; ``streamrl plan`` then takes it as unbounded)."""
    max_new_tokens: int | None = None
    """Most tokens the engine generates per response, when its config fixes it: streamrl checks
    that a prompt still fits the model's positions beside them (None: not checked)."""
    max_prompt_tokens: int | None = None
    """Longest prompt, in tokens, the engine takes, when its config fixes it (None: any that fits
    the model). A task whose config has a ``max_prompt_tokens`` the recipe leaves unset (the
    ``dataset`` task's) gets this one, so a longer row is left out with the data when the task is
    built instead of failing its step mid-run."""
    greedy: bool = False
    """True when the engine implements :meth:`Engine.generate_greedy` (held-out evaluation then
    decodes greedily; otherwise it samples)."""
    stops_early: bool = False
    """True when the engine watches each response as it is decoded and asks the reward's
    :meth:`~streamrl.api.Reward.stop_early` whether to end it there: the engine is then handed
    a reward of its own on its worker (:meth:`Engine.stop_early_with`)."""
    moves_samples: bool = False
    """True when the engine can hand a running sample over to another instance: it reports what
    runs (:meth:`Engine.requests_now`), takes a sample out with its tokens so far
    (:meth:`Engine.move_out`) and finishes one taken out of another instance
    (:meth:`Engine.continue_sample`). The ``longtail`` scheduler's straggler moves need it."""
    adapters: int = 0
    """How many LoRA adapters one engine holds at once over its base weights (0: none). A LoRA
    learner whose engine holds adapters publishes its adapter alone (``contracts/adapters.py``),
    which :meth:`Engine.load_weights` receives like weights; otherwise it publishes the merged
    weights."""
    streams: bool = False
    """True when the engine streams each response's tokens to its caller as they are decoded
    (``stream(rid, ids, max_new_tokens, on_tokens, ...)``, as ``hf`` with ``batching = "slots"``
    does). An endpoint is built on it, so ``[serve]`` recipes and agent tasks need it:
    ``streamrl recipe validate`` refuses them on an engine that does not stream."""
    repeatable: bool = False
    """True when a group's samples depend only on the weights, the seed and the prompt (not on
    timing or on which requests share a batch). The controller then makes the rest of the run
    repeatable too, in every mode: each step's generation sees a fixed policy version and the
    trainer takes micro-batches in a fixed order (``run.seed`` then gives the same run twice)."""


class Engine:
    """An inference engine, one per generate worker.

    Generate tasks call :meth:`generate` from several threads at once (one per task slot of the
    worker); the engine batches concurrent requests itself.
    """

    version: int = 0
    """Policy version of the weights the engine generates with (0 = the initial model)."""

    @classmethod
    def capabilities(cls, config: BaseModel) -> EngineCapabilities:
        """What the engine declares for its validated ``config``, before any is built (a model,
        the sampling temperature, ...). Default: :class:`EngineCapabilities` as it is."""
        return EngineCapabilities()

    def load(self, model_path: str | None) -> None:
        """Load the model (``from_pretrained``) and start generating. ``None`` when the recipe
        has no model (only for an engine declaring ``needs_model=False``)."""
        raise NotImplementedError

    def stop_early_with(self, reward) -> None:
        """Watch each response with ``reward`` (the run's reward, built on this worker): a
        response its ``stop_early(prompt, text so far)`` calls hopeless ends there. Called once,
        after :meth:`load`, on an engine whose capabilities say ``stops_early``."""
        raise NotImplementedError(f"{type(self).__name__} does not stop responses early")

    def generate(self, prompt: Prompt, n: int, priority: float = 0.0) -> Group:
        """``n`` samples of ``prompt``, with per-token logprobs and ``policy_version`` set;
        blocks until all are done. Higher ``priority`` is admitted first when requests queue."""
        raise NotImplementedError

    def generate_samples(self, prompt: Prompt, samples: list[int], priority: float = 0.0) -> Group:
        """The samples numbered ``samples`` of ``prompt``'s group: a chunk of it, when a scheduler
        splits a group over instances. Their uids are ``f"{prompt.uid}-{k}"`` for ``k`` in
        ``samples``, so the chunks of a group join without a clash. The default generates
        ``len(samples)`` and renumbers them; an engine whose samples depend on their number
        (a seeded one) overrides it."""
        group = self.generate(prompt, len(samples), priority)
        for s, k in zip(group, samples):
            s.uid = f"{prompt.uid}-{k}"
        return group

    def generate_movable(self, prompt: Prompt, samples: list[int], priority: float,
                         on_moved: Callable[[Sample], Any]) -> Group:
        """As :meth:`generate_samples`, for an engine that ``moves_samples``: when one of these
        samples is taken out (:meth:`move_out`), call ``on_moved(partial)`` at once with it (its
        tokens, logprobs and ``token_versions`` so far) and use ``on_moved(...).result()``, the
        sample finished elsewhere, in its place. ``on_moved`` must return quickly."""
        raise NotImplementedError(f"{type(self).__name__} cannot move samples between instances")

    def requests_now(self) -> "RequestsNow":
        """For an engine that ``moves_samples``: the task samples decoding now, and those that
        finished since the last call (a coordinator calls it a few times a second; it must be
        quick and safe from any thread)."""
        raise NotImplementedError(f"{type(self).__name__} cannot move samples between instances")

    def move_out(self, uid: str) -> bool:
        """For an engine that ``moves_samples``: take running sample ``uid`` out at the next
        decode step; the :meth:`generate_movable` call waiting for it hands it over. False when
        ``uid`` is not running here (it may still finish before it is taken: then it stays)."""
        raise NotImplementedError(f"{type(self).__name__} cannot move samples between instances")

    def continue_sample(self, partial: Sample, priority: float = 0.0) -> Sample:
        """For an engine that ``moves_samples``: finish ``partial``, a sample another instance
        took out, by prefilling its prompt and response so far and decoding the rest. The result
        keeps every earlier token, logprob and token version; its new tokens carry this engine's
        versions, and ``policy_version`` is the oldest of them all."""
        raise NotImplementedError(f"{type(self).__name__} cannot move samples between instances")

    def generate_groups(self, prompts: list[Prompt], n: int, priorities: list[float]) -> list[Group]:
        """One group of ``n`` samples per prompt (``pools.generate.groups_per_task`` > 1). The
        default calls :meth:`generate` for every prompt at once, from one thread each, so the
        engine batches them as it batches concurrent tasks; override to submit them directly."""
        if len(prompts) == 1:
            return [self.generate(prompts[0], n, priorities[0])]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(prompts), thread_name_prefix="streamrl-generate") as pool:
            return list(pool.map(lambda p, pr: self.generate(p, n, pr), prompts, priorities))

    def generate_greedy(self, prompts: list[Prompt]) -> list[Group]:
        """Optional, for held-out evaluation: one greedy (argmax) response per prompt, as groups
        of one. Declare ``EngineCapabilities(greedy=True)`` when you implement it."""
        raise NotImplementedError(f"{type(self).__name__} cannot decode greedily")

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


@dataclass
class RequestsNow:
    """What an engine is decoding now (:meth:`Engine.requests_now`), for a coordinator that moves
    stragglers between instances."""

    running: list[tuple[str, int, int, bool]]
    """``(sample uid, response tokens so far, prompt tokens, movable)`` of each running task
    sample: a continued one counts the tokens it brought along as its response's, and is not
    movable again (it loads its instance all the same)."""
    finished: list[tuple[str, int]]
    """``(sample uid, response tokens)`` of the task samples that finished since the last call."""


def affine_latency(c0: float, per_token: float, context: float) -> float:
    """Seconds of one decode step at ``context`` running tokens, from a measured profile."""
    return c0 + per_token * context


def fit_decode_latency(points: list[tuple[float, float]]):
    """Least-squares affine fit of ``[(context tokens, seconds per decode step)]``: one decode step
    costs about ``c0 + per_context_token * total context tokens of the running batch``. A
    picklable function for a scheduler, or None with fewer than two points. What an engine that
    measures such points returns from :meth:`Engine.decode_latency` (``hf`` and ``vllm`` do)."""
    if len(points) < 2:
        return None
    mx, my = sum(x for x, _ in points) / len(points), sum(y for _, y in points) / len(points)
    var = sum((x - mx) ** 2 for x, _ in points)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in points) / var) if var else 0.0
    return partial(affine_latency, max(my - slope * mx, 0.0), slope)


class ReceiveMissed(RuntimeError):
    """:meth:`Transfer.receive`: this payload cannot be received here any more (its collective
    lost a member, or was served in full before this worker came); the message says what
    happened and after how long. streamrl then fetches the weights again with :meth:`Transfer.resend`."""


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
        """Generate worker: turn the payload back into named tensors for the engine. A payload
        that can no longer be received here (a collective whose group lost a member, or one
        already served in full: a worker restarted after its publication) raises
        :class:`ReceiveMissed`, and streamrl asks the train worker's :meth:`resend` for this
        worker alone."""
        raise NotImplementedError

    def resend(self, version: int) -> tuple[Any, int]:
        """Train worker: a payload for one receiver that missed ``version`` (:class:`ReceiveMissed`),
        of the newest weights sent (that version or a later one); returns ``(payload, version
        sent)``. Only a transfer whose :meth:`receive` can raise :class:`ReceiveMissed` needs it."""
        raise NotImplementedError

    def close(self) -> None:
        """Release connections or process groups when the worker shuts down."""
