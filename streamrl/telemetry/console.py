"""What a run shows on the terminal: a live display, or one plain line per step, and a summary.

On a terminal, :class:`RunDisplay` is a ``rich`` live display: a progress bar (step N/M, elapsed,
ETA) over a small table of the latest figures (reward, eval score, samples/s, each pool's busy
share, staleness, policy version). Without a terminal (CI, a log file, ``--plain``) it prints
one line per step instead, every figure named. Messages printed meanwhile (warnings, elastic
events) scroll above the live part.

Library warnings (transformers' deprecations and the like) go to ``warnings.log`` in the run
folder, not the terminal (``warnings_log.py``).
"""

from __future__ import annotations

from rich.console import Console, Group
from rich.live import Live
from rich.padding import Padding
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from streamrl.telemetry.off_policy import LOW_ESS, lowest_ess_bucket
from streamrl.telemetry.run_files import finite_number
from streamrl.telemetry.learner_figures import LEARNER_COLUMNS, learner_cells, learner_figures, learners_final
from streamrl.telemetry.text import one_line, printable


def number(value, default: float | None = 0.0) -> float | None:
    """A record's field as a float where it is a finite number (not a bool), else ``default``:
    a resumed run's earlier records are read back from its ``metrics.jsonl``, which may have been
    edited, and the end of a long run must not fail on one of them."""
    return float(value) if finite_number(value) else default


def tables(value) -> dict:
    """A record's table of tables (``pools``, ``learners``) as such: what is not one is left out."""
    return {k: v for k, v in value.items() if isinstance(v, dict)} if isinstance(value, dict) else {}


def reward_errors_line(records: list[dict]) -> str | None:
    """The end of a run's line on its reward errors (markup), None when there were none."""
    errors = sum(number(rec.get("reward_errors")) for rec in records)
    if not errors:
        return None
    first = next((rec["reward_error_first"] for rec in records if rec.get("reward_error_first")), None)
    return (f"[yellow]reward errors: {errors:.0f} of {sum(number(rec.get('samples')) for rec in records):.0f} samples "
            "scored 0 (the reward raised, returned a non-number or was late (reward.score_timeout_s)"
            + (f"; the first: {escape(one_line(str(first), 300))}" if first else "") + "; see metrics.jsonl)[/]")


def eval_score(m: dict) -> tuple[str, float] | None:
    """The evaluation figure a step's record carries (pass@1, else the mean reward), if any."""
    for key in ("eval/pass@1", "eval/reward_mean"):
        if key in m:
            return key.removeprefix("eval/"), m[key]
    return None


def busy(m: dict) -> str:
    """Each pool's busy share in the step, e.g. ``generate 40% train 95% reward 3%``."""
    return " ".join(f"{p} {1 - a['idle_ratio']:.0%}" for p, a in m.get("pools", {}).items())


def scoring_s(m: dict) -> float | None:
    """The longest a sample of the step waited from generated to scored (its reward's queue and
    call), from the per-sample log; None without one. A slow reward shows here."""
    waits = [x["reward_end"] - x["gen_end"] for x in m.get("sample_log", ()) if "reward_end" in x and "gen_end" in x]
    return max(waits) if waits else None


def step_line(m: dict, steps: int) -> str:
    """The plain line of one step. Generation that overlapped the previous step (``async``)
    says so instead of showing 0 s."""
    gen = f"{m['generate_s']:.2f}s" if m["generate_s"] > 0 else "overlapped"
    score, scoring = eval_score(m), scoring_s(m)
    return (f"step {m['step'] + 1:>3}/{steps}  reward {m['reward_mean']:.3f}"
            + (f"  eval {score[0]} {score[1]:.3f}" if score else "")
            + f"  samples/s {m['samples_per_s']:6.1f}  step {m['step_s']:.2f}s (generation {gen}, "
            + (f"scoring <={scoring:.2f}s, " if scoring is not None else "")
            + f"training {m['train_s']:.2f}s, weight sync {m['weight_sync_s']:.3f}s)  busy {busy(m)}"
            f"  staleness {m['staleness_max']}  v{m['policy_version']}"
            # an elastic pool: how many generated, and what changed after the step
            + (f"  generate workers {m['generate_workers']} {escape(one_line(str(m['elastic']), 300))}".rstrip()
               if "elastic" in m else "")
            # a reward that raises or returns NaN scores 0 and is counted; say so where it is seen
            + (f"  [yellow]reward errors {m['reward_errors']}/{m['samples']}"
               + (f" ({escape(str(m['reward_error_first'])[:120])})" if m.get("reward_error_first") else "") + "[/]"
               if m.get("reward_errors") else "")
            # a held-out evaluation that failed: its error, or the step's line repeats for nothing
            + (f"  [yellow]eval failed ({escape(one_line(str(m['eval_error']), 200))})[/]" if m.get("eval_error") else ""))


