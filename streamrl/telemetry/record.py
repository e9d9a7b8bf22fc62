"""The ``metrics.jsonl`` record of one step, built from the train tasks' stats
(``telemetry/stats.py``) and the clock.

:class:`StepRecord` names every field streamrl writes; :meth:`StepRecord.as_dict` is the line
in ``metrics.jsonl`` (and what metric sinks and ``on_step_end`` receive). An algorithm's extra
statistics (any ``<name>_sum`` it returns) and the dispatcher's fields are added to it as
``extra``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from streamrl.telemetry.names import REWARD_NAMES_KEPT
from streamrl.telemetry.off_policy import record_fields
from streamrl.telemetry.stats import StepStats, TrainTaskStats, add_bucket_sums

#: algorithm statistics reported even when an algorithm does not return them, with the per-sample
#: value assumed then (a clip fraction and a KL of 0, a behaviour weight of 1)
DEFAULT_STATS = {"clip_frac": 0.0, "kl": 0.0, "behaviour_weight": 1.0}


@dataclass
class StepRecord:
    """One optimizer step, as ``metrics.jsonl`` records it."""

    step: int
    policy_version: int
    """Version after this step's update."""
    samples: int
    train_tasks: int
    micro_batches: int
    reward_mean: float
    loss: float
    response_len_mean: float
    reward_errors: int
    """Samples whose reward raised or was not a finite number (scored 0). A step in which every
    sample's did is not recorded: the run stops before its update (``task_functions.optimizer_step``),
    since a reward that always fails is a bug, not a learning signal -- unless every failure was
    the surroundings' (``reward_errors_transient``), for a few steps in a row."""
    generated_policy_version_min: int
    staleness_max: int
    """Versions between the policy being trained (``step``) and its oldest sample."""
    grad_norm: float
    samples_per_s: float
    tokens_per_s: float
    generate_s: float
    """From the step's start to the last sample generated (async: may end before the start)."""
    train_s: float
    """Trainer busy seconds (micro-batches and the optimizer step)."""
    train_tail_s: float
    """From the last sample generated to the optimizer step done: what streaming shrinks."""
    weight_sync_s: float
    step_s: float
    time: float
    stats: dict[str, float] = field(default_factory=dict)
    """The algorithm's statistics, averaged per sample (``clip_frac``, ``kl``, ...)."""
    pools: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per pool: ``busy_s``, ``idle_s``, ``idle_ratio`` over ``accounting_window_s``."""
    accounting_window_s: float = 0.0
    controller_s: float = 0.0
    """From the previous step's boundary until this step's generation was admitted and its
    training could begin: the controller's own time (metrics, submitting tasks, waiting for the
    weight loads the staleness bound needs). ``streamrl plan`` counts it as a cost of the step."""
    submit_s: float = 0.0
    """Seconds the controller spent submitting generate and reward tasks during this step."""
    submitted_groups: int = 0
    """Prompt groups it submitted during this step (async: those of later steps)."""
    generate_workers: int = 0
    """Generate workers that took this step's groups (an elastic pool changes it between steps)."""
    rewards: dict[str, float] = field(default_factory=dict)
    """``reward/<name>/mean``: the mean of each named value the reward gave beside the score
    (``Sample.reward_info``), over the samples that had it."""
    extra: dict = field(default_factory=dict)
    """Dispatch fields (``generate_makespan_s``, ``ranker_recall``, ...)."""
    flat_groups: float | None = None
    """Share of the step's prompt groups (of two samples or more) whose samples all got the same
    reward, where a group baseline has nothing to learn from; None without such groups."""
    reward_errors_transient: int = 0
    """Of ``reward_errors``, the agents' rollouts that timed out or lost their endpoint (overload
    or a lost worker, not a broken reward or agent)."""
    reward_error_first: str | None = None
    """What the reward raised for the step's first sample whose reward failed
    (``"ValueError: ..."``), so that the error is seen somewhere; None when none failed."""
    sample_log: list[dict] = field(default_factory=list)
    """Per sample: id, generating version, staleness, worker and timeline (epoch seconds)."""

    def as_dict(self) -> dict:
        """The flat JSON record (``stats`` and ``extra`` merged in, ``sample_log`` last). What
        algorithms, rewards and plugins add is made plain JSON (:func:`plain`), and none of it
        replaces a field streamrl writes (:meth:`clashes` names what tried)."""
        # shallow, not ``dataclasses.asdict``: its deep copy of the per-sample log (512 dicts a
        # W1 step) was the controller's largest cost per step; nothing here is mutated later
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        stats, rewards, extra, log = d.pop("stats"), d.pop("rewards"), d.pop("extra"), d.pop("sample_log")
        added = plain({**stats, **rewards, **extra})
        return {**d, **{k: v for k, v in added.items() if k not in d}, "sample_log": log}

    def clashes(self) -> list[str]:
        """The names among ``stats``, ``rewards`` and ``extra`` that are a field of the record
        itself (left out of :meth:`as_dict`: a plugin's ``step`` must not renumber the run)."""
        own = {f.name for f in fields(self)}
        return sorted({*self.stats, *self.rewards, *self.extra} & own)


#: The most characters of a text, and of a name, a plugin's part of a record keeps.
MAX_TEXT, MAX_NAME = 4096, 256


