"""``streamrl report``: the busy intervals behind the worker timeline (from hand-made sample
logs), the report of made-up run folders (eval, ranker, a plot that fails, a broken folder), and
end to end on real runs through the CLI the way a user runs it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from streamrl.errors import UserError
from streamrl.telemetry import timeline as tl
from streamrl.telemetry.report import write_report
from tests.helpers import ROOT, sets, streamrl, write_tiny_recipe

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def sample(uid, worker="generate-0", gen=(0.0, 1.0), reward_end=1.2, trained=2.0, on="train-0", version=0,
           step=0, response_len=4):
    return {"uid": uid, "version": version, "worker": worker, "submitted": gen[0], "gen_start": gen[0],
            "gen_end": gen[1], "reward_end": reward_end, "trained": trained, "trained_on": on,
            "response_len": response_len, "prompt_len": 5, "staleness": step - version}


def record(step, log, time, step_s=1.0, weight_sync_s=0.0, **extra):
    return {"step": step, "policy_version": step + 1, "samples": len(log), "reward_mean": 0.1 * step,
            "response_len_mean": sum(s["response_len"] for s in log) / max(len(log), 1),
            "samples_per_s": len(log) / step_s, "tokens_per_s": 4 * len(log) / step_s, "step_s": step_s,
            "weight_sync_s": weight_sync_s, "time": time, "staleness_max": 0,
            "pools": {"generate": {"busy_s": 0.5, "idle_s": 0.5, "idle_ratio": 0.5},
                      "train": {"busy_s": 0.8, "idle_s": 0.2, "idle_ratio": 0.2}},
            **extra, "sample_log": log}


# -- the busy intervals ----------------------------------------------------------------------

def test_merge_joins_overlapping_and_touching_intervals():
    assert tl.merge([(3, 4), (0, 1), (0.5, 2), (2, 2.5), (5, 6)]) == [(0, 2.5), (3, 4), (5, 6)]
    assert tl.merge([]) == []


def test_busy_bars_from_a_hand_made_sample_log():
    log = [
        # generate-0 had two overlapping requests (0-1, 0.5-1.5), then one more (3-4)
        sample("0-000-0", gen=(0.0, 1.0), reward_end=1.6, trained=2.5),
        sample("0-000-1", gen=(0.5, 1.5), reward_end=1.6, trained=2.5),  # group scored at 1.6
        sample("0-001-0", gen=(3.0, 4.0), reward_end=4.2, trained=5.0),
        sample("0-002-0", worker="generate-1", gen=(0.2, 0.8), reward_end=1.0, trained=2.5),
    ]
    rows = tl.busy_bars([record(0, log, time=5.5, step_s=5.5, weight_sync_s=0.2)])
    assert list(rows) == ["generate-0", "generate-1", tl.REWARD_ROW, "train-0"]
    as_tuples = {name: [(b.start, b.end, b.kind) for b in bars] for name, bars in rows.items()}
    assert as_tuples["generate-0"] == [(0.0, 1.5, tl.GENERATE), (3.0, 4.0, tl.GENERATE)]
    assert as_tuples["generate-1"] == [(0.2, 0.8, tl.GENERATE)]
    # a group from its last sample generated to scored: 0.8-1.0, 1.5-1.6 and 4.0-4.2
    assert as_tuples[tl.REWARD_ROW] == [(0.8, 1.0, tl.REWARD), (1.5, 1.6, tl.REWARD), (4.0, 4.2, tl.REWARD)]
    # two train tasks (trained at 2.5 and at 5.0): each from its last input scored (1.6, 4.2) to
    # trained; then the optimizer step until the controller heard of it (time - weight_sync_s)
    assert as_tuples["train-0"] == [(1.6, 2.5, tl.TRAIN), (4.2, 5.0, tl.TRAIN), (5.0, 5.3, tl.OPTIMIZER)]


def test_a_one_task_train_worker_starts_a_task_when_its_previous_one_ended():
    # both tasks' inputs were scored at 1.0; one thread: the second ran after the first (2.0-3.0)
    log = [sample("0-000-0", reward_end=1.0, trained=2.0), sample("0-001-0", reward_end=1.0, trained=3.0)]
    step0 = record(0, log, time=3.5, step_s=3.5, weight_sync_s=0.1)
    # the next step's task waited for the optimizer step (until 3.4), though its input was ready
    step1 = record(1, [sample("1-000-0", gen=(2.0, 2.5), reward_end=2.6, trained=4.0, version=1, step=1)],
                   time=4.5, step_s=1.0)
    serial = [(b.start, b.end, b.kind) for b in tl.busy_bars([step0, step1])["train-0"]]
    assert serial == [(1.0, 2.0, tl.TRAIN), (2.0, 3.0, tl.TRAIN), (3.0, 3.4, tl.OPTIMIZER),
                      (3.4, 4.0, tl.TRAIN), (4.0, 4.5, tl.OPTIMIZER)]
    # several threads: a task may have run from the moment its inputs were ready
    parallel = [(b.start, b.end) for b in tl.busy_bars([step0], serial_train=False)["train-0"] if b.kind == tl.TRAIN]
    assert parallel == [(1.0, 2.0), (1.0, 3.0)]


def test_a_colocated_worker_has_one_row_with_both_kinds_and_busy_fraction_is_the_union():
    log = [sample("0-000-0", worker="train-0", gen=(0.0, 1.0), reward_end=1.5, trained=3.0),
           sample("0-001-0", worker="generate-0", gen=(0.0, 1.0), reward_end=1.5, trained=3.0)]
    rows = tl.busy_bars([record(0, log, time=4.0, step_s=4.0)])
    assert list(rows) == ["generate-0", tl.REWARD_ROW, "train-0"]
    assert [b.kind for b in rows["train-0"]] == [tl.GENERATE, tl.TRAIN, tl.OPTIMIZER]
    # train-0 busy 0-1 and 1.5-4.0 of 0-4; a window 2-3 inside a bar is all busy
    assert tl.busy_fraction(rows["train-0"], 0.0, 4.0) == pytest.approx(3.5 / 4)
    assert tl.busy_fraction(rows["train-0"], 2.0, 3.0) == pytest.approx(1.0)
    assert tl.busy_fraction(rows["generate-0"], 5.0, 6.0) == 0.0


# -- the report of made-up run folders ----------------------------------------------------------

def made_up_run(folder: Path, steps: int = 12, mode: str = "stream", name: str = "made-up", **extra_last) -> Path:
    """A run folder with ``steps`` plausible records (8 samples a step, a step a second), an
    evaluation every 4 steps and a ranker's recall."""
    folder.mkdir(parents=True)
    lines = []
    for k in range(steps):
        t = 100.0 + k
        log = [sample(f"{k}-{g:03d}-{i}", gen=(t + 0.05 * g, t + 0.3 + 0.05 * g), reward_end=t + 0.4 + 0.05 * g,
                      trained=t + 0.6 + 0.1 * g, version=k, step=k, response_len=2 + (i + k) % 5)
               for g in range(2) for i in range(4)]
        extra = {"ranker_recall": 0.5, "offpolicy/0/ess": 1.0, "offpolicy/0/k3": 0.0,
                 "offpolicy/1/ess": 0.9 - 0.03 * k, "offpolicy/1/k3": 0.01 * k}
        if k % 4 == 3:
            extra.update({"eval/policy_version": k, "eval/pass@1": 0.1 * k, "eval/reward_mean": 0.05 * k})
        lines.append(json.dumps(record(k, log, time=t + 1.0, weight_sync_s=0.1, **extra)))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "recipe.toml").write_text(f'[run]\nname = "{name}"\nmode = "{mode}"\nsteps = {steps}\n')
    (folder / "status.json").write_text(json.dumps({"state": "completed", "pid": 1}))
    return folder


