"""``streamrl report``: plots and ``report.md`` for one or several run folders.

:func:`write_report` reads each folder's ``metrics.jsonl`` (and ``recipe.toml`` for its name and
mode), draws the figures of ``telemetry/plots.py`` into ``plots/`` (several runs overlaid on
the same axes, except the per-worker timeline: one per run) and writes ``report.md`` beside it
with a summary table and the images. The runner calls it at the end of every run, so it is
cheap (about a second for a 120-step run) and a plot that fails is a warning, never the end of
the run.
"""

from __future__ import annotations

import json
import re
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from streamrl.errors import UserError

#: steps shown in the per-worker timeline (more and the bars get too thin to read)
TIMELINE_STEPS = 3


@dataclass
class Run:
    """One run folder as the report needs it."""

    path: Path
    records: list[dict]
    name: str
    mode: str
    state: str = "?"
    recipe: dict = field(default_factory=dict)
    label: str = ""

    @property
    def serial_train(self) -> bool:
        """Whether each train worker runs one task at a time (``pools.train.threads``, default 1)."""
        return int(self.recipe.get("pools", {}).get("train", {}).get("threads", 1) or 1) <= 1


def warn(text: str) -> None:
    """A problem with the report, not with the run: one line on stderr."""
    print(f"streamrl: warning: report: {text}", file=sys.stderr)


def load_run(path: Path) -> Run:
    """The records, name and mode of the run folder ``path``; a folder without steps is a
    :class:`UserError` naming it. A damaged line (a run killed while writing it) is skipped."""
    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not path.is_dir():
        raise UserError(f"{path}: no such run folder")
    if not metrics.is_file():
        raise UserError(f"{path}: no metrics.jsonl (not a run folder, or the run stopped before its first step)")
    lines = [line for line in metrics.read_text(errors="replace").splitlines() if line.strip()]
    keep = logged_steps(len(lines))
    records, bad = [], 0
    for i, line in enumerate(lines):
        rec = _parse(line, with_log=keep(i))
        if isinstance(rec, dict) and "reward_mean" in rec:
            records.append(rec)
        else:
            bad += 1
    if not records:
        raise UserError(f"{path}: metrics.jsonl has no step records")
    if bad:
        warn(f"{metrics}: skipped {bad} unreadable line(s)")
    try:
        recipe = tomllib.loads((path / "recipe.toml").read_text())
    except (OSError, ValueError):
        recipe = {}
    try:
        state = json.loads((path / "status.json").read_text()).get("state", "?")
    except (OSError, ValueError, AttributeError):
        state = "?"
    run = recipe.get("run", {})
    # (a folder is <name>-<yyyymmdd>-<hhmmss>[-n]; without its recipe that is the best name)
    name = run.get("name") or re.sub(r"-\d{8}-\d{6}(-\d+)?$", "", path.resolve().name)
    return Run(path, records, name, run.get("mode", "?"), state, recipe)


#: steps whose per-sample log is read, at most (spread over the run, the last ones always):
#: parsing it is most of the cost of a long run's report, and the plots need no more
MAX_LOGGED_STEPS = 240
#: the last steps, whose per-sample log the worker timeline needs
LAST_STEPS = TIMELINE_STEPS + 3
LOG_KEY = ', "sample_log": ['


