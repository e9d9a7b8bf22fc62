"""The functions Dask runs on workers to generate, score and train. Each is small: it finds the
resident engine, reward or trainer and calls one method, so the dashboard shows one bar per
meaningful piece of work. The weights' tasks are in ``weight_tasks.py``, the ranker's in
``ranker_tasks.py``, sample moves' in ``move_tasks.py``.

Arguments named ``after`` carry a future only to order a task after another one. ``trainer_id``
is the trainer incarnation the controller built (``{worker name: id}`` over a train pool): a
train task that lands on a restarted train worker (a fresh trainer at the base weights) fails
instead of training the wrong policy.
"""

from __future__ import annotations

import time

from distributed import get_client, get_worker

from streamrl.errors import RewardFailed, RunStopped
from streamrl.on_worker.engine_output import checked_groups
from streamrl.on_worker.microbatch import group_tokens, pack
from streamrl.on_worker.move_tasks import MOVE_TARGETS, continue_moved
from streamrl.on_worker.weight_tasks import LOAD_PRIORITY, WEIGHTS_LOCK, catch_up
from streamrl.rewards import scoring
from streamrl.on_worker.resident import (ENGINE, REWARD, TRAINER, ResidentLost, expect, incarnation,
                                    resident, resident_settings)
from streamrl.sample import Group, Prompt
from streamrl.telemetry.stats import StepStats, TrainTaskStats


def dask_clock_shift() -> float:
    """What Dask adds to this worker's clock in the task stream (its estimate of the scheduler's
    clock less its own, renewed at each heartbeat; taken as the task starts, as Dask takes it).
    A sample keeps it (``times["clock_shift"]``) so that the trace draws the sample's own stamps
    in the task stream's frame: on a loaded machine the estimate drifts even where the clocks
    agree, and a sample would be drawn outside the task that made it."""
    return float(getattr(get_worker(), "scheduler_delay", 0.0) or 0.0)


def generate_groups(prompts: list[Prompt], n: int, submitted: float = 0.0,
                    engine_priorities: list[float] | None = None, min_version: int = 0) -> list[Group]:
    """Generate pool: ``n`` samples of each prompt (``pools.generate.groups_per_task`` of them).
    ``submitted`` is when the controller asked; ``engine_priorities`` (from a scheduler; higher
    first) order the engine's queue; an engine older than ``min_version`` catches up first."""
    shift = dask_clock_shift()  # (first: Dask took it as the task started)
    engine = resident(ENGINE)
    if engine.version < min_version:
        catch_up(engine, min_version)
    start = time.time()
    groups = checked_groups(engine, prompts, n, engine.generate_groups(prompts, n, engine_priorities or
                                                                       [0.0] * len(prompts)))
    end = time.time()
    name = str(get_worker().name)
    for s in (s for g in groups for s in g):
        s.times["submitted"] = submitted
        s.times["clock_shift"] = shift
        # an engine that does not time its samples gets the task's own times
        s.times.setdefault("gen_start", start)
        s.times.setdefault("gen_end", end)
        s.worker = name
    return groups


def generate_chunk(prompt: Prompt, samples: list[int], submitted: float = 0.0, engine_priority: float = 0.0,
                   min_version: int = 0, movable: bool = False) -> Group:
    """Generate pool: the samples numbered ``samples`` of ``prompt``'s group (one chunk of a group
    a scheduler split over instances; :func:`score_chunks` joins them). ``movable``: a straggler
    mover may take one out (``move_tasks.move_sample``); it is then finished by a task on the worker
    it was moved to (``move_tasks.continue_moved``), and this task returns it finished."""
    shift = dask_clock_shift()  # (first: Dask took it as the task started)
    engine = resident(ENGINE)
    if engine.version < min_version:
        catch_up(engine, min_version)
    start = time.time()
    if movable:
        client = get_client()
        own = get_worker().get_current_task()
        phase = own[0] if isinstance(own, tuple) else "generate"  # the step's generate phase, for the trace

        def on_moved(partial):
            pin = MOVE_TARGETS.pop(partial.uid)
            # ahead of the target's queued work: the sample has waited long enough
            return client.submit(continue_moved, partial, engine_priority,
                                 key=(phase, f"{partial.uid} moved {time.time_ns()}"),
                                 priority=LOAD_PRIORITY - 1, retries=1, pure=False, **pin)
        try:
            group = engine.generate_movable(prompt, list(samples), engine_priority, on_moved)
        finally:
            for k in samples:  # asked to move but ended first
                MOVE_TARGETS.pop(f"{prompt.uid}-{k}", None)
    else:
        group = engine.generate_samples(prompt, list(samples), engine_priority)
    end = time.time()
    name = str(get_worker().name)
    for s in group:
        s.times["submitted"] = submitted
        s.times["clock_shift"] = shift
        s.times.setdefault("gen_start", start)
        s.times.setdefault("gen_end", end)
        s.worker = s.worker or name
    return group