def linked_images(report: Path) -> list[Path]:
    return [report.parent / link for link in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report.read_text())]


def check_png(path: Path) -> None:
    from PIL import Image

    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    assert 5_000 < path.stat().st_size < 400_000, (path, path.stat().st_size)
    with Image.open(path) as im:
        w, h = im.size
    assert 400 <= w <= 1600 and 200 <= h <= 1200, (path, im.size)


def test_a_report_of_a_run_with_eval_and_a_ranker_shows_them(tmp_path):
    run = made_up_run(tmp_path / "run")
    report = write_report([run])
    assert report == run / "report.md"
    images = linked_images(report)
    names = {p.name for p in images}
    assert names == {"reward.png", "response-length.png", "throughput.png", "idle.png", "staleness.png",
                     "off-policy.png", "ranker.png", "timeline.png"}
    for png in images:
        check_png(png)
    assert sorted(p.name for p in (run / "plots").iterdir()) == sorted(names)  # nothing unlinked
    text = report.read_text()
    assert "| made-up | stream | 12 | completed |" in text
    # the reward of the first and last 3 steps (a quarter of 12): 0.1 and 1.0
    assert "0.100 → 1.000" in text


def test_several_runs_overlay_with_one_timeline_each(tmp_path):
    a = made_up_run(tmp_path / "a", mode="batch")
    b = made_up_run(tmp_path / "b", mode="async", steps=6)
    report = write_report([a, b], tmp_path / "out")
    assert report == tmp_path / "out" / "report.md"
    text = report.read_text()
    assert "made-up (batch)" in text and "made-up (async)" in text
    names = {p.name for p in linked_images(report)}
    assert {"timeline-1.png", "timeline-2.png", "reward.png"} <= names
    assert not (a / "report.md").exists()  # --out: the run folders are left alone


