"""The names every tracker sink logs a step under: :func:`tracker_metrics`.

``metrics.jsonl`` keeps streamrl's own field names (``reward_mean``, ``step_s``); a tracker gets
names grouped the way verl groups its own (``timing_s/...``, ``perf/...``, ``actor/...``,
``critic/...``, ``response_length/mean``), so runs of both sit side by side in one dashboard.
``docs/metrics.md`` has the table.
"""

from __future__ import annotations

import math
import numbers
import re

#: record field -> tracker name, for the fields streamrl writes; any other number keeps its
#: record name (an algorithm's, a trainer's or a scheduler's own statistic; ``eval/...``;
#: ``reward/<name>/mean``)
NAMES = {
    "reward_mean": "reward/mean",
    "reward_errors": "reward/errors",
    "reward_errors_transient": "reward/errors_transient",
    "flat_groups": "reward/flat_groups_frac",
    "stopped_early": "generation/stopped_early_frac",
    "response_len_mean": "response_length/mean",
    "loss": "actor/loss",
    "grad_norm": "actor/grad_norm",
    "clip_frac": "actor/clip_frac",
    "kl": "actor/kl",
    "behaviour_weight": "actor/behaviour_weight",
    "skipped": "actor/skipped_frac",
    "nonfinite_skipped": "actor/nonfinite_skipped",
    "epochs": "actor/epochs",
    "last_epoch_clip_frac": "actor/last_epoch_clip_frac",
    "last_epoch_loss": "actor/last_epoch_loss",
    "value_loss": "critic/value_loss",
    "value_mean": "critic/value_mean",
    "explained_variance": "critic/explained_variance",
    "critic_grad_norm": "critic/grad_norm",
    "generate_s": "timing_s/generate",
    "train_s": "timing_s/train",
    "train_tail_s": "timing_s/train_tail",
    "weight_sync_s": "timing_s/weight_sync",
    "step_s": "timing_s/step",
    "controller_s": "timing_s/controller",
    "submit_s": "timing_s/submit",
    "generate_makespan_s": "timing_s/generate_makespan",
    "accounting_window_s": "timing_s/accounting_window",
    "samples_per_s": "perf/samples_per_s",
    "tokens_per_s": "perf/tokens_per_s",
    "publish_bytes": "perf/publish_bytes",
    "generate_workers": "perf/generate_workers",
    "samples": "batch/samples",
    "train_tasks": "batch/train_tasks",
    "micro_batches": "batch/micro_batches",
    "submitted_groups": "batch/submitted_groups",
    "policy_version": "staleness/policy_version",
    "generated_policy_version_min": "staleness/oldest_version",
    "staleness_max": "staleness/max",
    "ranker_recall": "dispatch/ranker_recall",
    "long_tail_instances": "dispatch/long_tail_instances",
}

#: fields no tracker gets: ``step`` is the tracker's step and ``time`` its clock; the per-sample
#: log is thousands of values a step (``metrics.jsonl`` has it)
DROPPED = {"step", "time", "sample_log"}


#: The most names a reward's named values (``Sample.reward_info``) may add to a record: each is a
#: ``reward/<name>/mean`` field of every step and a chart of every tracker. A reward that names
#: a value per sample (an id as a key) would add one per sample; past this many a step keeps the
#: first (``rewards/scoring.py`` bounds each response's, the step's aggregation the union).
REWARD_NAMES_KEPT = 32

def tracker_metrics(record: dict) -> dict[str, float]:
    """The step's ``record`` (a ``metrics.jsonl`` line) as flat, named numbers for a tracker.

    Known fields get their :data:`NAMES`; ``pools.<pool>.<stat>`` becomes ``perf/<stat>/<pool>``;
    any other nested dict is flattened with ``/``. Lists, strings and numbers that are not
    finite (NaN, inf) are left out. Names keep to the characters every tracker accepts
    (MLflow allows no ``@``: ``eval/pass@1`` is ``eval/pass_at_1``)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in DROPPED:
            continue
        if key == "pools" and isinstance(value, dict):
            for pool, stats in value.items():
                if isinstance(stats, dict):
                    for stat, v in stats.items():
                        _put(out, f"perf/{stat}/{pool}", v)
            continue
        _put(out, NAMES.get(key, key), value)
    return out


def _put(out: dict[str, float], name: str, value) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _put(out, f"{name}/{k}", v)
    elif isinstance(value, numbers.Real):  # (bool is a Real: a flag logs as 0/1)
        try:
            number = float(value)
        except (OverflowError, ValueError, TypeError):  # (an int past a float's range, 10**400: left out)
            return
        if math.isfinite(number):
            out[clean_name(name)] = number


def clean_name(name: str) -> str:
    """``name`` with only letters, digits, ``_ - . /`` and spaces, and no empty, ``.`` or ``..``
    part between slashes: what TensorBoard, W&B, MLflow and Trackio all accept (``@`` reads
    ``_at_``)."""
    name = re.sub(r"[^\w.\- /]", "_", str(name).replace("@", "_at_"))
    return "/".join(part for part in name.split("/") if part not in ("", ".", ".."))