def flat_groups_note(m: dict) -> str:
    """The warning for a step in which, in every prompt's group, all samples got the same
    reward (``flat_groups`` 1): a group baseline (GRPO, RLOO, Dr. GRPO, REINFORCE++) gives every
    sample advantage 0, so such an algorithm learns nothing from the step."""
    return (f"no learning signal at step {m['step'] + 1}: in every prompt's group all samples got the same "
            f"reward (mean {m['reward_mean']:.3f}), and a group baseline gives them advantage 0: the task may be "
            "too hard or too easy for the model, or the reward constant; metrics.jsonl's flat_groups has it "
            "per step (said once)")


def low_ess_note(m: dict) -> str | None:
    """The warning for a step whose trained tokens of some staleness rested on a few of them:
    the importance weights of a bucket had a normalised effective sample size under
    ``telemetry.off_policy.LOW_ESS`` (None: none did)."""
    low = lowest_ess_bucket(m)
    if low is None:
        return None
    bucket, size = low
    return (f"step {m['step'] + 1}: the importance weights of tokens {bucket} versions stale have an effective "
            f"sample size of {size:.2f} (under {LOW_ESS:g}): a few tokens carry that part of the update. A lower "
            "run.max_staleness or an [algorithm.off_policy] correction helps; metrics.jsonl's offpolicy/low_ess "
            "counts such steps (said once)")


def warning(console: Console, text: str) -> None:
    """One warning line, in yellow, its text as text: a note names recipe tables in brackets
    (``[algorithm.off_policy]``) and an error's message may hold anything, which rich would
    otherwise read as its markup and drop."""
    console.print(f"[yellow]{escape(text)}[/]", soft_wrap=True)


class StepNotes:
    """Warnings a step's record calls for, each said once per run (they usually hold for many
    steps): no learning signal (:func:`flat_groups_note`), importance weights that rest on a few
    tokens (:func:`low_ess_note`; the summary counts its steps); and every update skipped
    for a loss or gradient that was not finite (``trainer.max_nonfinite_steps``)."""

    def __init__(self):
        self.said: set[str] = set()

    def of(self, m: dict) -> list[str]:
        """The notes of one step's record not said before."""
        notes = {}
        if m.get("flat_groups") == 1.0:
            notes["flat"] = flat_groups_note(m)
        if m.get("offpolicy/low_ess"):
            notes["ess"] = low_ess_note(m)
        new = [text for key, text in notes.items() if text and key not in self.said]
        self.said.update(notes)
        if m.get("nonfinite_skipped"):  # (rare by design: each one is named)
            new.append(f"step {m['step'] + 1}: update skipped, its loss or gradient was not finite "
                       "(trainer.max_nonfinite_steps lets that many in a row be skipped; the policy is unchanged)")
        if m.get("samples") and m.get("reward_errors_transient", 0) >= m["samples"]:  # (each one: rare, and counted)
            new.append(f"step {m['step'] + 1}: every rollout timed out or lost its endpoint (overload?), so all "
                       f"{m['samples']} samples scored 0; 3 such steps in a row stop the run")
        return new