def test_runs_of_the_same_name_and_mode_get_their_folder_time_in_the_label(tmp_path):
    a = made_up_run(tmp_path / "made-up-20260101-120000")
    b = made_up_run(tmp_path / "made-up-20260101-130000")
    text = write_report([a, b], tmp_path / "out").read_text()
    assert "Worker timeline of made-up (stream, 120000)" in text
    assert "Worker timeline of made-up (stream, 130000)" in text


def test_a_plot_that_fails_is_a_warning_and_the_rest_is_written(tmp_path, monkeypatch, capsys):
    from streamrl.telemetry import plots

    def broken(series, path):
        raise ValueError("no luck")

    monkeypatch.setattr(plots, "staleness", broken)
    report = write_report([made_up_run(tmp_path / "run")])
    assert "staleness.png" not in report.read_text() and "reward.png" in report.read_text()
    assert "streamrl: warning: report: the staleness plot failed: ValueError: no luck" in capsys.readouterr().err


def test_a_damaged_last_line_is_skipped_with_a_warning(tmp_path, capsys):
    run = made_up_run(tmp_path / "run", steps=5)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "reward_mean": 0.')  # a run killed while writing
    assert "| made-up | stream | 5 | completed |" in write_report([run]).read_text()
    assert "skipped 1 unreadable line" in capsys.readouterr().err


def test_lines_that_are_not_step_records_are_skipped_and_counted_not_read_into_a_crash(tmp_path, capsys):
    run = made_up_run(tmp_path / "run", steps=5)
    hostile = [{"step": 5, "reward_mean": None}, {"step": 6, "reward_mean": "1"}, {"step": 7, "reward_mean": 1e999},
               {"step": 8, "reward_mean": 0.5, "pools": [1]}, {"step": 9, "reward_mean": 0.5, "learners": [1]},
               {"step": 10, "reward_mean": 0.5, "pools": {"generate": 3}},
               {"step": 10, "reward_mean": 10 ** 400}]  # (valid JSON: an integer past any float)
    with (run / "metrics.jsonl").open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in hostile))
        f.write("[" * 100_000 + "]" * 100_000 + "\n")  # deeper than json's recursion reaches
        f.write('{"step": 11, "reward_mean": 0.25}\n')  # and a good line after them all
    assert "| made-up | stream | 6 of 5 | completed | 0.000 → 0.250 |" in write_report([run]).read_text()
    assert "skipped 8 unreadable line(s)" in capsys.readouterr().err


def test_a_long_run_reads_the_sample_log_of_every_kth_step_and_the_last_ones(tmp_path, monkeypatch):
    from streamrl.telemetry import report

    monkeypatch.setattr(report, "MAX_LOGGED_STEPS", 10)
    run = report.load_run(made_up_run(tmp_path / "run", steps=40))
    assert [r["step"] for r in run.records] == list(range(40))  # every step's numbers
    logged = [r["step"] for r in run.records if "sample_log" in r]
    assert logged == [0, 4, 8, 12, 16, 20, 24, 28, 32] + list(range(40 - report.LAST_STEPS, 40))
    assert all(len(r["sample_log"]) == 8 for r in run.records if "sample_log" in r)
    # and the report of it draws (the timeline from the last steps)
    assert "timeline.png" in report.write_report([run.path]).read_text()


@pytest.mark.parametrize("content", [None, "", "\n\n"])
def test_a_folder_without_steps_is_a_user_error_naming_it(tmp_path, content):
    folder = tmp_path / "empty-run"
    folder.mkdir()
    if content is not None:
        (folder / "metrics.jsonl").write_text(content)
    with pytest.raises(UserError, match=re.escape(str(folder))):
        write_report([folder])


