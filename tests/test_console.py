"""What a run shows: the live display, the plain lines, the summary, library warnings kept in the
run folder, and Dask's performance report (spans by step and phase: tests/test_controller.py)."""

from __future__ import annotations

import io
import logging

import pytest
from rich.console import Console

from streamrl.telemetry.console import RunDisplay, StepNotes, step_line, summary_table
from streamrl.telemetry.warnings_log import WarningsLog
from tests.helpers import read_records, sets, streamrl, write_tiny_recipe


def record(step: int, generate_s: float = 0.4, **more) -> dict:
    return {"step": step, "reward_mean": 0.25 + step / 100, "samples_per_s": 100.0 + step, "step_s": 1.0,
            "generate_s": generate_s, "train_s": 0.5, "weight_sync_s": 0.01, "staleness_max": 1,
            "policy_version": step + 1, "samples": 16, "tokens_per_s": 800.0,
            "pools": {"generate": {"busy_s": 0.6, "idle_s": 0.4, "idle_ratio": 0.4},
                      "train": {"busy_s": 0.9, "idle_s": 0.1, "idle_ratio": 0.1}}, **more}


def test_a_plain_line_names_every_figure_and_says_when_generation_overlapped():
    line = step_line(record(2, generate_s=0.0), steps=10)
    assert line.startswith("step   3/10  reward 0.270")
    assert "generation overlapped" in line and "0.00s" not in line
    assert "busy generate 60% train 90%" in line and "staleness 1" in line and line.endswith("v3")
    assert "generation 0.40s" in step_line(record(2), steps=10)
    assert "eval pass@1 0.500" in step_line(record(2, **{"eval/pass@1": 0.5}), steps=10)
    # a slow reward names itself: the longest wait from generated to scored
    log = [{"gen_end": 10.0, "reward_end": 10.5}, {"gen_end": 11.0, "reward_end": 41.25}]
    assert "scoring <=30.25s" in step_line(record(2, sample_log=log), steps=10)
    # a held-out evaluation that failed says why (the step's line alone repeated itself)
    failed = step_line(record(2, eval_error="EvalTimeout: no answer\x1b[2J [bold]x[/]"), steps=10)
    assert "eval failed (EvalTimeout: no answer\\x1b[2J \\[bold]x\\[/])" in failed
    # an elastic pool's news holds an exception's text: shown as text (markup in it ended the
    # console's display for the run)
    elastic = step_line(record(2, generate_workers=2, elastic="could not add: [/scratch/w]\nline"), steps=10)
    Console(file=io.StringIO()).print(elastic)
    assert "could not add: \\[/scratch/w]\\nline" in elastic


def test_the_live_display_shows_progress_and_the_latest_figures_on_a_terminal():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with RunDisplay(console, "tiny", steps=5) as display:
        assert display.live is not None
        for s in range(3):
            display.step(record(s, **({"eval/pass@1": 0.75} if s == 2 else {})))
    text = out.getvalue()
    assert "3/5" in text and "ETA" in text
    assert "0.270" in text and "pass@1" in text and "0.750" in text and "generate busy" in text
    assert "step   1/5" not in text  # no plain lines on a terminal


def test_without_a_terminal_or_with_plain_one_line_per_step():
    for console, plain in [(Console(file=io.StringIO(), width=200), False),
                           (Console(file=io.StringIO(), force_terminal=True, color_system=None, width=200), True)]:
        with RunDisplay(console, "tiny", steps=2, plain=plain) as display:
            assert display.live is None
            display.step(record(0))
            display.step(record(1))
        lines = console.file.getvalue().splitlines()
        assert [line.split()[1] for line in lines] == ["1/2", "2/2"]


def test_the_summary_says_reward_first_to_last_eval_throughput_idle_and_where_the_files_are():
    records = [record(s, **({"eval/pass@1": 0.2 + s / 10} if s % 2 == 0 else {})) for s in range(4)]
    out = io.StringIO()
    Console(file=out, width=200).print(summary_table(records, {"run folder": "/runs/x", "trace (Perfetto)": "trace.json"},
                                                     window=2))
    text = out.getvalue()
    assert "0.255 (first 2 steps) -> 0.275 (last 2)" in text
    assert "0.200 (step 1) -> 0.400 (step 3)" in text
    assert "generate 40%" in text and "train 10%" in text
    assert "/runs/x" in text and "trace.json" in text

    assert "low ESS" not in text