def plain(value, depth: int = 0):
    """``value`` as JSON can hold it: numbers, text, lists and objects as they are; a number of
    numpy's or torch's as a Python number; anything else (or nested past 32 levels) as its
    text. What a plugin adds to a record must not stop the run when the record is written."""
    if isinstance(value, str):  # (a plugin's 10 MB text went whole into every line, the csv and the trace)
        return value if len(value) <= MAX_TEXT else value[:MAX_TEXT - 1] + "…"
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if depth < 32:
        if isinstance(value, dict):
            return {str(k)[:MAX_NAME]: plain(v, depth + 1) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v, depth + 1) for v in value]
        item = getattr(value, "item", None)  # (a one-element array or tensor: its number)
        if callable(item):
            try:
                got = item()
                if isinstance(got, (bool, int, float, str)):
                    return got
            except Exception:  # noqa: BLE001 -- more than one element: its text below
                pass
    try:
        return str(value)[:MAX_TEXT]
    except Exception as exc:  # noqa: BLE001 -- a __str__ that raises
        return f"<{type(value).__name__}: str() raised {type(exc).__name__}>"


#: Statistics counted over every sample of a step; the others (the algorithm's ``clip_frac``,
#: ``kl``, ...) are computed over the samples the backward pass took.
OVER_ALL_SAMPLES = ("skipped", "stopped_early")


def algorithm_stats(micro: list[TrainTaskStats], samples: int) -> dict[str, float]:
    """Every statistic the train tasks summed (:attr:`TrainTaskStats.sums`), as a per-sample mean:
    :data:`OVER_ALL_SAMPLES` over the step's ``samples``, the rest over the samples trained (those
    not ``skipped``: a GRPO group of equal rewards never reaches the loss, and counting it would
    read a behaviour weight of 1 as 0.5 when half the groups were flat)."""
    sums: dict[str, float] = {}
    for m in micro:
        for k, v in m.sums.items():
            sums[k] = sums.get(k, 0.0) + v
    trained = samples - sums.get("skipped", 0.0)
    out = {k: v / max(samples, 1) if k in OVER_ALL_SAMPLES else v / trained
           for k, v in sums.items() if k in OVER_ALL_SAMPLES or trained > 0}
    return {**DEFAULT_STATS, **out}


def off_policy_fields(micro: list[TrainTaskStats]) -> dict[str, float]:
    """The ``offpolicy/...`` fields (``telemetry/off_policy.py``) of the train tasks' buckets."""
    sums: dict[str, dict[str, float]] = {}
    for m in micro:
        add_bucket_sums(sums, m.offpolicy)
    return record_fields(sums)


def reward_means(micro: list[TrainTaskStats]) -> dict[str, float]:
    """``reward/<name>/mean`` of every value the train tasks' samples had in ``reward_info``."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for m in micro:
        for k, v in m.reward_info_sums.items():
            sums[k] = sums.get(k, 0.0) + v
            counts[k] = counts.get(k, 0) + m.reward_info_counts[k]
    return {f"reward/{k}/mean": sums[k] / counts[k] for k in sorted(sums)[:REWARD_NAMES_KEPT]}


def summarize(step: int, version: int, micro: list[TrainTaskStats], step_stats: StepStats, t0: float,
              t_trained: float, t_end: float) -> StepRecord:
    """The record of one step from the train tasks' stats and the wall clock."""
    samples = sum(m.samples for m in micro)
    sample_log = [dict(x, staleness=step - x["version"]) for m in micro for x in m.sample_log]
    tokens = sum(m.tokens for m in micro)
    # (a sharded rank's empty turn in a round trained no sample: it has neither; nor has a step
    # of served traffic that a stop request ended before any came)
    gen_end = max((m.gen_end_max for m in micro if m.gen_end_max is not None), default=t0)
    oldest = min((m.policy_version_min for m in micro if m.policy_version_min is not None), default=step)
    step_s = t_end - t0
    per = max(samples, 1)
    return StepRecord(
        step=step, policy_version=version, samples=samples, train_tasks=len(micro),
        micro_batches=sum(m.micro_batches for m in micro),
        reward_mean=sum(m.reward_sum for m in micro) / per,
        loss=sum(m.loss_sum for m in micro) / per,
        response_len_mean=tokens / per, reward_errors=sum(m.reward_errors for m in micro),
        reward_errors_transient=sum(m.reward_errors_transient for m in micro),
        generated_policy_version_min=oldest, staleness_max=step - oldest, grad_norm=step_stats.grad_norm,
        samples_per_s=samples / step_s, tokens_per_s=tokens / step_s, generate_s=max(0.0, gen_end - t0),
        train_s=sum(m.seconds for m in micro) + step_stats.seconds, train_tail_s=t_trained - gen_end,
        weight_sync_s=t_end - t_trained, step_s=step_s, time=t_end,
        stats={**algorithm_stats(micro, per), **off_policy_fields(micro), **step_stats.extra},
        rewards=reward_means(micro), sample_log=sample_log, flat_groups=flat_share(micro),
        reward_error_first=next((m.reward_error_first for m in micro if m.reward_error_first), None))


def flat_share(micro: list[TrainTaskStats]) -> float | None:
    """The share of groups of two samples or more whose rewards were all equal (None: no such group)."""
    groups = sum(m.groups for m in micro)
    return sum(m.flat_groups for m in micro) / groups if groups else None


def last_epoch_stats(micro: list[TrainTaskStats], epochs: int) -> dict[str, float]:
    """With ``algorithm.epochs > 1``: how far the last pass (its train tasks' stats ``micro``)
    moved from the generating policy (its loss and clip fraction per sample)."""
    n = max(sum(m.samples for m in micro), 1)  # (a step of no samples: one a stop ended)
    trained = max(n - sum(m.sums.get("skipped", 0.0) for m in micro), 1)  # (as algorithm_stats)
    return {"epochs": epochs, "last_epoch_clip_frac": sum(m.sums.get("clip_frac", 0.0) for m in micro) / trained,
            "last_epoch_loss": sum(m.loss_sum for m in micro) / n}
