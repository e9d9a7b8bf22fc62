"""The report's figures, one PNG each, drawn with matplotlib's Agg canvas (no display, no
pyplot state: safe at the end of a run in any process).

Every function takes ``series``, a list of ``(label, records)`` (a run's ``metrics.jsonl``
records, oldest first), draws every run on the same axes in its own colour (``C0``, ``C1``, ...
in list order) and returns whether it wrote ``path`` (False: nothing to draw, e.g. no ranker).
The per-worker timeline and the learners are the exceptions: one run per figure (:func:`timeline`,
:func:`learners`).

matplotlib and numpy are imported by the caller's first use of this module, never by
``import streamrl``.
"""

from __future__ import annotations


import io
import math
from collections import Counter
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from streamrl.telemetry import timeline as tl
from streamrl.telemetry.run_files import write_replacing
from streamrl.telemetry.text import one_line

Series = list[tuple[str, list[dict]]]

DPI = 100
WIDE = (9.0, 3.6)
KIND_COLOURS = {tl.GENERATE: "#4C72B0", tl.REWARD: "#DD8452", tl.TRAIN: "#55A868", tl.OPTIMIZER: "#1B4D2B"}
KIND_LEGEND = {tl.GENERATE: "generate (engine had requests)", tl.REWARD: "reward (gen. end to scored, upper bound)",
               tl.TRAIN: "train task", tl.OPTIMIZER: "optimizer step (upper bound)"}


def figure(size: tuple[float, float], cols: int = 1, rows: int = 1, **kw):
    """A figure of ``size`` inches at the report's resolution with ``rows`` x ``cols`` axes (a
    flat list), their x ticks whole numbers (steps, versions and staleness are)."""
    fig = Figure(figsize=size, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False, **kw)
    for ax in axes.flat:  # steps, versions and staleness are whole numbers
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
    return fig, list(axes.flat)


def save_figure(fig, path: Path) -> bool:
    """Write ``fig`` to ``path`` at the report's resolution; True (every plot returns whether it drew)."""
    png = io.BytesIO()
    fig.savefig(png, dpi=DPI, format="png")
    write_replacing(Path(path), png.getvalue())  # (a link where the image goes is replaced, not written through)
    return True


def _steps(records: list[dict]) -> np.ndarray:
    """1-based step numbers (what the console prints as ``step k/n``)."""
    return np.array([r.get("step", i) + 1 for i, r in enumerate(records)], dtype=float)


def _values(records: list[dict], key: str) -> np.ndarray:
    return np.array([r.get(key, np.nan) if isinstance(r.get(key), (int, float)) else np.nan for r in records],
                    dtype=float)


def smoothing(n: int) -> int:
    """Trailing-mean window for a curve of ``n`` steps: about a fifteenth of the run, so a long
    run's trend shows through its per-step noise and a short run is drawn as is."""
    return max(1, round(n / 15))


def _trend(ax, x: np.ndarray, y: np.ndarray, colour: str, label: str) -> int:
    """Per-step values as a thin line and their trailing mean as a bold one; returns the window."""
    w = smoothing(len(y))
    if w == 1:
        ax.plot(x, y, color=colour, lw=1.8, marker="o" if len(y) <= 12 else None, ms=3, label=label)
        return 1
    ax.plot(x, y, color=colour, lw=0.8, alpha=0.35)
    # the mean of the values there are (a step without the field counts neither way)
    have = ~np.isnan(y)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = (np.convolve(np.where(have, y, 0.0), np.ones(w), mode="valid")
                / np.convolve(have.astype(float), np.ones(w), mode="valid"))
    ax.plot(x[w - 1:], mean, color=colour, lw=2.0, label=label)
    return w


def legend_label(label: str) -> str:
    """``label`` as a legend shows it: matplotlib leaves out of a legend every artist whose label
    starts with ``_`` (its mark of a hidden one), so a run named ``_baseline`` gets a space first."""
    return " " + label if label.startswith("_") else label


def _labelled(series: Series) -> Series:
    """``series`` with each label as :func:`legend_label` makes it."""
    return [(legend_label(label), records) for label, records in series]


def _legend(ax, **kw) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, **kw)


