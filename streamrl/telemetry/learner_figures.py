"""Each learner of a run with several, as ``streamrl report`` and the console's summary show them:
its state, the steps it trained and skipped, its train reward and its held-out evaluations, read
from ``metrics.jsonl``'s ``learners`` and the run folder's ``learners.json`` (records edited by
hand or another program's are read as far as they can be, never a crash).
"""

from __future__ import annotations

import json
from pathlib import Path

from streamrl.telemetry.run_files import finite_number, small_text

#: a learner's train reward: the mean of its last this many trained steps (as ``bench learners``)
LEARNER_WINDOW = 10



def learners_final(path: Path) -> dict:
    """The run folder's ``learners.json`` (each side learner as the run ended), {} without one."""
    try:
        final = json.loads(small_text(Path(path) / "learners.json"))
    except (OSError, ValueError, RecursionError):
        return {}
    return {k: v for k, v in final.items() if isinstance(v, dict)} if isinstance(final, dict) else {}


def learner_figures(records: list[dict], final: dict | None = None, window: int = LEARNER_WINDOW) -> list[dict]:
    """Each learner of a run with several (``metrics.jsonl``'s ``learners``; ``final``: the run
    folder's ``learners.json``), in order of appearance: ``name``, ``served``, ``algorithm``,
    ``state``, ``steps_trained``, ``skipped_steps``, ``failure``, ``train_reward`` (the mean
    ``reward_mean`` of its last ``window`` trained steps, each counted once: a side learner
    repeats its last step's figures while it lags), ``evals`` (``(x, version, reward_mean)`` of
    every held-out evaluation, by version; ``x``: the stream step the evaluated policy had
    trained through, 0 before any) and ``loss`` (``(step, loss)`` per trained step, 1-based).
    [] for a run without ``learners``."""
    entries: dict[str, list[dict]] = {}
    for rec in records:
        for name, e in (rec.get("learners") or {}).items():
            if isinstance(e, dict):
                entries.setdefault(name, []).append(e)
    for name, e in (final or {}).items():
        entries.setdefault(name, []).append(e)
    rows = []
    for name, mine in entries.items():
        last = mine[-1]
        served = bool(last.get("served"))
        trained: dict = {}  # the learner's stream step -> its entry (the newest)
        for i, e in enumerate(mine):
            if finite_number(e.get("reward_mean")) or finite_number(e.get("loss")):
                trained[e["step"] if finite_number(e.get("step")) else ("entry", i)] = e
        rewards = [e["reward_mean"] for e in trained.values() if finite_number(e.get("reward_mean"))][-window:]
        # the stream step its policy had trained through, by steps trained (version)
        joined = last.get("joined_at") if finite_number(last.get("joined_at")) else 0
        through = {0: joined}
        for e in mine:
            if finite_number(e.get("steps_trained")) and finite_number(e.get("step")):
                through[int(e["steps_trained"])] = int(e["step"]) + 1
        # the served learner's evaluations are the record's own eval/* (with those that landed
        # after the last record, ``eval_unrecorded``); a side learner's, its entries' and the final
        found: dict[int, float] = {}
        for e in (records if served else []) + mine:
            unrecorded = e.get("eval_unrecorded")  # (a list, or nothing: a record edited by hand)
            for ev in [e, *(unrecorded if isinstance(unrecorded, list) else ())]:
                if isinstance(ev, dict) and finite_number(ev.get("eval/policy_version")) and finite_number(ev.get("eval/reward_mean")):
                    found[int(ev["eval/policy_version"])] = ev["eval/reward_mean"]
        failure = next((str(e["failure"]) for e in reversed(mine) if e.get("failure")), None)
        rows.append({"name": name, "served": served, "algorithm": last.get("algorithm", "?"),
                     "state": last.get("state", "?"), "steps_trained": last.get("steps_trained"),
                     "skipped_steps": last.get("skipped_steps", 0), "failure": failure,
                     "train_reward": sum(rewards) / len(rewards) if rewards else None,
                     "evals": [(through.get(v, joined + v), v, found[v]) for v in sorted(found)],
                     "loss": [(k + 1, e["loss"]) for k, e in trained.items() if finite_number(k) and finite_number(e.get("loss"))]})
    return rows


LEARNER_COLUMNS = ["learner", "algorithm", "state", "steps trained / skipped",
                   f"train reward (last {LEARNER_WINDOW})", "eval first {arrow} last"]


def learner_cells(row: dict, arrow: str = "->") -> list[str]:
    """A learner's cells under :data:`LEARNER_COLUMNS` (the failure is left to the caller)."""
    evals = row["evals"]
    if evals:
        (_, v0, e0), (_, v1, e1) = evals[0], evals[-1]
        ev = f"{e0:.3f} (v{v0})" + (f" {arrow} {e1:.3f} (v{v1})" if len(evals) > 1 else "")
    else:
        ev = "-"
    steps = row["steps_trained"] if row["steps_trained"] is not None else "-"
    return [row["name"] + (" (served)" if row["served"] else ""), str(row["algorithm"]), str(row["state"]),
            f"{steps} / {row['skipped_steps'] or 0}",
            f"{row['train_reward']:.3f}" if row["train_reward"] is not None else "-", ev]