class RunDisplay:
    """The run's progress on ``console``: live on a terminal, else (or ``plain``) one line per step."""

    def __init__(self, console: Console, name: str, steps: int, first: int = 0, plain: bool = False):
        self.console, self.steps = console, steps
        self.live_mode = console.is_terminal and not plain
        # the run's name is the user's text: shown as written, never read as rich markup
        self.progress = Progress(TextColumn("{task.description}", style="bold", markup=False), BarColumn(),
                                 MofNCompleteColumn(),
                                 TextColumn("steps"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                 console=console)
        self.task = self.progress.add_task(printable(name), total=steps, completed=first)
        self.latest: dict | None = None
        self.live: Live | None = None

    def __enter__(self) -> "RunDisplay":
        if self.live_mode:
            # Redrawn from rich's own thread, once a second (the clock columns tick), and at each
            # step: the controller's loop never draws. The embedded scheduler shares this
            # process (and its GIL): a redraw takes ~1.5 ms, so not more often than needed. Other
            # output is not captured (``redirect_*``): it scrolls above without passing through rich.
            self.live = Live(self._render(), console=self.console, refresh_per_second=1, transient=False,
                             redirect_stdout=False, redirect_stderr=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)
            self.live = None

    def step(self, m: dict) -> None:
        """Show one finished step's record."""
        if self.live is None:
            self.console.print(step_line(m, self.steps), soft_wrap=True)
            return
        self.latest = m
        self.progress.update(self.task, completed=m["step"] + 1)
        self.live.update(self._render(), refresh=True)
        if m.get("reward_errors") or m.get("elastic") or m.get("eval_error"):  # events worth a line of their own
            self.console.print(step_line(m, self.steps), soft_wrap=True)

    def _render(self):
        if self.latest is None:
            return self.progress
        m = self.latest
        table = Table.grid(padding=(0, 2))
        row = {"reward": f"{m['reward_mean']:.3f}"}
        score = eval_score(m)
        if score:
            row[f"eval {score[0]}"] = f"{score[1]:.3f}"
        row["samples/s"] = f"{m['samples_per_s']:.1f}"
        if (scoring := scoring_s(m)) is not None:
            row["scoring"] = f"<={scoring:.2f}s"
        for p, a in m.get("pools", {}).items():
            row[f"{p} busy"] = f"{1 - a['idle_ratio']:.0%}"
        row["staleness"] = str(m["staleness_max"])
        row["policy"] = f"v{m['policy_version']}"
        for k in row:
            table.add_column(k, justify="right")
        table.add_row(*[f"[dim]{k}[/]" for k in row])
        table.add_row(*row.values())
        return Group(self.progress, table)


class SummaryTable(Table):
    """A table with renderables printed below it (``below``: the run's learners, as wide as the
    console allows, not squeezed into a cell), its caption last."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.below: list = []

    def __rich_console__(self, console, options):
        if not self.below:
            yield from super().__rich_console__(console, options)
            return
        caption, self.caption = self.caption, None
        try:
            table = list(super().__rich_console__(console, options))
        finally:
            self.caption = caption
        yield from table
        yield from self.below
        if caption:
            yield Padding(console.render_str(caption, style="table.caption") if isinstance(caption, str) else caption,
                          (0, 0, 0, 2), expand=False)


def summary_table(records: list[dict], files: dict[str, str], window: int = 10) -> SummaryTable:
    """The end-of-run table: reward first -> last, evaluation, throughput, each pool's idle share,
    with several learners one row each (:func:`learners_summary`; their final state from
    ``learners.json`` in ``files["run folder"]``), and where the run's files are (``files``:
    label -> path)."""
    k = min(window, len(records))
    t = SummaryTable(title="[bold]run summary[/]", show_header=False, title_justify="left", box=None, padding=(0, 2))
    t.add_column(style="dim", no_wrap=True)
    t.add_column(overflow="fold")
    if records:
        # (a resumed run's earlier records come from its metrics.jsonl as the file holds them: a
        # field that is not a finite number counts as 0, a table that is not one as none)
        first = sum(number(r.get("reward_mean")) for r in records[:k]) / k
        last = sum(number(r.get("reward_mean")) for r in records[-k:]) / k
        t.add_row("reward", f"{first:.3f} (first {k} steps) -> {last:.3f} (last {k})")
        scores = [(number(r.get("step")), e) for r in records if (e := eval_score(r)) and number(e[1], None) is not None]
        if scores:
            (s0, (name, v0)), (s1, (_, v1)) = scores[0], scores[-1]
            t.add_row(Text(f"eval {printable(name)[:40]}"), f"{v0:.3f} (step {s0 + 1:.0f}) -> {v1:.3f} (step {s1 + 1:.0f})")
        wall = sum(number(r.get("step_s")) for r in records)
        samples = sum(number(r.get("samples")) for r in records)
        tokens = sum(number(r.get("tokens_per_s")) * number(r.get("step_s")) for r in records)
        t.add_row("throughput", f"{samples / max(wall, 1e-9):.1f} samples/s, {tokens / max(wall, 1e-9):.0f} "
                                f"tokens/s over {len(records)} steps")
        idle: dict[str, list[float]] = {}
        for r in records:
            for p, a in tables(r.get("pools")).items():
                idle.setdefault(p, [0.0, 0.0])
                idle[p][0] += number(a.get("idle_s"))
                idle[p][1] += number(a.get("idle_s")) + number(a.get("busy_s"))
        # (a pool's name as text, not markup: "[/]" in a record would end the table's rendering)
        t.add_row("idle", Text("  ".join(f"{printable(str(p))[:40]} {i / max(c, 1e-9):.0%}"
                                         for p, (i, c) in list(idle.items())[:16])))
        low = sum(1 for r in records if r.get("offpolicy/low_ess"))
        if low:  # (the console said so at the first of them)
            t.add_row("low ESS", f"{low} of {len(records)} steps trained tokens whose importance weights had an "
                                 f"effective sample size under {LOW_ESS:g}")
        if any(isinstance(r.get("learners"), dict) and r["learners"] for r in records):
            folder = files.get("run folder")
            t.below.append(learners_summary(records, learners_final(folder) if folder else {}))
    for label, path in files.items():  # (a folder's name is the run's: text, not markup)
        t.add_row(Text(printable(str(label))), Text(printable(str(path))))
    return t


class Fitted(Table):
    """A borderless table (two spaces between columns) whose headers wrap to their cells' width
    when it is too wide for the console (rich would wrap the cells first): each column as wide
    as its widest cell or its header's longest word."""

    def __rich_console__(self, console, options):
        cells = [[Text.from_markup(str(c)).cell_len for c in column.cells] for column in self.columns]
        natural = sum(max(len(str(column.header)), *cs) for column, cs in zip(self.columns, cells) if cs)
        if cells and natural + 2 * (len(cells) - 1) > options.max_width:
            for column, cs in zip(self.columns, cells):
                column.width = max(*map(len, str(column.header).split() or [""]), *cs, 1)
        yield from super().__rich_console__(console, options)