def reward(series: Series, path: Path) -> bool:
    """Training reward per step; beside it the held-out evaluation (``eval/...``) by policy
    version when any run has one."""
    series = _labelled(series)
    evals = [(label, eval_points(records)) for label, records in series]
    with_eval = any(points for _, points in evals)
    fig, axes = figure((11.0, 3.8) if with_eval else WIDE, cols=2 if with_eval else 1)
    ax = axes[0]
    windows = set()
    for i, (label, records) in enumerate(series):
        windows.add(_trend(ax, _steps(records), _values(records, "reward_mean"), f"C{i}", label))
    how = "" if windows == {1} else f"  (thin: per step; bold: mean of the last {'/'.join(map(str, sorted(windows)))})"
    ax.set(title="Training reward" + how, xlabel="step", ylabel="mean reward of the step's samples")
    ax.title.set_fontsize(10)
    ax.grid(alpha=0.3)
    _legend(ax)
    if with_eval:
        ax = axes[1]
        styles = ["-", "--", ":", "-."]
        # the scores only (a response length or a reward's side values would need axes of their own)
        metrics = sorted({k for _, points in evals for p in points for k in p
                          if k == "eval/reward_mean" or k.startswith("eval/pass@")},
                         key=lambda k: (k != "eval/pass@1", k))
        for i, (label, points) in enumerate(evals):
            x = [p["eval/policy_version"] for p in points]
            for j, key in enumerate(metrics):
                y = [p.get(key, np.nan) for p in points]
                name = key.removeprefix("eval/")
                ax.plot(x, y, color=f"C{i}", ls=styles[j % len(styles)], marker="o", ms=4,
                        label=name if len(series) == 1 else f"{label}: {name}")
        ax.set(title="Held-out evaluation", xlabel="policy version (steps trained)", ylabel="score")
        ax.title.set_fontsize(10)
        ax.grid(alpha=0.3)
        _legend(ax)
    return save_figure(fig, path)


def eval_points(records: list[dict]) -> list[dict]:
    """Every evaluation of a run (its ``eval/...`` numbers, ``eval/policy_version`` first), one
    per policy version, oldest first: those in the records and those the last record lists as
    not recorded (``eval_unrecorded``). Failed evaluations (no numbers) are left out."""
    found: dict[int, dict] = {}
    for rec in records:
        # (a record edited by hand or another program's: ``eval_unrecorded`` is read only as a
        # list, a version only as a finite number; anything else is no evaluation, not a crash)
        unrecorded = rec.get("eval_unrecorded")
        for ev in [rec, *(unrecorded if isinstance(unrecorded, list) else ())]:
            version = ev.get("eval/policy_version") if isinstance(ev, dict) else None
            if isinstance(version, bool) or not isinstance(version, (int, float)) or abs(version) > 2 ** 53 \
                    or not math.isfinite(version):  # (abs first: isfinite of an int past a float's range raises)
                continue
            nums = {k: v for k, v in ev.items() if k.startswith("eval/") and k != "eval/prompts"
                    and isinstance(v, (int, float))}
            if len(nums) > 1:
                found[int(ev["eval/policy_version"])] = nums
    return [found[v] for v in sorted(found)]