def engine_loop_counts(dask_worker=None) -> dict | None:
    """Run on a generate worker by ``Client.run``: its engine loop's counters (decode steps,
    admissions, requests admitted; ``SlotEngine.loop_counts``), or None where the engine is not
    built or keeps none."""
    plugin = dask_worker.plugins.get(ENGINE) if dask_worker is not None else None
    counts = getattr(getattr(plugin, "obj", None), "loop_counts", None)
    return dict(counts) if counts is not None else None


def join_chunks(*chunks: Group) -> Group:
    """A group from its chunks, in sample order; a sample in two chunks is an error (it would
    be trained twice)."""
    samples = sorted((s for c in chunks for s in c), key=lambda s: int(s.uid.rsplit("-", 1)[1]))
    uids = [s.uid for s in samples]
    if len(set(uids)) != len(uids):
        raise ValueError(f"a group's chunks overlap: {sorted(u for u in uids if uids.count(u) > 1)[0]} twice")
    return samples


def score_chunks(*chunks: Group) -> list[Group]:
    """Reward pool: join a group's chunks (:func:`join_chunks`) and score it, as
    :func:`score_groups` scores a whole one."""
    return score_groups([join_chunks(*chunks)])


def score_groups(groups: list[Group]) -> list[Group]:
    """Reward pool: score every sample; a failing or late reward is contained
    (``rewards/scoring.py``, within the run's ``reward.score_timeout_s``)."""
    shift = dask_clock_shift()  # (first: Dask took it as the task started)
    reward = resident(REWARD)
    settings = resident_settings(REWARD)
    timeout_s, limit = settings.get("score_timeout_s"), settings.get("limit", scoring.REWARD_LIMIT)
    scored = [scoring.score_group(reward, g, timeout_s, limit) for g in groups]
    for s in (s for g in scored for s in g):
        s.times["reward_clock_shift"] = shift  # (the trace finds the reward task by reward_end)
    return scored


def _peer_lost(exc: Exception) -> Exception:
    """A collective of the train pool that failed because another rank died (its worker was
    killed or restarted: gloo reports the closed connection or a timeout) is the loss of the
    ranks' shared training state: a :class:`ResidentLost`, which ends the run in one line naming
    the resume command. Anything else is returned as it is."""
    import torch.distributed as dist

    text = str(exc)
    if (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            and (isinstance(exc, dist.DistError) or "gloo" in text or "NCCL" in text)):
        # gloo's first sentence, without its source location: "Connection reset by peer" and the like
        cause = text.splitlines()[0].split("] ", 1)[-1].split(". ", 1)[0][:120] if text else type(exc).__name__
        return ResidentLost(f"worker {get_worker().name} lost a peer of the train pool's process group ({cause}): "
                            "the ranks' shared training state is gone")
    return exc


def _trajectory_fields(s) -> dict:
    # an agent's multi-turn trajectory: its turns and tool calls, and its text (tool results
    # and all, cut short), for the trace -- a one-call sample has none of these
    if not s.loss_mask:
        return {}
    return {"turns": int(s.reward_info.get("turns", 0)), "tool_calls": int(s.reward_info.get("tool_calls", 0)),
            "text": s.response_text[:TRAJECTORY_TEXT_CHARS]}


#: Characters of an agent trajectory's text kept in its step record (``sample_log``) for the trace.
TRAJECTORY_TEXT_CHARS = 400


def train_groups(*bundles: list[Group], scale: float, micro_batch_tokens: int = 0, groups_per_micro_batch: int = 0,
                 after=None, trainer_id: str | dict | None = None, trainer: str = TRAINER) -> TrainTaskStats:
    """See :func:`_train_groups`; a rank lost mid-collective becomes :class:`ResidentLost`.
    ``trainer``: the resident it trains (a learner's own, ``learners/``)."""
    try:
        return _train_groups(*bundles, scale=scale, micro_batch_tokens=micro_batch_tokens,
                             groups_per_micro_batch=groups_per_micro_batch, trainer_id=trainer_id, name=trainer)
    except ResidentLost:
        raise
    except Exception as exc:
        raise _peer_lost(exc) from None


