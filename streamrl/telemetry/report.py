"""``streamrl report``: plots and ``report.md`` for one or several run folders.

:func:`write_report` reads each folder's ``metrics.jsonl`` (and ``recipe.toml`` for its name and
mode), draws the figures of ``telemetry/plots.py`` into ``plots/`` (several runs overlaid on
the same axes, except the per-worker timeline and the learners: one per run) and writes
``report.md`` beside it with a summary table and the images. A run with several learners
(``[[learners]]``) gets a table of them and ``learners.png``, one curve per learner. The runner calls it at the end of every run, so it is
cheap (about a second for a 120-step run) and a plot that fails is a warning, never the end of
the run.
"""

from __future__ import annotations

import html
import json
import re
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from streamrl.errors import UserError
from streamrl.telemetry.learner_figures import (LEARNER_COLUMNS, LEARNER_WINDOW, learner_cells, learner_figures,
                                               learners_final)
from streamrl.telemetry.run_files import finite_number, lines_of, small_text, write_replacing
from streamrl.telemetry.text import error_line, one_line

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
        threads = _table(_table(self.recipe, "pools"), "train").get("threads", 1)
        return not finite_number(threads) or threads <= 1


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
    # (twice through the file, a line at a time: the count first, to choose whose sample logs
    # are read; a long run's file is not held whole beside the records parsed from it)
    try:
        keep = logged_steps(sum(1 for _ in lines_of(metrics)))
        records, bad = [], 0
        for i, line in enumerate(lines_of(metrics)):
            rec = _parse(line, with_log=keep(i)) if line is not None else None
            if _step_record(rec):
                records.append(rec)
            else:
                bad += 1
    except OSError as exc:
        raise UserError(f"{metrics}: cannot be read ({error_line(exc, 200)})") from None
    if not records:
        raise UserError(f"{path}: metrics.jsonl has no step records")
    if bad:
        warn(f"{metrics}: skipped {bad} unreadable line(s)")
    try:
        recipe = tomllib.loads(small_text(path / "recipe.toml"))
    except (OSError, ValueError, RecursionError):
        recipe = {}
    try:
        state = json.loads(small_text(path / "status.json")).get("state", "?")
    except (OSError, ValueError, AttributeError, RecursionError):
        state = "?"
    run = _table(recipe, "run")
    # (a folder is <name>-<yyyymmdd>-<hhmmss>[-n]; without its recipe that is the best name)
    name = run.get("name") if isinstance(run.get("name"), str) else ""
    name = name or re.sub(r"-\d{8}-\d{6}(-\d+)?$", "", path.resolve().name)
    return Run(path, records, name, str(run.get("mode", "?")), str(state), recipe)


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
    except (ValueError, RecursionError):  # (RecursionError: JSON nested past the parser's reach)
        return None


