"""A run with several learners, as the end-of-run summary and ``streamrl report`` show it: one row
per learner (train reward of its last ten trained steps, each counted once; held-out reward first
-> newest, a side learner's final one from ``learners.json``; a failure's text), and
``learners.png``. The run folder is made up here: both read only its files."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

from rich.console import Console

from streamrl.telemetry import plots
from streamrl.telemetry.console import summary_table
from streamrl.telemetry.learner_figures import learner_figures, learners_final
from streamrl.telemetry.report import write_report

STEPS = 12
FAILURE = "step 4: FloatingPointError: the loss is not finite"


def reward(step: int) -> float:
    return round(0.05 * (step + 1), 4)


def made_up_records() -> list[dict]:
    """Twelve steps of three learners on one stream: ``ppo`` served (evaluated at v0, v6 and, after
    the last record, v12), ``grpo`` on its own worker (one step behind; it repeats step 8 in
    record 10 and skips step 9; evaluated at v0 and v5, its v11 only in learners.json), ``dpo``
    failed at step 4 (its figures stay at step 3)."""
    records = []
    for s in range(STEPS):
        rec = {"step": s, "policy_version": s + 1, "samples": 16, "reward_mean": reward(s), "step_s": 1.0,
               "tokens_per_s": 64.0, "samples_per_s": 16.0, "time": 1000.0 + s, "staleness_max": 0,
               "pools": {"generate": {"busy_s": 0.5, "idle_s": 0.5, "idle_ratio": 0.5},
                         "train": {"busy_s": 0.8, "idle_s": 0.2, "idle_ratio": 0.2}}}
        ppo = {"state": "training", "served": True, "algorithm": "ppo", "steps_trained": s + 1, "step": s,
               "reward_mean": reward(s), "loss": -0.1}
        served_eval = {0: 0.25, 6: 0.4}.get(s)
        if served_eval is not None:  # (the served learner: only where an evaluation finished)
            ev = {"eval/policy_version": s, "eval/reward_mean": served_eval, "eval/pass@1": served_eval}
            rec.update(ev)
            ppo.update(ev)
        if s == STEPS - 1:  # landed after the last record: only the run's own eval_unrecorded says so
            rec["eval_unrecorded"] = [{"eval/policy_version": 12, "eval/reward_mean": 0.55, "eval/pass@1": 0.55}]
        grpo = {"state": "training", "served": False, "algorithm": "grpo", "skipped_steps": 0, "samples_trained": 0,
                "joined_at": 0, "steps_trained": 0}
        trained = {10: 8, 11: 10}.get(s, s - 1)  # the step it last trained (record 10 repeats step 8)
        if trained >= 0:
            grpo.update(step=trained, steps_trained=min(s, 9) if s < 11 else 10, reward_mean=reward(trained),
                        loss=0.2, skipped_steps=1 if s == 11 else 0)
        grpo.update({"eval/policy_version": 0, "eval/reward_mean": 0.25} if s < 6
                    else {"eval/policy_version": 5, "eval/reward_mean": 0.3})
        dpo = {"state": "training", "served": False, "algorithm": "dpo", "skipped_steps": 0, "joined_at": 0,
               "steps_trained": min(s + 1, 4), "step": min(s, 3), "reward_mean": reward(min(s, 3)), "loss": 0.05,
               "eval/policy_version": 0, "eval/reward_mean": 0.25}
        if s >= 4:
            dpo.update(state="failed", failure=FAILURE)
        rec["learners"] = {"ppo": ppo, "grpo": grpo, "dpo": dpo}
        records.append(rec)
    return records


FINAL = {"grpo": {"state": "training", "served": False, "algorithm": "grpo", "steps_trained": 11, "skipped_steps": 1,
                  "samples_trained": 176, "joined_at": 0, "step": 11, "reward_mean": reward(11), "loss": 0.2,
                  "eval/policy_version": 11, "eval/reward_mean": 0.45, "trained": [[11, 16, 1234]]},
         "dpo": {"state": "failed", "served": False, "algorithm": "dpo", "steps_trained": 4, "skipped_steps": 0,
                 "samples_trained": 64, "joined_at": 0, "step": 3, "reward_mean": reward(3), "loss": 0.05,
                 "failure": FAILURE, "eval/policy_version": 0, "eval/reward_mean": 0.25, "trained": []}}

# train reward: ppo the mean of steps 2..11; grpo of its last ten distinct steps (1..8, 10, 11: step 8
# repeated in record 10 counts once); dpo of steps 0..3
PPO_REWARD = sum(reward(s) for s in range(2, 12)) / 10
GRPO_REWARD = sum(reward(s) for s in [1, 2, 3, 4, 5, 6, 7, 8, 10, 11]) / 10
DPO_REWARD = sum(reward(s) for s in range(4)) / 4


def run_folder(path: Path, records: list[dict], final: dict | None = FINAL) -> Path:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (path / "recipe.toml").write_text('[run]\nname = "together"\nmode = "async"\nsteps = 12\n')
    (path / "status.json").write_text('{"state": "completed"}')
    if final is not None:
        (path / "learners.json").write_text(json.dumps(final))
    return path


def rendered(records: list[dict], files: dict, width: int = 200) -> str:
    out = io.StringIO()
    table = summary_table(records, files)
    table.caption = "42s in all"  # as the runner does
    Console(file=out, width=width).print(table)
    return out.getvalue()


def row_of(text: str, name: str) -> list[str]:
    """The cells of the learner's row (two spaces or more between cells)."""
    line = next(line for line in text.splitlines() if line.strip().startswith(name))
    return re.split(r"\s{2,}", line.strip())