def test_the_runs_own_end_of_run_report_only_warns(tmp_path):
    # the runner writes the report in its `finally`: a report that fails is a warning, never the run's error
    from streamrl.run.run_folder import RunFolder
    from streamrl.run.runner import _write_views

    folder = RunFolder(tmp_path / "run")
    folder.path.mkdir()
    folder.metrics.records.append({"step": 0})  # a step in memory, none readable on disk
    (folder.path / "metrics.jsonl").write_text("")
    warned = []
    files = _write_views(folder, None, True, warned.append)
    assert "report" not in files and files["run folder"] == folder.path
    assert len(warned) == 1 and warned[0].startswith("writing the run's report failed") \
        and str(folder.path) in warned[0]


def test_the_report_command_on_a_bad_folder_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "nothing-here").mkdir()
    proc = streamrl("report", str(tmp_path / "nothing-here"), timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("streamrl: error:"), proc.stderr
    assert str(tmp_path / "nothing-here") in lines[0] and "metrics.jsonl" in lines[0]


def test_importing_streamrl_and_the_runner_does_not_import_matplotlib():
    code = ("import sys, streamrl, streamrl.run.runner, streamrl.telemetry.report; "
            "print('matplotlib' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False"


# -- real runs, through the CLI ---------------------------------------------------------------

@pytest.fixture(scope="module")
def real_run(tmp_path_factory, tiny_model, shared_cluster) -> Path:
    """A tiny recipe run in stream mode, with its end-of-run report (the default)."""
    folder = tmp_path_factory.mktemp("report-run")
    recipe = write_tiny_recipe(folder, tiny_model)
    proc = streamrl("recipe", "run", str(recipe), "--set", "run.mode=stream", "--set", "run.steps=3",
                    *sets(*shared_cluster.sets))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "streamrl: warning: report" not in proc.stderr, proc.stderr[-3000:]
    (run,) = (folder / "runs").iterdir()
    return run


@pytest.mark.slow
def test_a_run_writes_its_report_and_streamrl_report_draws_it_again(real_run, tmp_path):
    # the end-of-run report
    assert (real_run / "report.md").is_file()
    assert {p.name for p in linked_images(real_run / "report.md")} >= {"reward.png", "timeline.png"}
    # the command, elsewhere
    proc = streamrl("report", str(real_run), "--out", str(tmp_path / "out"), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = Path(proc.stdout.strip())
    assert report == tmp_path / "out" / "report.md"
    images = linked_images(report)
    assert {p.name for p in images} == {"reward.png", "response-length.png", "throughput.png", "idle.png",
                                        "staleness.png", "timeline.png"}  # no eval, no ranker in this recipe
    for png in images:
        check_png(png)
    assert "| tiny | stream | 3 | completed |" in report.read_text()


@pytest.mark.slow
def test_streamrl_report_overlays_a_real_run_and_another(real_run, tmp_path):
    other = made_up_run(tmp_path / "other", mode="async", name="other")
    proc = streamrl("report", str(real_run), str(other), "--out", str(tmp_path / "both"), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (tmp_path / "both" / "report.md").read_text()
    assert "| tiny | stream |" in text and "| other | async |" in text
    assert "Worker timeline of tiny (stream)" in text and "Worker timeline of other (async)" in text
    for png in linked_images(tmp_path / "both" / "report.md"):
        check_png(png)


def test_fields_a_step_record_holds_otherwise_and_a_recipe_written_by_hand_are_read_as_nothing(tmp_path):
    run = made_up_run(tmp_path / "run", steps=5)
    odd = [{"step": 5, "reward_mean": 0.5, "step_s": "x", "samples": None},
           {"step": 5, "reward_mean": 0.5, "step_s": 10 ** 400, "samples": -(10 ** 400)},
           {"step": 6, "reward_mean": 0.5, "pools": {"generate": {"busy_s": "x", "idle_s": [1]}}},
           {"step": 7, "reward_mean": 0.5, "learners": {"a": {"steps_trained": float("inf"), "step": 7,
                                                               "eval/policy_version": float("inf"),
                                                               "eval/reward_mean": 0.5, "failure": 5}}},
           {"step": 8, "reward_mean": 0.5, "learners": {"a": {"steps_trained": 10 ** 400, "step": 8,
                                                               "reward_mean": 10 ** 400}}}]
    with (run / "metrics.jsonl").open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in odd))
    (run / "recipe.toml").write_text("run = 3\npools = 4\n")
    text = write_report([run]).read_text()
    assert "| run | ? | 10 | completed |" in text  # (the folder's name and no mode: the recipe names neither)


@pytest.mark.parametrize("odd", [{"eval_unrecorded": None}, {"eval_unrecorded": 3},
                                 {"eval/policy_version": float("nan"), "eval/pass@1": 0.5},
                                 {"eval/policy_version": float("inf"), "eval/pass@1": 0.5},
                                 {"eval_unrecorded": [{"eval/policy_version": float("-inf"), "eval/pass@1": 0.5}]}])
def test_an_evaluation_field_that_is_not_a_list_or_not_finite_is_no_evaluation_not_a_traceback(tmp_path, odd):
    run = made_up_run(tmp_path / "run", steps=5)
    with (run / "metrics.jsonl").open("a") as f:  # (json writes NaN / Infinity, and reads them back)
        f.write(json.dumps({"step": 5, "reward_mean": 0.5, **odd}) + "\n")
        # and the same field on a learner's entry
        f.write(json.dumps({"step": 6, "reward_mean": 0.5, "learners": {"a": {"step": 6, **odd}}}) + "\n")
    text = write_report([run]).read_text()
    assert "| made-up | stream | 7 of 5 | completed |" in text
    from streamrl.telemetry import plots

    assert [p["eval/policy_version"] for p in plots.eval_points(read_lines(run))] == [3]


def read_lines(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_names_states_and_folders_in_report_md_are_text_on_one_line_and_bounded(tmp_path):
    run = made_up_run(tmp_path / "run<b>", steps=5, name="a|b<script>x</script>[link](http://e)*em*")
    (run / "status.json").write_text(json.dumps({"state": "done\n| forged | row |" + "z" * 500}))
    text = write_report([run]).read_text()
    row = next(line for line in text.splitlines() if line.startswith("| a"))
    assert row.startswith("| a\\|b&lt;script&gt;x&lt;/script&gt;\\[link\\](http://e)\\*em\\* | stream | 5 | "
                          "done \\| forged \\| row \\|zzz")
    assert "<script>" not in text and "run<b>" not in text and "run&lt;b&gt;" in row
    state = row.split(" | ")[3]
    assert len(state.replace("\\", "")) <= 100 and state.endswith("…")
    assert "\n| forged" not in text
    # the learners' table uses the same cleaner: a learner's failure reads as text too
    from streamrl.telemetry.learner_figures import learner_figures
    from streamrl.telemetry.report import learners_table

    rows = learner_figures([{"step": 0, "reward_mean": 0.5, "learners": {
        "x": {"state": "failed", "algorithm": "grpo<i>", "failure": "boom\n<img src=x>|" + "y" * 1000}}}])
    table = learners_table(rows)
    assert "grpo&lt;i&gt;" in table and "boom &lt;img src=x&gt;\\|yyy" in table and "<img" not in table
    assert max(len(line) for line in table.splitlines()) < 600


def test_a_run_folders_pool_names_are_text_in_report_md_and_their_number_is_bounded(tmp_path, capsys):
    # (a copied or edited metrics.jsonl) a pool's name went into the table's header as it was;
    # a lone surrogate in it made the report's write raise; each pool was a column and a subplot
    run = made_up_run(tmp_path / "run", steps=3)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in lines:
        r["pools"] = {**r["pools"], "<img src=x onerror=alert(1)>|\n# x\ud800": {"busy_s": 1.0, "idle_s": 1.0},
                      **{f"p{i}": {"busy_s": 1.0, "idle_s": 0.0} for i in range(60)}}
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    text = write_report([run]).read_text()
    assert "<img" not in text and "\n# x" not in text and "plot failed" not in capsys.readouterr().err
    header = next(line for line in text.splitlines() if line.startswith("| run |"))
    assert "idle &lt;img src=x onerror=alert(1)&gt;\\|" in header
    assert header.count("idle ") <= 16


def test_a_run_name_with_dollars_or_a_leading_underscore_is_drawn_as_written(tmp_path, capsys, monkeypatch):
    run = made_up_run(tmp_path / "run", steps=5, name=r"_grpo$\\foo$")
    report = write_report([run])
    assert "plot failed" not in capsys.readouterr().err
    assert {p.name for p in linked_images(report)} >= {"reward.png", "throughput.png", "timeline.png"}
    # the legend keeps a label that starts with "_" (matplotlib's mark of a hidden artist)
    from streamrl.telemetry import plots

    drawn = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: drawn.append(fig) or True)
    records = read_lines(run)
    for draw in (plots.reward, plots.throughput, plots.ranker):
        draw([("_grpo (stream)", records), ("other (async)", records)], tmp_path / "x.png")
    for fig in drawn:
        legend = fig.axes[0].get_legend()
        assert [t.get_text() for t in legend.get_texts()][:2] == [" _grpo (stream)", "other (async)"]


def test_a_run_folders_files_that_are_fifos_links_to_devices_or_lines_without_end_are_read_within_bounds(
        tmp_path, capsys, monkeypatch):
    import os

    from streamrl.telemetry import run_files

    run = made_up_run(tmp_path / "run", steps=5)
    for name in ("status.json", "learners.json"):
        (run / name).unlink(missing_ok=True)
    os.mkfifo(run / "status.json")  # (opened, a FIFO waits for a writer for ever)
    (run / "learners.json").symlink_to("/dev/zero")  # (read, it never ends)
    (run / "recipe.toml").write_text("x" * (run_files.SMALL_FILE_BYTES + 1))
    monkeypatch.setattr(run_files, "MAX_LINE_CHARS", 4096)
    with (run / "metrics.jsonl").open("a") as f:
        f.write("\0" * 100_000 + "\n")  # a line past the bound: passed over, not held
        f.write('{"step": 5, "reward_mean": 0.75}\n')
    text = write_report([run]).read_text()
    assert "| run | ? | 6 | ? | 0.000 → 0.750 |" in text, text  # the status and the recipe unread, said as unknown
    assert "skipped 1 unreadable line(s)" in capsys.readouterr().err
    # a metrics.jsonl the user cannot read: one line, not a traceback
    (run / "metrics.jsonl").chmod(0)
    if not os.access(run / "metrics.jsonl", os.R_OK):  # (root reads it anyway)
        with pytest.raises(UserError, match=r"metrics.jsonl: cannot be read \(PermissionError"):
            write_report([run])


def test_a_report_written_where_links_were_left_replaces_them_and_never_writes_through(tmp_path):
    run = made_up_run(tmp_path / "run", steps=5)
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    (run / "report.md").symlink_to(precious)
    (run / "plots").mkdir()
    (run / "plots" / "reward.png").symlink_to(precious)
    report = write_report([run])
    assert precious.read_text() == "keep me"
    assert not report.is_symlink() and report.read_text().startswith("# streamrl report")
    assert not (run / "plots" / "reward.png").is_symlink()
    # as open() would have made them: readable by whom the umask lets read, not the owner's alone
    (run / "report.md").chmod(0o644)
    write_report([run])
    assert (run / "report.md").stat().st_mode & 0o777 == 0o644
    import os

    umask = os.umask(0)
    os.umask(umask)
    assert (run / "plots" / "throughput.png").stat().st_mode & 0o777 == 0o666 & ~umask  # (a new one)
    # a plots folder that is a link: the images would land wherever it points
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    other = made_up_run(tmp_path / "other", steps=5)
    (other / "plots").symlink_to(elsewhere)
    with pytest.raises(UserError, match=r"plots: a link, not a folder of the report's own"):
        write_report([other])
    assert not any(elsewhere.iterdir())


def test_thousands_of_staleness_values_or_workers_in_a_record_draw_figures_of_bounded_size(tmp_path):
    # (a sample log edited by hand, or another program's): a bar and a tick per staleness value,
    # a row per worker a sample was trained on -- figures of thousands of inches, minutes to draw
    run = made_up_run(tmp_path / "run", steps=4)
    k, t = 4, 104.0
    log = [sample(f"{k}-{i:05d}-0", gen=(t, t + 0.3), reward_end=t + 0.4, trained=t + 0.6, on=f"train-{i}",
                  version=k, step=k + i) for i in range(3000)]
    log += [dict(sample(f"{k}-x-0", gen=(t, t + 0.3), reward_end=t + 0.4, trained=t + 0.6), staleness="far")]
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(record(k, log, time=t + 1.0)) + "\n")
    report = write_report([run])
    for png in ("staleness.png", "timeline.png"):
        check_png(report.parent / "plots" / png)  # (drawn, and no larger than any other figure)
