"""``metrics.jsonl`` is strict JSON: a value that is not finite is written as ``null``, so readers
other than Python's (``JSON.parse``, Go, serde, jq) can read every line."""

from __future__ import annotations

import json
import math

import pytest

from streamrl.telemetry.metrics import MetricsLog, read


def strict(line: str):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(line, parse_constant=refuse)


def test_non_finite_values_are_written_as_null_and_the_rest_as_they_are(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.write({"step": 0, "loss": 0.5, "reward": 1.0})
    log.write({"step": 1, "loss": math.nan, "grad_norm": math.inf, "reward": 0.25,
               "offpolicy": {"v1": {"log_ratio": -math.inf, "k3": [1.0, math.nan]}}})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    first, second = (strict(line) for line in lines)
    assert first == {"step": 0, "loss": 0.5, "reward": 1.0}
    assert second == {"step": 1, "loss": None, "grad_norm": None, "reward": 0.25,
                      "offpolicy": {"v1": {"log_ratio": None, "k3": [1.0, None]}}}
    # a resume keeps the first records, still strict
    MetricsLog(tmp_path / "metrics.jsonl").keep_first(2)
    assert [strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [first, second]
    assert read(tmp_path / "metrics.jsonl")[1]["loss"] is None


def test_the_report_reads_a_step_whose_loss_was_not_finite(tmp_path):
    from streamrl.telemetry.report import load_run

    log = MetricsLog(tmp_path / "metrics.jsonl")
    for step in range(3):
        log.write({"step": step, "reward_mean": 0.1 * step, "loss": math.nan if step == 1 else 0.5, "samples": 4})
    run = load_run(tmp_path)
    assert len(run.records) == 3 and run.records[1]["loss"] is None
    with pytest.raises(ValueError):
        strict('{"loss": NaN}')


def test_a_lone_surrogate_is_written_as_a_replacement_character_and_a_pair_as_itself(tmp_path):
    # (a tool's or a model's broken text) "\ud800" alone is no character: serde and other strict
    # readers refuse the line; the trace's events the same
    from streamrl.telemetry.metrics import json_line

    line = json_line({"step": 0, "sample_log": [{"text": "a\ud800b\udc00", "emoji": "😀", "note": "\\ud800 as typed"}]})
    (x,) = strict(line)["sample_log"]
    assert x == {"text": "a\ufffdb\ufffd", "emoji": "😀", "note": "\\ud800 as typed"}
    assert all(v.encode("utf-8") for v in x.values())  # (a lone surrogate does not encode)


def test_records_are_synced_for_a_checkpoint_and_a_resume_that_finds_fewer_says_so(tmp_path, monkeypatch):
    import os

    from streamrl.errors import RunWarning
    from streamrl.telemetry import metrics

    synced = []
    monkeypatch.setattr(metrics.os, "fsync", lambda fd: synced.append(os.fstat(fd).st_size))
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.write({"step": 0})
    log.write({"step": 1})
    log.sync()
    assert synced == [(tmp_path / "metrics.jsonl").stat().st_size]  # every record so far, on the disk
    # the machine crashed after a checkpoint of 3 records was written, before the third reached the disk
    with pytest.warns(RunWarning, match="metrics.jsonl holds 2 records, the checkpoint resumed from was written after 3"):
        MetricsLog(tmp_path / "metrics.jsonl").keep_first(3)