def test_a_step_whose_stale_tokens_rest_on_a_few_is_said_once_with_its_step_and_bucket_and_counted():
    notes = StepNotes()
    fine = record(0, **{"offpolicy/1/ess": 0.9, "offpolicy/low_ess": 0})
    low = record(3, **{"offpolicy/1/ess": 0.8, "offpolicy/4+/ess": 0.12, "offpolicy/2-3/ess": 0.3,
                       "offpolicy/low_ess": 1})
    flat = record(4, flat_groups=1.0, **{"offpolicy/4+/ess": 0.2, "offpolicy/low_ess": 1})
    assert notes.of(fine) == []
    (said,) = notes.of(low)
    assert said.startswith("step 4:") and "tokens 4+ versions stale" in said and "0.12" in said
    (again,) = notes.of(flat)  # the low ESS is not said twice; the flat groups are news
    assert "no learning signal at step 5" in again
    out = io.StringIO()
    Console(file=out, width=200).print(summary_table([fine, low, flat], {}))
    assert "2 of 3 steps trained tokens whose importance weights" in out.getvalue()


def test_every_update_skipped_for_a_non_finite_loss_is_named_with_its_step():
    notes = StepNotes()
    assert notes.of(record(0, nonfinite_skipped=0)) == []
    (first,) = notes.of(record(1, nonfinite_skipped=1))
    (second,) = notes.of(record(5, nonfinite_skipped=1))  # each one, not once per run
    assert first.startswith("step 2: update skipped") and second.startswith("step 6: update skipped")
    assert "trainer.max_nonfinite_steps" in first


WARNING_REWARD = '''
import warnings


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    warnings.warn("this reward API is deprecated", FutureWarning)
    return 1.0 if solution_str.strip() == str(ground_truth) else 0.0
'''


@pytest.mark.slow
def test_a_run_keeps_library_warnings_in_its_folder_and_writes_a_performance_report(tmp_path, tiny_model,
                                                                                    shared_cluster):
    (tmp_path / "warns.py").write_text(WARNING_REWARD)
    recipe = write_tiny_recipe(tmp_path, tiny_model)
    recipe.write_text(recipe.read_text().replace('[reward]\nname = "exact_match"',
                                                 '[reward]\nname = "python"\npath = "warns.py"'))
    proc = streamrl("recipe", "run", str(recipe), "--profile", "--no-report", *sets(*shared_cluster.sets))
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = next((tmp_path / "runs").iterdir())
    # the reward worker's warning went to the run folder, once, not to the terminal
    assert "deprecated" not in proc.stderr and "FutureWarning" not in proc.stderr
    logged = (run_dir / "warnings.log").read_text().splitlines()
    assert sum("this reward API is deprecated" in line for line in logged) == 1
    assert "[reward-0] FutureWarning" in next(line for line in logged if "deprecated" in line)
    assert "warnings.log (" in proc.stderr and "run summary" in proc.stderr
    # plain lines (no terminal here), one per step
    assert [line.split()[1] for line in proc.stderr.splitlines() if line.startswith("step ")] == ["1/2", "2/2"]
    # --profile: Dask's performance report, the run's tasks (by phase, as the task stream colours them) in it
    html = (run_dir / "dask-report.html").read_text()
    assert "Dask Performance Report" in html
    for name in ["generate", "reward", "train", "optimizer-step", "export-weights", "load-weights"]:
        assert name in html, name
    assert [r["step"] for r in read_records(run_dir)] == [0, 1]


def test_dasks_warnings_and_failed_broadcasts_go_to_the_run_folder_and_other_errors_to_the_terminal(tmp_path, caplog):
    # a worker killed mid-run: the scheduler's "broadcast to <it> failed" (streamrl's own
    # questions to every worker, errors ignored) and its "Removing worker" go to warnings.log,
    # and so do the scheduler's and the client's lines when a result's holder died as it was
    # gathered (the client computes it again); an error of another kind still reaches the terminal
    log = WarningsLog(tmp_path / "warnings.log")
    log.take_dask_warnings()
    scheduler, client = logging.getLogger("distributed.scheduler"), logging.getLogger("distributed.client")
    try:
        # (each logger's own level: an earlier run in this process may have set one)
        with caplog.at_level(logging.INFO, logger="distributed.scheduler"), \
                caplog.at_level(logging.INFO, logger="distributed.client"):
            scheduler.error("broadcast to %s failed: %s: %s", "tcp://127.0.0.1:1", "CommClosedError", "reset")
            scheduler.warning("Removing worker %r", "tcp://127.0.0.1:1")
            scheduler.error("Couldn't gather keys: %s", {("load-weights-4", "generate-1"): "memory"})
            client.warning("Couldn't gather %s keys, rescheduling %s", 1, (("load-weights-4", "generate-1"),))
            scheduler.error("something else broke")
            client.error("the client broke")
    finally:
        log.release_dask_warnings()
    assert [r.getMessage() for r in caplog.records] == ["something else broke", "the client broke"]
    kept = (tmp_path / "warnings.log").read_text()
    assert "ERROR: broadcast to tcp://127.0.0.1:1 failed: CommClosedError: reset (dask)" in kept
    assert "WARNING: Removing worker 'tcp://127.0.0.1:1'" in kept
    assert "ERROR: Couldn't gather keys: {('load-weights-4', 'generate-1'): 'memory'}" in kept
    assert "WARNING: Couldn't gather 1 keys, rescheduling" in kept and log.count == 4