def logged_steps(n: int):
    """For a run of ``n`` lines: whether line ``i``'s ``sample_log`` is read (all of a run of
    up to :data:`MAX_LOGGED_STEPS` steps; else every k-th step and the last few)."""
    every = -(-n // MAX_LOGGED_STEPS)
    return lambda i: i % every == 0 or i >= n - LAST_STEPS


def _parse(line: str, with_log: bool) -> dict | None:
    """One ``metrics.jsonl`` line; without ``with_log``, its ``sample_log`` (written last, the
    bulk of the line) is cut off unparsed. None for a damaged line."""
    if not with_log:
        cut = line.find(LOG_KEY)
        if cut > 0:
            try:
                return json.loads(line[:cut] + "}")
            except ValueError:
                pass  # (the key inside some text value: parse it all)
    try:
        return json.loads(line)
    except ValueError:
        return None


def write_report(run_dirs: list[Path], out: Path | None = None) -> Path | None:
    """Write the plots and ``report.md`` (into ``out``, default the first run folder); returns
    the report's path.

    A folder without steps is a one-line :class:`UserError` naming it (``streamrl report``).
    The run's own end-of-run call catches any failure and warns: the run's outcome matters more."""
    if not run_dirs:
        raise UserError("report: name at least one run folder")
    runs = [load_run(Path(d)) for d in run_dirs]
    _label(runs)
    out = Path(out) if out is not None else Path(run_dirs[0])
    plot_dir = out / "plots"
    try:
        plot_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{out}: cannot write the report there ({exc.strerror})") from None

    from streamrl.telemetry import plots  # matplotlib: only when a report is drawn

    series = [(r.label, r.records) for r in runs]
    figures = [("reward", "Reward", plots.reward,
                "Mean reward of each step's training samples" + (
                    "; beside it the held-out evaluation (`[eval]`), by the policy version evaluated."
                    if any(plots.eval_points(r.records) for r in runs) else ".")),
               ("response-length", "Response length", plots.response_length,
                "How long the responses were, step by step: the mean and the spread between the "
                "10th and 90th percentiles (the dotted line is the longest)."),
               ("throughput", "Throughput", plots.throughput,
                "Samples and response tokens trained per second of wall time, per step."),
               ("idle", "Idle per pool", plots.idle,
                "Share of each pool's worker time spent idle in each step, from the busy clocks on the "
                "workers: the bubbles streaming and async are meant to shrink."),
               ("staleness", "Staleness", plots.staleness,
                "How many policy versions behind the trained policy each sample was generated "
                "(0: on-policy; async runs allow up to `run.max_staleness`)."),
               ("ranker", "Length ranker", plots.ranker,
                "How well the output-length ranker picked out the step's longest responses.")]
    sections = []
    for stem, title, draw, blurb in figures:
        png = _draw(draw, series, plot_dir / f"{stem}.png", title.lower())
        if png:
            sections.append(f"## {title}\n\n{blurb}\n\n![{title}](plots/{png.name})\n")
    timelines = []
    for i, run in enumerate(runs):
        name = f"timeline-{i + 1}.png" if len(runs) > 1 else "timeline.png"
        png = _draw(lambda s, p, run=run: plots.timeline(run.label, run.records, p, run.serial_train, TIMELINE_STEPS),
                    series, plot_dir / name, f"timeline of {run.label}")
        if png:
            timelines.append(f"![Worker timeline of {run.label}](plots/{png.name})\n")
    if timelines:
        sections.append("## Who was busy when\n\n" + TIMELINE_HELP + "\n\n" + "\n".join(timelines))
    report = out / "report.md"
    text = (f"# streamrl report\n\n{len(runs)} run{'s' if len(runs) > 1 else ''}, written "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')}.\n\n{summary_table(runs)}\n" + "\n".join(sections))
    try:
        report.write_text(text)
    except OSError as exc:
        raise UserError(f"{report}: cannot write ({exc.strerror})") from None
    return report


TIMELINE_HELP = (
    "One row per worker, a bar while it was busy, over a few steps near the end of the run "
    "(shaded and unshaded: one step each); the number at the right is the row's busy share of "
    "that window. The gaps are the bubbles: a generate row idle while a train row is busy is "
    "generation waiting for new weights; a train row idle while generate rows are busy is "
    "training waiting for samples. Drawn from `metrics.jsonl`'s `sample_log`: generate bars "
    "are the engine's `gen_start` to `gen_end` (exact); a reward bar runs from a group's last "
    "`gen_end` to its `reward_end` and a train task from its inputs being ready (or the "
    "worker's previous task ending) to `trained`, so those two include transfers and waiting "
    "(upper bounds). Weight loads and the controller's work are not logged: they show as gaps.")


def _draw(draw, series, path: Path, what: str) -> Path | None:
    """Draw one figure; a failure is a warning (the other figures and the report go on)."""
    try:
        return path if draw(series, path) else None
    except Exception as exc:
        warn(f"the {what} plot failed: {type(exc).__name__}: {exc}")
        return None


def _label(runs: list[Run]) -> None:
    """Each run's legend label: its name and mode, with the folder's time when two would match."""
    for run in runs:
        run.label = f"{run.name} ({run.mode})"
    seen = [r.label for r in runs]
    for run in runs:
        if seen.count(run.label) > 1:
            stamp = re.search(r"\d{8}-(\d{6}(-\d+)?)$", run.path.resolve().name)
            run.label = f"{run.name} ({run.mode}, {stamp.group(1) if stamp else run.path.name})"


def summary_table(runs: list[Run]) -> str:
    """The markdown table of the runs: recipe name, mode, steps, reward first -> last (mean of the
    first and last ten steps, as the run's last console line; a quarter of a shorter run),
    samples/s, run time, idle per pool."""
    pools = list(dict.fromkeys(p for run in runs for r in run.records for p in r.get("pools", {})))
    head = ["run", "mode", "steps", "state", "reward first → last", "samples/s", "run time",
            *(f"idle {p}" for p in pools), "folder"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        recs = run.records
        k = min(10, max(1, len(recs) // 4))
        first = sum(r["reward_mean"] for r in recs[:k]) / k
        last = sum(r["reward_mean"] for r in recs[-k:]) / k
        wall = sum(r.get("step_s", 0.0) for r in recs)
        rate = sum(r.get("samples", 0) for r in recs) / wall if wall > 0 else float("nan")
        idle = []
        for p in pools:
            busy = sum(r.get("pools", {}).get(p, {}).get("busy_s", 0.0) for r in recs)
            free = sum(r.get("pools", {}).get(p, {}).get("idle_s", 0.0) for r in recs)
            idle.append(f"{free / (busy + free):.0%}" if busy + free > 0 else "-")
        steps = run.recipe.get("run", {}).get("steps")
        cells = [run.name, run.mode, f"{len(recs)}" + (f" of {steps}" if steps and steps != len(recs) else ""),
                 run.state, f"{first:.3f} → {last:.3f}", f"{rate:.1f}", _duration(wall), *idle,
                 f"`{run.path}`"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + ("\n\nReward: mean of the first and of the last ten steps (a quarter of a shorter run). "
                                "Run time: the steps' wall time (starting the cluster and saving not included). Idle: "
                                "share of the pool's worker time over the whole run, from the workers' busy clocks.\n")


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds // 60:.0f} min {seconds % 60:02.0f} s"