def _train_groups(*bundles: list[Group], scale: float, micro_batch_tokens: int = 0, groups_per_micro_batch: int = 0,
                  trainer_id: str | dict | None = None, name: str = TRAINER) -> TrainTaskStats:
    """Train pool: forward/backward on whole groups (the scored bundles of ``score_groups``),
    cut into micro-batches by ``on_worker/microbatch.pack``; gradients accumulate until the
    optimizer step.

    Returns the trainer's summed stats plus what the controller needs for accounting
    (``telemetry/stats.py``), so samples themselves never travel to the controller.
    """
    expect(name, trainer_id)
    trainer = resident(name)
    groups = [g for bundle in bundles for g in bundle]
    # Shortest groups first: a micro-batch is padded to its longest sequence, so neighbours of
    # similar length waste little (on lengths that span two orders of magnitude, submission
    # order trained much slower: docs/benchmarks.md). Order does not change the accumulated
    # gradient of an algorithm without running state (REINFORCE++'s normaliser is updated group
    # by group, so its advantages follow the order; M2PO's mask is chosen per micro-batch).
    order = sorted(range(len(groups)), key=lambda i: max(len(s.prompt_ids) + len(s.response_ids) for s in groups[i]))
    cuts = [[order[j] for j in idx] for idx in
            pack([group_tokens(groups[i]) for i in order], micro_batch_tokens, groups_per_micro_batch)]
    passes = [[groups[i] for i in idx] for idx in cuts]
    if trainer.sharded:
        # sharded ranks run this task in rounds, one task each: every rank makes as many
        # passes as the busiest (the extra ones empty), so their collectives pair up
        from streamrl.training.fsdp import agree_passes

        passes += [[]] * (agree_passes(len(passes), trainer.device) - len(passes))
    stats = TrainTaskStats(micro_batches=len(cuts))
    for chunk in passes:
        stats.add(trainer.micro_batch(chunk, scale))
    samples = [s for g in groups for s in g]
    if not samples:  # a sharded rank's empty turn in a round (its empty passes counted nothing)
        return stats
    trained, rank = time.time(), str(get_worker().name)
    # one small record per sample: the controller checks ids (none lost, none twice) and
    # writes the timeline into metrics.jsonl
    stats.sample_log = [
        {"uid": s.uid, "version": s.policy_version, "worker": s.worker, **{k: round(v, 4) for k, v in s.times.items()},
         "trained": round(trained, 4), "trained_on": rank, "response_len": len(s.response_ids),
         "prompt_len": len(s.prompt_ids), **_trajectory_fields(s)}
        for s in samples]
    stats.gen_end_max = max(s.times["gen_end"] for s in samples)
    stats.policy_version_min = min(s.policy_version for s in samples)
    stats.reward_errors = sum(1 for s in samples if "reward_error" in s.times)
    stats.reward_errors_transient = sum(1 for s in samples if "reward_transient" in s.times)
    early = sum(1 for s in samples if "stopped_early" in s.times)
    if early:  # (``stopped_early`` in the record: the share of the step's samples its engine ended early)
        stats.sums["stopped_early"] = stats.sums.get("stopped_early", 0.0) + early
    stats.reward_error_first = next((s.reward_error for s in samples if s.reward_error), None)
    stats.add_reward_info(s.reward_info for s in samples)
    pairs = [g for g in groups if len(g) > 1]
    stats.groups, stats.flat_groups = len(pairs), sum(1 for g in pairs if len({s.reward for s in g}) == 1)
    return stats


def optimizer_step(*train_tasks: TrainTaskStats, trainer_id: str | dict | None = None, after=None,
                   trainer: str = TRAINER, step: int | None = None) -> StepStats:
    """Train pool: one optimizer step after every train task of the batch (they are arguments:
    every rank sees the whole batch's, and decides the same).

    A batch in which the reward failed for every sample (raised, or gave no number) is not
    trained on: :class:`~streamrl.errors.RewardFailed` stops the run before the update, naming
    the first error. A reward that fails for every sample of a step is a bug, not a learning
    signal; training on its zeros would go on in silence. A batch in which only some failed
    trains (those score 0, counted in ``reward_errors``).

    Except when every failure was the surroundings' (agents' rollouts that timed out or lost
    their endpoint: ``reward_errors_transient``): one abusive rollout can starve a step's others,
    and that is overload, not a bug, so the step trains as usual (its samples scored 0). Only
    :data:`TRANSIENT_STEPS_MAX` such steps in a row stop the run, as a reward that always fails
    does."""
    name = trainer
    expect(name, trainer_id)
    samples = sum(t.samples for t in train_tasks)
    errors = sum(t.reward_errors for t in train_tasks)
    transient = sum(t.reward_errors_transient for t in train_tasks)
    failed = bool(samples) and errors >= samples
    # (counted once per run step: with ``algorithm.epochs`` > 1 a step makes several updates; a
    # step before the last seen is another run's on this worker, which starts the count again)
    last, count = _transient_steps.get(name, (None, 0))
    if step is not None and last is not None and step < last:
        count = 0
    count = (count if step == last and step is not None else count + 1) if failed and transient >= errors else 0
    _transient_steps[name] = (step, count)
    if failed and not 0 < count < TRANSIENT_STEPS_MAX:
        first = next((t.reward_error_first for t in train_tasks if t.reward_error_first), "no error text")
        where = f"step {step + 1}" if step is not None else "a step"  # (``step``: the run's, from 0)
        if count:
            raise RewardFailed(f"{where}: every rollout failed for {TRANSIENT_STEPS_MAX} steps in a row, each "
                               f"timed out or lost its endpoint (the first: {first}); raise task.rollout_timeout_s "
                               "or find what holds the agent workers")
        raise RewardFailed(f"{where}: the reward failed for all {samples} samples (the first: {first}), so the step "
                           "was not trained on; a reward that fails for every sample is a bug, not a learning "
                           "signal: fix what the first error names")
    try:
        with WEIGHTS_LOCK:  # (no export reads the weights while they change)
            return StepStats.of(resident(name).step())
    except RunStopped:  # the trainer refused the step (a loss that is not finite): that is the news
        raise
    except Exception as exc:
        raise _peer_lost(exc) from None