def test_a_warnings_log_that_cannot_be_written_is_said_once_and_a_warning_is_one_bounded_line(tmp_path, capsys):
    # it runs inside warnings.warn and Dask's logging calls: an OSError there (a full disk) came
    # out of whatever code warned, the scheduler's handlers among it
    from streamrl.telemetry.warnings_log import MAX_WARNING_CHARS

    log = WarningsLog(tmp_path / "warnings.log")
    log.write("w", "UserWarning", "first\nline " + "x" * 10 * MAX_WARNING_CHARS, "here")
    (line,) = (tmp_path / "warnings.log").read_text().splitlines()
    assert len(line) <= MAX_WARNING_CHARS and "first\\nline" in line
    gone = WarningsLog(tmp_path / "no-such-folder" / "warnings.log")
    for k in range(3):
        gone.write("w", "UserWarning", f"warned {k}", "here")
    err = capsys.readouterr().err
    assert err.count("cannot be written") == 1 and "FileNotFoundError" in err and gone.broken


def test_a_warning_keeps_its_brackets_as_text():
    # the low-ESS note names [algorithm.off_policy]; an error's message may hold anything
    import io

    from rich.console import Console

    from streamrl.telemetry.console import warning

    out = io.StringIO()
    console = Console(file=out, width=400, color_system=None)
    warning(console, "step 72: ... A lower run.max_staleness or an [algorithm.off_policy] correction helps")
    warning(console, "on_run_end failed: ValueError: [bold]not markup[/] [/nope]")
    said = out.getvalue()
    assert "[algorithm.off_policy] correction" in said, said
    assert "[bold]not markup[/] [/nope]" in said, said


def test_the_run_name_and_the_files_are_shown_as_written_never_read_as_markup():
    name = "grpo[/bold][red]x[link=http://e]y\x1b[2J"
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, color_system=None, width=160)
    with RunDisplay(console, name, steps=2) as display:  # ("[/bold]" alone raised rich's MarkupError)
        display.step(record(0))
    assert "grpo[/bold][red]x[link=http://e]y\\x1b[2J" in out.getvalue() and "\x1b[2J" not in out.getvalue()
    out = io.StringIO()
    Console(file=out, width=200).print(summary_table([record(0)], {"run folder": "/runs/[red]a[/]\nb"}))
    assert "/runs/[red]a[/]\\nb" in out.getvalue()


def test_a_resumed_runs_earlier_records_as_the_file_holds_them_end_the_run_with_its_summary_not_a_traceback():
    # (read back from a metrics.jsonl edited by hand, or another program's): the summary at the
    # end of a long run read them as numbers and tables, and its pool names as markup
    from streamrl.telemetry.console import reward_errors_line

    odd = [{"step": 0, "reward_mean": "0.5", "samples": None, "pools": {"[/]": {"busy_s": 1, "idle_s": "x"}},
            "eval/pass@1": "high", "learners": [1]},
           {"step": 1, "reward_errors": 2, "reward_error_first": "boom\x1b]52;c;x\x07", "samples": 10 ** 400},
           record(2, **{"eval/pass@1": 0.5})]
    out = io.StringIO()
    Console(file=out, width=200).print(summary_table(odd, {"run folder": "/runs/x"}))
    text = out.getvalue()
    assert "reward" in text and "[/] " in text and "eval pass@1" in text and "0.500 (step 3)" in text, text
    line = reward_errors_line(odd)
    assert line.startswith("[yellow]reward errors: 2 of 16 samples") and "\x1b" not in line and "\x07" not in line