def _step_record(rec) -> bool:
    """Whether a parsed line has the shape of a step record where the report reads it: a finite
    ``reward_mean``, and ``pools`` / ``learners`` (when there) tables of tables. Anything else
    (a line edited by hand, another program's) is skipped and counted, not read into a crash."""
    if not isinstance(rec, dict):
        return False
    if not finite_number(rec.get("reward_mean")):
        return False
    for key in ("pools", "learners"):
        value = rec.get(key)
        if value is None:  # (null where a table goes: none, as an absent one)
            rec.pop(key, None)
        elif not (isinstance(value, dict) and all(isinstance(v, dict) for v in value.values())):
            return False
    return True


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
    if plot_dir.is_symlink():  # (the plots would be written wherever it points)
        raise UserError(f"{plot_dir}: a link, not a folder of the report's own; move it aside")
    try:
        plot_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{out}: cannot write the report there ({exc.strerror})") from None

    from streamrl.telemetry import plots, timeline_plot  # matplotlib: only when a report is drawn

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
               ("off-policy", "Off-policy tokens", plots.off_policy,
                "How far the trained policy was from the one that generated the tokens it trained on, by "
                "the tokens' staleness: the effective sample size of the importance weights (1: every token "
                "counts alike; under 0.5 the console warns) and the k3 estimate of the KL between the two. "
                "Staleness 0 shows the engine's and trainer's disagreement on the same weights."),
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
        png = _draw(lambda s, p, run=run: timeline_plot.timeline(run.label, run.records, p, run.serial_train,
                                                                     TIMELINE_STEPS),
                    series, plot_dir / name, f"timeline of {run.label}")
        if png:
            timelines.append(f"![Worker timeline of {md_text(run.label)}](plots/{png.name})\n")
    if timelines:
        sections.append("## Who was busy when\n\n" + TIMELINE_HELP + "\n\n" + "\n".join(timelines))
    # many learners on one stream: a table and a plot per run that had them, right after the summary
    with_learners = [(run, rows) for run in runs if (rows := learner_figures(run.records, learners_final(run.path)))]
    parts = []
    for i, (run, rows) in enumerate(with_learners):
        name = f"learners-{i + 1}.png" if len(with_learners) > 1 else "learners.png"
        png = _draw(lambda s, p, run=run, rows=rows: plots.learners(run.label, rows, p), series,
                    plot_dir / name, f"learners of {run.label}")
        parts.append((f"### {md_text(run.label)}\n\n" if len(with_learners) > 1 else "") + learners_table(rows)
                     + (f"\n![Learners of {md_text(run.label)}](plots/{png.name})\n" if png else ""))
    if parts:
        sections.insert(0, "## Learners\n\n" + LEARNERS_HELP + "\n\n" + "\n".join(parts))
    report = out / "report.md"
    text = (f"# streamrl report\n\n{len(runs)} run{'s' if len(runs) > 1 else ''}, written "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')}.\n\n{summary_table(runs)}\n" + "\n".join(sections))
    try:
        write_replacing(report, text.encode())
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
    import matplotlib  # (imported already: the caller imported plots)

    try:
        # a run's name is text: ``$...$`` in it is not mathtext (which would fail every figure
        # that shows the name, or draw it as a formula)
        with matplotlib.rc_context({"text.parse_math": False}):
            return path if draw(series, path) else None
    except Exception as exc:
        warn(one_line(f"the {what} plot failed: {error_line(exc)}"))  # (the text may quote a run's name)
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
    pools = list(dict.fromkeys(p for run in runs for r in run.records for p in _pools(r)))[:MAX_POOLS]
    head = ["run", "mode", "steps", "state", "reward first → last", "samples/s", "run time",
            *(f"idle {md_text(p, 40)}" for p in pools), "folder"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        recs = run.records
        k = min(10, max(1, len(recs) // 4))
        first = sum(r["reward_mean"] for r in recs[:k]) / k
        last = sum(r["reward_mean"] for r in recs[-k:]) / k
        wall = sum(_number(r.get("step_s")) for r in recs)
        rate = sum(_number(r.get("samples")) for r in recs) / wall if wall > 0 else float("nan")
        idle = []
        for p in pools:
            busy = sum(_number(r.get("pools", {}).get(p, {}).get("busy_s")) for r in recs)
            free = sum(_number(r.get("pools", {}).get(p, {}).get("idle_s")) for r in recs)
            idle.append(f"{free / (busy + free):.0%}" if busy + free > 0 else "-")
        steps = _table(run.recipe, "run").get("steps")
        cells = [run.name, run.mode, f"{len(recs)}" + (f" of {steps}" if steps and steps != len(recs) else ""),
                 run.state, f"{first:.3f} → {last:.3f}", f"{rate:.1f}", _duration(wall), *idle]
        # (the folder whole: its tail, the run's time stamp, is what tells two runs apart)
        lines.append("| " + " | ".join([*map(md_text, cells), md_text(run.path, MAX_PATH_CELL)]) + " |")
    return "\n".join(lines) + ("\n\nReward: mean of the first and of the last ten steps (a quarter of a shorter run). "
                                "Run time: the steps' wall time (starting the cluster and saving not included). Idle: "
                                "share of the pool's worker time over the whole run, from the workers' busy clocks.\n")


#: the most characters of a cell of report.md's tables (a name, a state, a folder): a cell, not a page
MAX_CELL = 100
#: ... of a learner's failure, the cell that explains it
MAX_FAILURE_CELL = 300
#: ... of a run's folder (a path is as long as the file system lets it be; cut, it names no run)
MAX_PATH_CELL = 4096
#: markdown's characters that would start markup in a cell or a heading (a link, emphasis, code,
#: the cell's end), each escaped with a backslash
_MARKDOWN = str.maketrans({c: "\\" + c for c in "\\`*_[]|~"})


#: The most pools the report's table and plot show (a run folder's files may say anything).
MAX_POOLS = 16


def _pools(record: dict) -> list[str]:
    pools = record.get("pools")
    return [p for p in pools if isinstance(p, str)] if isinstance(pools, dict) else []


def md_text(value, limit: int = MAX_CELL) -> str:
    """``value`` as text in report.md (a table cell, a heading, an image's caption): one line of
    at most ``limit`` characters (cut with "…"), its HTML and markdown characters escaped, so a
    run's name or a learner's failure reads as written and cannot end its cell, open a tag or
    make a link."""
    text = str(value)[:limit + 1]  # (cut first: the cleaning below costs by the character)
    text = "".join(ch if ch.isprintable() else " " for ch in text)
    if len(text) > limit:
        text = text[:limit - 1] + "…"
    return html.escape(text, quote=False).translate(_MARKDOWN)


def _number(value) -> float:
    """``value`` where it is a finite number, else 0 (a field a record lacks or holds otherwise)."""
    return float(value) if finite_number(value) else 0.0


def _table(parent, key: str) -> dict:
    """``parent[key]`` where both are tables, else {} (a recipe.toml written by hand)."""
    value = parent.get(key) if isinstance(parent, dict) else None
    return value if isinstance(value, dict) else {}


def learners_table(rows: list[dict]) -> str:
    """The markdown table of a run's learners (one row each; a failure's text last, when one failed)."""
    failed = any(row["failure"] for row in rows)
    head = [c.format(arrow="→") for c in LEARNER_COLUMNS] + (["failure"] if failed else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [md_text(c) for c in learner_cells(row, "→")]
        cells += [md_text(row["failure"] or "", MAX_FAILURE_CELL)] if failed else []
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


LEARNERS_HELP = (
    "One row per learner: its state, the steps it trained and skipped, its train reward (the mean of "
    f"its last {LEARNER_WINDOW} trained steps: the stream's samples, so learners that trained the same steps read "
    "alike) and its held-out reward at its first and newest evaluation (vN: N steps trained; a side "
    "learner's final one from `learners.json`): what tells them apart. The plot draws every "
    "evaluation by the stream step the evaluated policy had trained through (without `[eval]`: "
    "each learner's train loss per step).")


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds // 60:.0f} min {seconds % 60:02.0f} s"