def response_length(series: Series, path: Path) -> bool:
    """Response-length distribution per step: the mean, the 10th-90th percentile band and the
    longest response."""
    series = _labelled(series)
    fig, (ax,) = figure(WIDE)
    one = len(series) == 1
    for i, (label, records) in enumerate(series):
        # the steps with a per-sample log (a long run's report reads every k-th step's)
        logged = [(x, [s["response_len"] for s in rec["sample_log"] if "response_len" in s])
                  for x, rec in zip(_steps(records), records) if rec.get("sample_log")]
        logged = [(x, lens) for x, lens in logged if lens]
        x = np.array([x for x, _ in logged], dtype=float)
        q = np.array([np.percentile(lens, [10, 90, 100]) for _, lens in logged]).reshape(-1, 3)
        # the mean, not the median: lengths of a few tokens make a median jump between integers
        ax.fill_between(x, q[:, 0], q[:, 1], color=f"C{i}", alpha=0.25 if one else 0.12, lw=0,
                        label="10th-90th percentile" if one else None)
        ax.plot(_steps(records), _values(records, "response_len_mean"), color=f"C{i}", lw=1.8,
                label="mean" if one else label)
        ax.plot(x, q[:, 2], color=f"C{i}", lw=0.8, ls=":", label="longest" if one else None)
    ax.set(title="Response length per step" + ("" if one else "  (line: mean, band: 10th-90th percentile, "
                                                               "dotted: longest)"),
           xlabel="step", ylabel="response length (tokens)")
    ax.title.set_fontsize(10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    _legend(ax)
    return save_figure(fig, path)


def throughput(series: Series, path: Path) -> bool:
    """Samples and response tokens trained per second of step time, per step."""
    series = _labelled(series)
    fig, axes = figure((11.0, 3.6), cols=2)
    for key, ax, what in (("samples_per_s", axes[0], "samples/s"), ("tokens_per_s", axes[1], "response tokens/s")):
        windows = set()
        for i, (label, records) in enumerate(series):
            windows.add(_trend(ax, _steps(records), _values(records, key), f"C{i}", label))
        how = "" if windows == {1} else f"  (bold: mean of the last {'/'.join(map(str, sorted(windows)))} steps)"
        ax.set(title=f"Throughput: {what}{how}", xlabel="step",
               ylabel=f"{what} (trained, per second of step)")
        ax.title.set_fontsize(10)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    _legend(axes[0])
    return save_figure(fig, path)


def idle(series: Series, path: Path) -> bool:
    """Each pool's idle ratio per step, as the workers' busy clocks measured it (``pools``)."""
    series = _labelled(series)
    # (a run folder's files may name any number of pools: the first few are drawn)
    pools = list(dict.fromkeys(p for _, records in series for r in records
                               for p in (r.get("pools") if isinstance(r.get("pools"), dict) else {})))[:16]
    if not pools:
        return False
    fig, axes = figure((3.6 * len(pools) + 0.6, 3.4), cols=len(pools), sharey=True)
    for ax, pool in zip(axes, pools):
        for i, (label, records) in enumerate(series):
            y = np.array([r.get("pools", {}).get(pool, {}).get("idle_ratio", np.nan) for r in records], dtype=float)
            _trend(ax, _steps(records), 100 * y, f"C{i}", label)
        ax.set_xlabel("step")
        ax.set_title(f"{one_line(str(pool), 40)} pool", fontsize=10, parse_math=False)  # (its name as text)
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("idle, % of worker time")
    fig.suptitle("Bubbles: share of each pool's worker time spent idle, per step (measured by the workers)",
                 fontsize=10)
    _legend(axes[0])
    return save_figure(fig, path)


#: Staleness values drawn as bars of their own; those past it share the last bar ("24+").
MAX_STALENESS_BARS = 24


def staleness(series: Series, path: Path) -> bool:
    """Histogram of sample staleness (policy versions between generating and training a sample)."""
    series = _labelled(series)
    # (whole numbers only, the tail past MAX_STALENESS_BARS in its last bar: a record edited by
    # hand with thousands of values would draw a bar and a tick for each)
    counts = [Counter(min(s["staleness"], MAX_STALENESS_BARS) for r in records for s in r.get("sample_log", ())
                      if isinstance(s.get("staleness"), int) and not isinstance(s["staleness"], bool)
                      and 0 <= s["staleness"] < 2**53)
              for _, records in series]
    if not any(counts):
        return False
    fig, (ax,) = figure((min(14.0, max(4.5, 1.2 + 0.9 * len({k for c in counts for k in c}) * len(series) ** 0.5)),
                          3.4))
    width = 0.8 / len(series)
    for i, ((label, _), c) in enumerate(zip(series, counts)):
        total = sum(c.values()) or 1
        xs = sorted(c)
        bars = ax.bar([x - 0.4 + width * (i + 0.5) for x in xs], [100 * c[x] / total for x in xs], width,
                      color=f"C{i}", label=label)
        if len(series) == 1:
            ax.bar_label(bars, fmt="%.0f%%", fontsize=8)
    ticks = sorted({k for c in counts for k in c})
    ax.set_xticks(ticks, [f"{k}+" if k == MAX_STALENESS_BARS else str(k) for k in ticks])
    ax.set(title="Sample staleness", xlabel="staleness (policy versions behind the trained one)",
           ylabel="% of samples")
    ax.title.set_fontsize(10)
    ax.grid(alpha=0.3, axis="y")
    if len(series) > 1:  # beside the axes: the bars reach the top
        _legend(ax, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return save_figure(fig, path)


def off_policy(series: Series, path: Path) -> bool:
    """How off-policy each step's tokens were, per staleness bucket: the importance weights'
    effective sample size and the k3 KL to the behaviour policy (``offpolicy/<b>/...``)."""
    series = _labelled(series)
    buckets = [b for b in ("0", "1", "2-3", "4+")
               if any(f"offpolicy/{b}/ess" in r for _, records in series for r in records)]
    if not buckets:
        return False
    fig, axes = figure(WIDE, cols=2)
    styles = ["-", "--", ":", "-."]
    for i, (label, records) in enumerate(series):
        for j, b in enumerate(buckets):
            name = f"{label}, {b} stale" if len(series) > 1 else f"{b} versions stale"
            for ax, key in zip(axes, ("ess", "k3")):
                ax.plot(_steps(records), _values(records, f"offpolicy/{b}/{key}"), color=f"C{j}",
                        ls=styles[i % len(styles)], marker="o", ms=2, label=name)
    axes[0].axhline(0.5, color="grey", ls="--", lw=1, label="flagged below (0.5)")
    axes[0].set(title="Importance weights' effective sample size", xlabel="step", ylabel="ESS (0-1]")
    axes[0].set_ylim(0, 1.02)
    axes[1].set(title="KL(behaviour || trained), k3 per token", xlabel="step", ylabel="nats")
    for ax in axes:
        ax.title.set_fontsize(10)
        ax.grid(alpha=0.3)
    _legend(axes[0])
    return save_figure(fig, path)


def ranker(series: Series, path: Path) -> bool:
    """The length ranker's recall of each step's longest 20% of responses (``ranker_recall``)."""
    series = _labelled(series)
    have = [(i, label, records) for i, (label, records) in enumerate(series)
            if any("ranker_recall" in r for r in records)]
    if not have:
        return False
    fig, (ax,) = figure(WIDE)
    for i, label, records in have:
        ax.plot(_steps(records), _values(records, "ranker_recall"), color=f"C{i}", marker="o", ms=3, label=label)
    ax.axhline(0.2, color="grey", ls="--", lw=1, label="a random guess (0.2)")
    ax.set(title="Length ranker: share of the step's longest 20% of responses it predicted in its top 20%",
           xlabel="step", ylabel="recall")
    ax.title.set_fontsize(10)
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    _legend(ax)
    return save_figure(fig, path)


def learners(label: str, rows: list[dict], path: Path) -> bool:
    """One run's learners (``learner_figures.learner_figures``), one line each, labelled with its name and
    algorithm: the held-out reward of every evaluation by the stream step its policy had trained
    through, or, when no learner was evaluated, the train loss per step. The served learner is
    drawn bold; a failed learner's last point is a cross."""
    with_eval = any(row["evals"] for row in rows)
    if not (with_eval or any(row["loss"] for row in rows)):
        return False
    fig, (ax,) = figure(WIDE)
    windows = set()
    for i, row in enumerate(rows):
        points = [(x, y) for x, _, y in row["evals"]] if with_eval else row["loss"]
        if not points:
            continue
        x, y = np.array(points, dtype=float).T
        name = legend_label(f"{row['name']} ({row['algorithm']}" + (", served" if row["served"] else "") + (
            f", {row['state']}" if row["state"] != "training" else "") + ")")
        if with_eval:
            ax.plot(x, y, color=f"C{i}", lw=2.4 if row["served"] else 1.5, marker="o", ms=3.5, label=name)
        else:
            windows.add(_trend(ax, x, y, f"C{i}", name))
        if row["state"] == "failed":
            ax.plot(x[-1:], y[-1:], color=f"C{i}", marker="X", ms=10, ls="none")
    if with_eval:
        ax.set(title=f"{label}: held-out reward per learner", ylabel="held-out mean reward",
               xlabel="stream step (the evaluated policy had trained through it)")
    else:
        how = "" if windows <= {1} else f"; thin: per step, bold: mean of the last {'/'.join(map(str, sorted(windows)))}"
        ax.set(title=f"{label}: train loss per learner (no held-out evaluation{how})", xlabel="step", ylabel="loss")
    ax.title.set_fontsize(10)
    ax.grid(alpha=0.3)
    _legend(ax, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return save_figure(fig, path)