def test_the_figures_of_each_learner():
    rows = {r["name"]: r for r in learner_figures(made_up_records(), FINAL)}
    assert list(rows) == ["ppo", "grpo", "dpo"]
    ppo, grpo, dpo = rows["ppo"], rows["grpo"], rows["dpo"]
    assert ppo["served"] and not grpo["served"]
    assert abs(ppo["train_reward"] - PPO_REWARD) < 1e-9
    assert abs(grpo["train_reward"] - GRPO_REWARD) < 1e-9
    assert abs(dpo["train_reward"] - DPO_REWARD) < 1e-9
    # (x: the stream step the evaluated policy had trained through; grpo skipped one, so its v11 is
    # the policy after stream step 12)
    assert ppo["evals"] == [(0, 0, 0.25), (6, 6, 0.4), (12, 12, 0.55)]
    assert grpo["evals"] == [(0, 0, 0.25), (5, 5, 0.3), (12, 11, 0.45)]
    assert dpo["evals"] == [(0, 0, 0.25)]
    assert (grpo["steps_trained"], grpo["skipped_steps"], grpo["state"]) == (11, 1, "training")
    assert (dpo["state"], dpo["failure"], dpo["steps_trained"]) == ("failed", FAILURE, 4)
    assert [x for x, _ in dpo["loss"]] == [1, 2, 3, 4]  # each trained step once
    # without learners.json: the side learners as the last record has them
    grpo_alone = {r["name"]: r for r in learner_figures(made_up_records())}["grpo"]
    assert grpo_alone["evals"][-1] == (5, 5, 0.3) and grpo_alone["steps_trained"] == 10


def test_the_summary_has_one_row_per_learner_and_says_why_one_failed(tmp_path):
    folder = run_folder(tmp_path / "run", made_up_records())
    text = rendered(made_up_records(), {"run folder": folder, "policy": "policy"})
    assert "run summary" in text and "learners" in text
    assert "0.250 (step 1) -> 0.400 (step 7)" in text  # the served policy's row, as before
    assert row_of(text, "ppo (served)") == ["ppo (served)", "ppo", "training", "12 / 0", f"{PPO_REWARD:.3f}",
                                            "0.250 (v0) -> 0.550 (v12)"]
    assert row_of(text, "grpo") == ["grpo", "grpo", "training", "11 / 1", f"{GRPO_REWARD:.3f}",
                                    "0.250 (v0) -> 0.450 (v11)"]
    assert row_of(text, "dpo ") == ["dpo", "dpo", "failed", "4 / 0", f"{DPO_REWARD:.3f}", "0.250 (v0)"]
    assert f"dpo failed at {FAILURE}" in text
    lines = text.splitlines()
    # the caption ends it all, the learners after the files
    assert lines[-1].strip() == "42s in all"
    assert text.index(str(folder)) < text.index("ppo (served)")


def test_without_learners_json_the_side_learners_are_as_the_last_record_has_them():
    text = rendered(made_up_records(), {"run folder": "/nowhere"})
    without_step_11 = sum(reward(s) for s in [0, 1, 2, 3, 4, 5, 6, 7, 8, 10]) / 10
    assert row_of(text, "grpo")[3:] == ["10 / 1", f"{without_step_11:.3f}", "0.250 (v0) -> 0.300 (v5)"]


def test_on_an_80_column_log_the_headers_wrap_and_the_figures_stay_whole(tmp_path):
    folder = run_folder(tmp_path / "run", made_up_records())
    text = rendered(made_up_records(), {"run folder": folder}, width=80)
    assert max(map(len, text.splitlines())) <= 80
    assert row_of(text, "ppo (served)")[-1] == "0.250 (v0) -> 0.550 (v12)"
    assert row_of(text, "grpo")[-3:] == ["11 / 1", f"{GRPO_REWARD:.3f}", "0.250 (v0) -> 0.450 (v11)"]


