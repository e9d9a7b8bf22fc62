"""What train tasks send the controller: :class:`TrainTaskStats` from each train task and
:class:`StepStats` from each optimizer step, in place of string-keyed dicts.

The train worker builds them (``on_worker/task_functions.py``) from what the trainer returns -- a trainer's
``micro_batch`` and ``step`` still return plain dicts (the plugin contract) -- and the controller
reads them (``telemetry/record.py``). Both sides import this module; Dask pickles them between.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from streamrl.telemetry.names import REWARD_NAMES_KEPT

def add_bucket_sums(into: dict[str, dict[str, float]], sums: dict[str, dict[str, float]]) -> None:
    """Add per-bucket sums (``{bucket: {name: value}}``) into ``into``, in place (anything else
    a plugin's trainer returned under that key is left out)."""
    if not isinstance(sums, dict):
        return
    for bucket, values in sums.items():
        if not isinstance(values, dict):
            continue
        mine = into.setdefault(str(bucket), {})
        for name, value in values.items():
            mine[name] = mine.get(name, 0.0) + float(value)


#: what ``Trainer.micro_batch`` returns under these names; any other ``<name>_sum`` is a statistic
_COUNTED = ("samples", "tokens", "reward_sum", "loss_sum", "seconds")


@dataclass
class TrainTaskStats:
    """One train task: its micro-batches' sums, and what the controller needs for accounting
    (so that samples never travel to the controller)."""

    samples: int = 0
    """Samples trained (a sharded rank's empty turn: 0)."""
    tokens: int = 0
    """Their response tokens."""
    reward_sum: float = 0.0
    """Sum of their rewards."""
    loss_sum: float = 0.0
    """Sum of their per-sample losses."""
    seconds: float = 0.0
    """Trainer seconds in forward/backward."""
    sums: dict[str, float] = field(default_factory=dict)
    """Per-sample sums of every other statistic, by name: each ``<name>_sum`` the trainer
    returned (the algorithm's ``clip_frac``, ``kl``, ...; the trainer's ``skipped``), which
    ``metrics.jsonl`` reports as ``<name>`` averaged over samples."""
    micro_batches: int = 0
    """Micro-batches the task was cut into."""
    reward_errors: int = 0
    """Samples whose reward raised or was not a finite number (scored 0)."""
    reward_errors_transient: int = 0
    """Of those, the ones whose failure was their surroundings' (an agent's rollout that timed
    out or lost its endpoint), not the reward's or the agent's own."""
    reward_error_first: str | None = None
    """What the reward raised for the first of them (``Sample.reward_error``); None without any."""
    gen_end_max: float | None = None
    """When the last of its samples was generated (epoch seconds); None without samples."""
    policy_version_min: int | None = None
    """The oldest policy version among its samples; None without samples."""
    sample_log: list[dict] = field(default_factory=list)
    """One small record per sample (id, versions, worker, timeline), as ``metrics.jsonl``'s
    ``sample_log`` has them (without ``staleness``, which the controller adds)."""
    reward_info_sums: dict[str, float] = field(default_factory=dict)
    """Per name in the samples' ``Sample.reward_info``: the sum of its values."""
    reward_info_counts: dict[str, int] = field(default_factory=dict)
    """Per name: how many samples had it (a sample whose reward failed has none)."""
    offpolicy: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per token-staleness bucket, the sums the trainer counted of how off-policy its tokens
    were (``training/off_policy_stats.py``); empty from a trainer that counts none."""
    groups: int = 0
    """Prompt groups of two samples or more that it trained on."""
    flat_groups: int = 0
    """Of those, the groups whose samples all got the same reward: a group baseline (GRPO, RLOO,
    ...) gives every sample of such a group advantage 0."""

    def add(self, micro_batch: dict) -> None:
        """Add the sums one ``Trainer.micro_batch`` call returned. Keys that are neither counted
        here nor a ``<name>_sum`` are left out (``metrics.jsonl`` never reported them)."""
        self.samples += int(micro_batch.get("samples", 0))
        self.tokens += int(micro_batch.get("tokens", 0))
        self.reward_sum += float(micro_batch.get("reward_sum", 0.0))
        self.loss_sum += float(micro_batch.get("loss_sum", 0.0))
        self.seconds += float(micro_batch.get("seconds", 0.0))
        add_bucket_sums(self.offpolicy, micro_batch.get("offpolicy") or {})
        for key, value in micro_batch.items():
            if key.endswith("_sum") and key not in _COUNTED:
                name = key[:-len("_sum")]
                self.sums[name] = self.sums.get(name, 0.0) + float(value)

    def add_reward_info(self, infos) -> None:
        """Count the named values the reward gave beside each score (each sample's
        ``reward_info``), for their per-step means."""
        for info in infos:
            for name, value in info.items():
                if name not in self.reward_info_sums and len(self.reward_info_sums) >= REWARD_NAMES_KEPT:
                    continue  # (a name per sample would be a field per sample: the first are kept)
                self.reward_info_sums[name] = self.reward_info_sums.get(name, 0.0) + float(value)
                self.reward_info_counts[name] = self.reward_info_counts.get(name, 0) + 1


@dataclass
class StepStats:
    """One optimizer step, from what ``Trainer.step`` returned."""

    grad_norm: float
    """The policy's gradient norm before clipping."""
    seconds: float
    """Trainer seconds in the step."""
    version: int | None = None
    """The new policy version the trainer reports (None where it reports none)."""
    extra: dict[str, float] = field(default_factory=dict)
    """Whatever else it reported (``critic_grad_norm``) and, with ``algorithm.epochs > 1``, the
    last pass's statistics the controller adds; ``metrics.jsonl`` has each under its name."""

    @classmethod
    def of(cls, stepped: dict) -> StepStats:
        """From ``Trainer.step``'s dict: ``grad_norm`` and ``seconds`` are required, ``version``
        is read, every other key goes to :attr:`extra` as it is."""
        extra = {k: v for k, v in stepped.items() if k not in ("grad_norm", "seconds", "version")}
        version = stepped.get("version")
        return cls(grad_norm=stepped["grad_norm"], seconds=stepped["seconds"],
                   version=None if version is None else int(version), extra=extra)