#: Steps in a row whose every sample failed for its surroundings (``reward_errors_transient``)
#: after which the run stops: a few are overload, this many are an agent that never finishes.
TRANSIENT_STEPS_MAX = 3

_transient_steps: dict[str, tuple] = {}  # by trainer resident: (the last step, such steps in a row), on this worker


def trainer_logprobs(group: Group) -> list[list[float]]:
    """Train pool: the trainer's logprobs for a group's responses (consistency checks)."""
    return resident(TRAINER).logprobs(group)


def trainer_weights(after=None, trainer: str = TRAINER) -> bytes:
    """Train pool: the trainer's parameters, as safetensors bytes (checks and tests; Dask's own
    tensor serializer goes through numpy, which has no bfloat16). ``weights_from_bytes`` reads them."""
    from streamrl.training.weights_bytes import weights_to_bytes

    return weights_to_bytes(resident(trainer).named_weights())  # (detached and on the CPU there)


def save_policy(out: str, after=None, trainer_id: str | dict | None = None, trainer: str = TRAINER) -> str:
    """Train pool: write the current policy as a transformers model folder."""
    expect(trainer, trainer_id)
    return resident(trainer).save(out)


def save_policy_now(out: str, after=None, trainer_id: str | dict | None = None, trainer: str = TRAINER) -> int:
    """Train pool: write the current policy as a transformers model folder; returns the
    trainer's version (optimizer steps) it holds, read with it: the next step's training may
    already run before it (``async``), so which steps the folder includes is known only here."""
    expect(trainer, trainer_id)
    held = resident(trainer)
    version = held.version
    held.save(out)
    return version


def engine_latency():
    """Generate pool: the engine's decode-step latency function, or None without a profile."""
    return resident(ENGINE).decode_latency()


def warm_up(name: str) -> str:
    """Build the resident object now (model loads happen before the clock starts)."""
    resident(name)
    return name


def save_trainer_checkpoint(path: str, after=None, trainer_id: str | dict | None = None, trainer: str = TRAINER) -> str:
    """Train pool: the trainer's full state into the folder ``path``."""
    expect(trainer, trainer_id)
    resident(trainer).save_checkpoint(path)
    return path


def rendezvous_address() -> str:
    """Train pool, rank 0: ``host:port`` where the train pool's process group meets."""
    from streamrl.training.data_parallel import free_address

    host = get_worker().address.split("://", 1)[-1].rsplit(":", 1)[0]
    return free_address(host)


def join_train_group(rank: int, world: int, address: str, timeout_s: float, strategy: str = "ddp") -> int:
    """Train pool: join the process group (every rank's task runs at once), and shard the
    trainer over it for ``strategy = "fsdp"``; returns the rank."""
    from streamrl.training.data_parallel import join

    trainer = resident(TRAINER)  # built first: a slow model load must not eat the rendezvous timeout
    join(rank, world, address, timeout_s)
    if strategy == "fsdp" and world > 1:
        trainer.shard()
    return rank


def trainer_incarnation(trainer: str = TRAINER) -> str:
    """Train pool: the id of the trainer resident on this worker."""
    resident(trainer)  # built now if not yet
    return incarnation(trainer)


def load_trainer_checkpoint(path: str, trainer: str = TRAINER) -> str:
    """Train pool: restore the trainer from ``path``."""
    resident(trainer).load_checkpoint(path)
    return path