def learners_summary(records: list[dict], final: dict | None = None):
    """A run's learners side by side (``telemetry/learner_figures.py``): name, algorithm,
    state, steps trained / skipped, train reward of the last ten steps it trained, held-out
    reward first -> newest (vN: N steps trained); a failed learner's reason under the table."""
    rows = learner_figures(records, final)
    cells = [[escape(one_line(c, 200)) for c in learner_cells(row)] for row in rows]
    t = Fitted(box=None, padding=(0, 2), collapse_padding=True, pad_edge=False, header_style="dim")
    for i, col in enumerate(LEARNER_COLUMNS):
        t.add_column(col.format(arrow="->"), justify="right" if i in (3, 4) else "left", overflow="fold")
    for row, line in zip(rows, cells):
        if row["state"] == "failed":
            line[2] = f"[red]{line[2]}[/]"
        elif row["state"] != "training":
            line[2] = f"[dim]{line[2]}[/]"
        t.add_row(*line)
    failures = [Text(f"{one_line(str(row['name']), 80)} failed at {one_line(str(row['failure']), 300)}", style="red")
                for row in rows if row["failure"]]
    return Group(Text.from_markup("[bold]learners[/]", style="table.title"),
                 Padding(Group(t, *failures), (0, 0, 0, 2), expand=False))