def test_a_run_of_one_learner_has_no_learners_part():
    records = made_up_records()
    for r in records:
        del r["learners"]
    text = rendered(records, {"run folder": "/runs/x"})
    assert "learners" not in text and "42s in all" in text


def drawn(monkeypatch) -> dict:
    """What each saved figure showed, by file name: its title and legend labels."""
    seen, save = {}, plots.save_figure

    def spy(fig, path):
        ax = fig.axes[0]
        seen[Path(path).name] = (ax.get_title(), ax.get_legend_handles_labels()[1])
        return save(fig, path)

    monkeypatch.setattr(plots, "save_figure", spy)
    return seen


def test_the_report_has_a_learners_table_and_plot(tmp_path, monkeypatch):
    folder = run_folder(tmp_path / "run", made_up_records())
    seen = drawn(monkeypatch)
    report = write_report([folder])
    text = report.read_text()
    png = folder / "plots" / "learners.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![Learners of together (async)](plots/learners.png)" in text
    assert "| learner | algorithm | state | steps trained / skipped | train reward (last 10) | eval first → last | " \
           "failure |" in text
    assert f"| ppo (served) | ppo | training | 12 / 0 | {PPO_REWARD:.3f} | 0.250 (v0) → 0.550 (v12) |  |" in text
    assert f"| grpo | grpo | training | 11 / 1 | {GRPO_REWARD:.3f} | 0.250 (v0) → 0.450 (v11) |  |" in text
    assert f"| dpo | dpo | failed | 4 / 0 | {DPO_REWARD:.3f} | 0.250 (v0) | {FAILURE} |" in text
    # right after the run's summary, before the other figures
    assert text.index("## Learners") < text.index("## Reward")
    title, labels = seen["learners.png"]
    assert "held-out reward per learner" in title
    assert labels == ["ppo (ppo, served)", "grpo (grpo)", "dpo (dpo, failed)"]


def test_without_evaluations_the_plot_draws_each_learners_loss_and_a_plain_run_has_none(tmp_path, monkeypatch):
    records = made_up_records()
    for r in records:
        r.pop("eval_unrecorded", None)
        for d in [r, *r["learners"].values()]:
            for k in [k for k in d if k.startswith("eval/")]:
                del d[k]
    final = {name: {k: v for k, v in e.items() if not k.startswith("eval/")} for name, e in FINAL.items()}
    folder = run_folder(tmp_path / "no-eval", records, final)
    seen = drawn(monkeypatch)
    text = write_report([folder]).read_text()
    assert (folder / "plots" / "learners.png").is_file()
    title, labels = seen["learners.png"]
    assert "train loss per learner" in title and labels == ["ppo (ppo, served)", "grpo (grpo)", "dpo (dpo, failed)"]
    assert f"| grpo | grpo | training | 11 / 1 | {GRPO_REWARD:.3f} | - |" in text
    assert learners_final(folder) == final

    for r in records:
        del r["learners"]
    plain = run_folder(tmp_path / "plain", records, final=None)
    text = write_report([plain]).read_text()
    assert "## Learners" not in text and not (plain / "plots" / "learners.png").exists()


def test_several_runs_get_one_learners_plot_each(tmp_path):
    a = run_folder(tmp_path / "together-20261125-000001", made_up_records())
    b = run_folder(tmp_path / "together-20261125-000002", made_up_records())
    text = write_report([a, b], tmp_path / "out").read_text()
    assert (tmp_path / "out" / "plots" / "learners-1.png").is_file()
    assert (tmp_path / "out" / "plots" / "learners-2.png").is_file()
    assert text.count("| grpo | grpo | training | 11 / 1 |") == 2


def test_a_run_folders_learner_names_and_failures_are_shown_as_text_on_one_line(tmp_path, capsys):
    # (a run folder copied from elsewhere) what its files say reaches the terminal as text: no
    # escape sequence, no line of its own
    from streamrl.cli import main

    hostile = {"\x1b[2Jx": {"state": "failed", "algorithm": "grpo\nforged line", "failure": "step 3: \x1b]0;owned\x07"
                                                                                          + "y" * 5000}}
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "learners": hostile}) + "\n")
    assert main(["learners", "list", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\nforged line" not in out
    assert len(out.splitlines()) == 3 and max(map(len, out.splitlines())) < 600
    records = made_up_records()
    records[-1]["learners"] = {"\x1b[2Jx": {**records[-1]["learners"]["dpo"], "algorithm": "a\x1b[31mb"}}
    text = rendered(records, {"run folder": tmp_path, "policy": "policy"})
    assert "\x1b[2J" not in text and "\x1b[31m" not in text
