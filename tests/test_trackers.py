"""Trackers as metric sinks: one real run logs to TensorBoard, W&B (offline), MLflow (a SQLite
file) and Trackio at once, and each is read back with the tracker's own reader; the names
(``telemetry/names.py``); a missing library is one line at validation."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import get_type_hints

import pytest

from streamrl.errors import UserError
from streamrl.telemetry.names import DROPPED, NAMES, tracker_metrics
from streamrl.telemetry.record import StepRecord
from tests.helpers import ROOT, read_records, sets, streamrl, write_tiny_recipe

TRACKERS = """
[[metrics]]
name = "tensorboard"

[[metrics]]
name = "wandb"
mode = "offline"
tags = ["test"]
run_name = "grpo-sweep-1"

[[metrics]]
name = "mlflow"

[[metrics]]
name = "trackio"
project = "streamrl-test"

[eval]
every = 0
max_prompts = 4
"""


def offline_env(folder: Path) -> dict:
    """This environment without this machine's tracker settings, with the trackers' own files
    (Trackio's database, W&B's settings and caches) in ``folder``, and no telemetry."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_", "TRACKIO_"))}
    return {**env, "TRACKIO_DIR": str(folder / "trackio"), "HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1",
            "MLFLOW_DISABLE_TELEMETRY": "true",
            **{f"WANDB_{k}_DIR": str(folder / f"wandb-{k.lower()}") for k in ("CONFIG", "CACHE", "DATA")}}


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model, shared_cluster):
    """One 3-step run with all four trackers (and an evaluation at the start and the end)."""
    folder = tmp_path_factory.mktemp("trackers")
    recipe = write_tiny_recipe(folder, tiny_model, name="recipe.toml", more=TRACKERS)
    env = offline_env(folder)
    proc = streamrl("recipe", "run", str(recipe), "--set", "run.steps=3", *sets(*shared_cluster.sets), "--plain",
                    env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (folder / "runs").iterdir()
    records = read_records(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2]
    return {"dir": run_dir, "records": records, "proc": proc, "env": env}


def by_step(records: list[dict], name: str) -> dict[int, float]:
    """``name``'s value per step, from the tracker names of ``metrics.jsonl``'s records."""
    return {r["step"]: tracker_metrics(r)[name] for r in records if name in tracker_metrics(r)}


@pytest.mark.slow
def test_the_run_logs_each_step_and_keeps_the_terminal_quiet(run):
    out = run["proc"].stdout + run["proc"].stderr
    assert "Traceback" not in out and "failed and is dropped" not in out
    assert "Trackio" not in out and "Creating initial MLflow database" not in out
    assert sum(line.startswith("wandb:") for line in out.splitlines()) <= 3, out  # where the offline run is
    # metrics.jsonl is as it was: streamrl's own names, the per-sample log
    assert all("reward_mean" in r and r["sample_log"] for r in run["records"])
    # the evaluations landed, so their names are read back below too
    assert "eval/pass_at_1" in tracker_metrics(run["records"][-1])


@pytest.mark.slow
def test_tensorboard_event_files_read_back_by_tensorboard(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = EventAccumulator(str(run["dir"] / "tensorboard"))
    events.Reload()
    records = run["records"]
    assert set(events.Tags()["scalars"]) == {k for r in records for k in tracker_metrics(r)}
    for name in ("reward/mean", "timing_s/step", "perf/idle_ratio/train", "eval/pass_at_1"):
        logged = events.Scalars(name)
        # (TensorBoard keeps float32)
        assert {e.step: pytest.approx(e.value, rel=1e-6) for e in logged} == by_step(records, name), name
    assert [e.wall_time for e in events.Scalars("reward/mean")] == pytest.approx([r["time"] for r in records])
    assert 'name = "tiny"' in events.Tensors("recipe/text_summary")[0].tensor_proto.string_val[0].decode()
    (start,) = [c for tag, c in events.PluginTagToContent("hparams").items() if tag.endswith("session_start_info")]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(start).session_start_info.hparams
    assert hparams["trainer.lr"].number_value == 1e-3 and hparams["metrics.1.name"].string_value == "wandb"


@pytest.mark.slow
def test_wandb_offline_run_read_back_by_wandb(run):
    (log,) = (run["dir"] / "wandb").glob("offline-run-*/run-*.wandb")
    proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)], env=run["env"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    entries = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    (start,) = [e["run"] for e in entries if e["type"] == "run"]
    assert start["display_name"] == "grpo-sweep-1" and start["project"] == "streamrl" and start["tags"] == ["test"]
    assert start["config"]["update"]["trainer"]["lr"] == 1e-3
    history = {e["history"]["step"].get("num", 0): e["history"]["item"] for e in entries if e["type"] == "history"}
    assert sorted(history) == [0, 1, 2]
    for step, r in zip(sorted(history), run["records"]):
        logged = {k: v for k, v in history[step].items() if not k.startswith("_")}
        assert logged == pytest.approx(tracker_metrics(r), rel=1e-12)


@pytest.mark.slow
def test_mlflow_run_read_back_by_mlflow(run):
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{run['dir'] / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("streamrl")
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.info.run_name == run["dir"].name and found.info.status == "FINISHED"
    assert found.data.params["trainer.lr"] == "0.001" and found.data.params["metrics.2.name"] == "mlflow"
    assert set(found.data.metrics) == {k for r in run["records"] for k in tracker_metrics(r)}
    for name in ("reward/mean", "timing_s/step", "staleness/max", "eval/pass_at_1"):
        history = client.get_metric_history(found.info.run_id, name)
        assert {m.step: m.value for m in history} == by_step(run["records"], name), name
    stamps = [m.timestamp for m in sorted(client.get_metric_history(found.info.run_id, "reward/mean"),
                                          key=lambda m: m.step)]
    assert stamps == [int(r["time"] * 1000) for r in run["records"]]


@pytest.mark.slow
def test_trackio_run_read_back_by_trackio(run):
    for name in ("reward/mean", "timing_s/weight_sync", "actor/grad_norm"):
        proc = subprocess.run([sys.executable, "-c", "from trackio.cli import main; main()", "get", "metric",
                               "--project", "streamrl-test", "--run", run["dir"].name, "--metric", name, "--json"],
                              env=run["env"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        values = json.loads(proc.stdout)["values"]
        assert {v["step"]: v["value"] for v in values} == by_step(run["records"], name), name


def test_tracker_metrics_names_flattens_and_drops():
    record = {"step": 3, "time": 1.7e9, "reward_mean": 0.5, "loss": math.nan, "grad_norm": math.inf, "kl": 0.0,
              "step_s": 2.0, "pools": {"train": {"busy_s": 1.5, "idle_ratio": 0.25}, "generate": {"idle_ratio": 1}},
              "sample_log": [{"uid": "3-000-0", "response_len": 4}], "reward/answered/mean": 1.0,
              "eval/pass@1": 0.5, "eval_unrecorded": [{"eval/pass@1": 0.25}], "eval_error": "boom",
              "elastic": "+generate-1", "entropy": 0.3, "plugin": {"a": {"b": 2, "c": None}}, "flag": True}
    assert tracker_metrics(record) == {
        "reward/mean": 0.5, "actor/kl": 0.0, "timing_s/step": 2.0, "perf/busy_s/train": 1.5,
        "perf/idle_ratio/train": 0.25, "perf/idle_ratio/generate": 1.0, "reward/answered/mean": 1.0,
        "eval/pass_at_1": 0.5, "entropy": 0.3, "plugin/a/b": 2.0, "flag": 1.0}


def test_every_field_of_a_step_record_has_a_name_in_the_docs():
    # (the dicts are merged in or flattened by their keys; a text field is no metric)
    hints = get_type_hints(StepRecord)
    plain = [f.name for f in fields(StepRecord) if hints[f.name] in (int, float) and f.name not in DROPPED]
    assert "reward_mean" in plain and [f for f in plain if f not in NAMES] == []
    docs = (ROOT / "docs" / "metrics.md").read_text()
    assert [n for n in NAMES.values() if f"`{n}`" not in docs] == []
    assert [f for f in NAMES if f"`{f}`" not in docs] == []
    # and every row of the docs' table is what trackers get: its field's name (or the field itself)
    import re

    rows = re.findall(r"^\| `([^`<]+)` \|.*\| `([^`<]+)` \|$", docs, flags=re.M)
    assert len(rows) > 30
    assert [(n, f) for n, f in rows if n != f and NAMES.get(f) != n] == []


@pytest.mark.parametrize("sink, module", [("tensorboard", "tensorboard"), ("wandb", "wandb"),
                                          ("mlflow", "mlflow"), ("trackio", "trackio")])
def test_a_missing_library_is_one_line_naming_the_extra(sink, module, monkeypatch):
    from streamrl.plugins.registry import build_registry

    component = build_registry().get("metric_sink", sink, "metrics[0].name")
    monkeypatch.setitem(sys.modules, module, None)  # what Python sees when it is not installed
    with pytest.raises(UserError) as err:
        component.validate({}, "metrics[0]")
    assert str(err.value) == f"metrics: name = \"{sink}\" needs the {module} package: pip install 'streamrl[{sink}]'"


def test_mlflow_needs_a_database_library_only_for_a_local_database(monkeypatch):
    from streamrl.telemetry.trackers.mlflow import MLflowConfig

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)
    with pytest.raises(UserError, match="needs the sqlalchemy package: pip install sqlalchemy alembic"):
        MLflowConfig()
    assert MLflowConfig(tracking_uri="http://127.0.0.1:5000").tracking_uri == "http://127.0.0.1:5000"


def test_the_cli_says_so_at_validation_before_anything_starts(tiny_recipe):
    hide = "import sys; sys.modules['wandb'] = None; from streamrl.cli import main; sys.exit(main())"
    Path(tiny_recipe).write_text(Path(tiny_recipe).read_text() + '\n[[metrics]]\nname = "wandb"\n')
    proc = subprocess.run([sys.executable, "-c", hide, "recipe", "validate", str(tiny_recipe)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "streamrl: error: metrics: name = \"wandb\" needs the wandb package: pip install 'streamrl[wandb]'"]


@pytest.mark.parametrize("sink", ["tensorboard", "wandb", "mlflow", "trackio"])
def test_every_setting_is_documented(sink):
    from streamrl.plugins.registry import build_registry

    config = build_registry().get("metric_sink", sink, "metrics[0].name").config
    assert config.model_config["extra"] == "forbid"
    assert [name for name, f in config.model_fields.items() if not f.description] == []


def test_wandb_online_without_an_account_is_one_line_before_the_cluster_starts(tiny_recipe, tmp_path):
    Path(tiny_recipe).write_text(Path(tiny_recipe).read_text() + '\n[[metrics]]\nname = "wandb"\n')
    (tmp_path / "netrc").write_text("")  # no W&B key from this machine's ~/.netrc
    env = {**offline_env(tmp_path), "NETRC": str(tmp_path / "netrc")}
    proc = subprocess.run([sys.executable, "-m", "streamrl", "recipe", "run", str(tiny_recipe), "--plain"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]  # (W&B's own words in between: "No API key configured...")
    assert last.startswith('streamrl: error: metrics: name = "wandb": ') and last.endswith('mode = "offline")'), last
    assert "dashboard:" not in proc.stderr  # no cluster was started


def test_the_csv_sink_of_a_resumed_run_keeps_the_steps_before_its_checkpoint(tmp_path):
    import csv

    from streamrl.telemetry.csv_sink import CSVSink, CSVSinkConfig

    # as a resume leaves the folder: metrics.jsonl cut back to the checkpoint's two steps, and
    # the CSV as the first run left it (three steps)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": s / 10}) + "\n" for s in range(2)))
    (tmp_path / "metrics.csv").write_text("step,loss\n0,0.0\n1,0.1\n2,0.2\n")
    sink = CSVSink(CSVSinkConfig())
    sink.open(tmp_path)
    sink.write({"step": 2, "loss": 0.25})  # the step after the checkpoint, run again
    sink.close()
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [(r["step"], r["loss"]) for r in rows] == [("0", "0.0"), ("1", "0.1"), ("2", "0.25")]


def test_the_csv_sink_leaves_the_sample_log_out_and_writes_a_lone_surrogate_escaped(tmp_path):
    import csv

    from streamrl.telemetry.csv_sink import CSVSink, CSVSinkConfig

    sink = CSVSink(CSVSinkConfig())
    sink.open(tmp_path)
    sink.write({"step": 0, "note": "broken \ud800 text", "sample_log": [{"text": "x" * 100_000}]})
    sink.close()
    (row,) = list(csv.DictReader((tmp_path / "metrics.csv").open(encoding="utf-8")))
    assert row == {"step": "0", "note": "broken \\ud800 text"}


def test_an_int_past_a_floats_range_is_left_out_not_the_end_of_the_sink():
    # (math.isfinite(10**400) raises OverflowError: the sink that met it was dropped for the run)
    assert tracker_metrics({"reward_mean": 0.5, "plugin": {"huge": 10**400, "ok": 2}, "big": -(10**400)}) == {
        "reward/mean": 0.5, "plugin/ok": 2.0}


@pytest.mark.parametrize("name", ["../escaped.csv", "/tmp/abs.csv", "metrics.jsonl", "sub/m.csv", ".csv", "a.csv/"])
def test_the_csv_sinks_file_is_a_bare_csv_name_in_the_run_folder(name):
    from pydantic import ValidationError

    from streamrl.telemetry.csv_sink import CSVSinkConfig

    with pytest.raises(ValidationError, match="file"):
        CSVSinkConfig(file=name)
    assert CSVSinkConfig(file="learner-b.metrics.csv").file == "learner-b.metrics.csv"
