"""The worker timeline of ``streamrl report``: one row per worker, a bar while it was busy, over
a few steps near the end of a run (``timeline.py`` finds the bars; ``plots.py`` the other
figures and what they share)."""

from __future__ import annotations

from pathlib import Path

from matplotlib.patches import Patch
from matplotlib.ticker import AutoLocator

from streamrl.telemetry import plots
from streamrl.telemetry import timeline as tl
from streamrl.telemetry.text import one_line


def window(records: list[dict], steps: int) -> tuple[int, int]:
    """The steps the timeline shows: the last ``steps`` before the final one, whose end is not
    typical (nothing is generated ahead for a step that will not come). Indices, inclusive."""
    n = len(records)
    hi = n - 2 if n > steps else n - 1
    return max(0, hi - steps + 1), hi


#: Rows the timeline draws at most: a big generate pool's first workers, and every other row.
MAX_ROWS = 24


def clocks(records: list[dict]) -> str:
    """The pools' busy share over ``records`` as the workers' busy clocks measured it (a line to
    check the drawn bars against), or "" without ``pools``."""
    parts = []
    for pool in list(dict.fromkeys(p for r in records for p in r.get("pools", {})))[:16]:
        busy = sum(r["pools"].get(pool, {}).get("busy_s", 0.0) for r in records)
        free = sum(r["pools"].get(pool, {}).get("idle_s", 0.0) for r in records)
        if busy + free > 0:
            parts.append(f"{one_line(str(pool), 40)} {busy / (busy + free):.0%}")  # (a name as text)
    return "\nbusy as measured on the workers (pool average): " + ", ".join(parts) if parts else ""


def timeline(label: str, records: list[dict], path: Path, serial_train: bool = True, steps: int = 3) -> bool:
    """One run's per-worker busy timeline over a few recent steps: one row per worker, a bar while
    it worked (see ``telemetry/timeline.py`` for what each bar is drawn from), its busy share at
    the right; the gaps are the bubbles."""
    timed = [r for r in records if "time" in r and "step_s" in r]
    if not timed:
        return False
    lo, hi = window(timed, steps)
    t0, t1 = timed[lo]["time"] - timed[lo]["step_s"], timed[hi]["time"]
    # the step before (where a worker's previous task ended) and the ones after (their samples
    # may have been generated inside the window)
    rows = tl.busy_bars(timed[max(0, lo - 1):hi + 3], serial_train)
    if not rows:
        return False
    names = list(rows)
    if len(names) > MAX_ROWS:  # a big generate pool: its first workers, and every other row (bounded too)
        others = [n for n in names if any(b.kind != tl.GENERATE for b in rows[n])]
        generate = [n for n in names if n not in others]
        others = others[:MAX_ROWS - 1]
        names = generate[:max(1, MAX_ROWS - len(others))] + others
    fig, (ax,) = plots.figure((10.0, 1.9 + 0.42 * len(names)))
    ax.xaxis.set_major_locator(AutoLocator())  # seconds
    for y, name in enumerate(names):
        for kind in tl.KINDS:
            spans = [(max(b.start, t0) - t0, min(b.end, t1) - max(b.start, t0)) for b in rows[name]
                     if b.kind == kind and b.end > t0 and b.start < t1]
            if spans:
                ax.broken_barh(spans, (y - 0.36, 0.72), facecolors=plots.KIND_COLOURS[kind], edgecolor="white", lw=0.3)
        busy = tl.busy_fraction(rows[name], t0, t1)
        ax.text(1.005, y, f"{busy:.0%}", transform=ax.get_yaxis_transform(), va="center", fontsize=8)
    for k in range(lo, hi + 1):  # alternate step backgrounds, labelled under the bars
        a, b = timed[k]["time"] - timed[k]["step_s"] - t0, timed[k]["time"] - t0
        if (k - lo) % 2 == 0:
            ax.axvspan(a, b, color="0.93", zorder=0)
        ax.text((a + b) / 2, len(names) - 0.45, f"step {timed[k].get('step', k) + 1}", ha="center",
                va="bottom", fontsize=8, color="0.35")
    ax.set_yticks(range(len(names)), [one_line(str(n), 40) for n in names], fontsize=8)  # (workers' names as text)
    ax.set_ylim(len(names) - 0.05, -0.6)  # (inverted: the first row on top, room for the labels below)
    ax.set_xlim(0, t1 - t0)
    ax.text(1.005, 1.0, "busy", transform=ax.transAxes, va="bottom", fontsize=8)
    more = f" ({len(names)} of {len(rows)} rows)" if len(names) < len(rows) else ""
    ax.set(xlabel=f"seconds since the start of step {timed[lo].get('step', lo) + 1}" + clocks(timed[lo:hi + 1]),
           title=f"{label}: who was busy when, steps {timed[lo].get('step', lo) + 1}-{timed[hi].get('step', hi) + 1} "
                 f"of {len(records)}{more}   (gaps: idle, waiting)")
    ax.title.set_fontsize(10)
    kinds = [k for k in tl.KINDS if any(b.kind == k for n in names for b in rows[n])]
    fig.legend(handles=[Patch(color=plots.KIND_COLOURS[k], label=plots.KIND_LEGEND[k]) for k in kinds], loc="outside lower center",
               ncol=len(kinds), fontsize=8, frameon=False)
    return plots.save_figure(fig, path)
