"""Damaged run folders, as a hostile but fair user (or a crash, or a full disk) leaves them.

The newest checkpoint cut short, a shard of a sharded trainer deleted, a byte changed: a resume
passes it over for the one before, with a one-line warning naming what is wrong, and finishes
the run; with no usable checkpoint it stops in one line. A torn last line of ``metrics.jsonl``
(a crash mid-write) is dropped with a warning; a bad line in the middle is a one-line error. A
disk that fills while a checkpoint is written stops the run in one line, leaves no partial
folder and keeps the older checkpoints.

One real run (fsdp over two train workers, so its checkpoints hold two shards) makes the
checkpoints every test here damages a copy of.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from streamrl.errors import RunWarning, UserError
from streamrl.checkpoints import folders, integrity
from tests.helpers import ROOT, newest_usable, only_run, read_records, rewrite_manifest, sets, streamrl, write_tiny_recipe

SHARDED = ["run.mode=batch", "run.steps=4", "run.checkpoint_every=2", "pools.train.workers=2",
           "trainer.strategy=fsdp", "engine.reproducible=true"]


def stderr_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def finished(tiny_model, tmp_path_factory) -> Path:
    """A finished run with checkpoints step-000002 and step-000004 (never modified: copy it)."""
    folder = tmp_path_factory.mktemp("ckpt-faults")
    recipe = write_tiny_recipe(folder, tiny_model)
    proc = streamrl("recipe", "run", str(recipe), *sets(*SHARDED), "--plain", "--no-report")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = (folder / "runs").iterdir()
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == ["step-000002", "step-000004"]
    return run


@pytest.fixture
def run_copy(finished, tmp_path) -> Path:
    """A copy of the finished run to damage (``recipe.toml``'s model path is absolute)."""
    copy = tmp_path / finished.name
    shutil.copytree(finished, copy)
    return copy


def cut(path: Path, keep: float = 0.5) -> None:
    """Truncate ``path`` to a share of its bytes, as a crash or a full disk leaves a file."""
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def flip(path: Path) -> None:
    """Change one byte in the middle of ``path`` (same size)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


# -- passed over for the one before ----------------------------------------------------------------
DAMAGES = {
    "trainer.pt cut short": (lambda c: cut(c / "trainer" / "trainer.pt"), "trainer/trainer.pt is"),
    "dispatch.json cut short": (lambda c: cut(c / "dispatch.json"), "dispatch.json is"),
    "a shard deleted": (lambda c: (c / "trainer" / "dcp" / "__1_0.distcp").unlink(),
                        "trainer/dcp/__1_0.distcp is missing"),
    "the DCP metadata cut short": (lambda c: cut(c / "trainer" / "dcp" / ".metadata", 0.9), "trainer/dcp/.metadata is"),
    "a byte of a shard changed": (lambda c: flip(c / "trainer" / "dcp" / "__0_0.distcp"),
                                  "trainer/dcp/__0_0.distcp does not hold what was written (its SHA-256 differs)"),
    "controller.json cut short": (lambda c: cut(c / "controller.json"), "controller.json is"),
    # damaged JSON whose manifest was written after the damage: the bytes match, the content does not
    "dispatch.json cut mid-list, manifest to match": (
        lambda c: (cut(c / "dispatch.json", 0.3), rewrite_manifest(c)), "dispatch.json cannot be read (JSONDecodeError)"),
    "controller.json a list, manifest to match": (
        lambda c: ((c / "controller.json").write_text("[1, 2, 3]"), rewrite_manifest(c)),
        "controller.json does not hold what a checkpoint writes there (a list, not an object)"),
    "controller.json a negative step, manifest to match": (
        lambda c: ((c / "controller.json").write_text('{"next_step": -4, "policy_version": 4, "records": 4}'),
                   rewrite_manifest(c)), "controller.json does not hold what a checkpoint writes there (next_step is -4, "
                                         "not a count)"),
    # a manifest edited by hand: a size past a float's range, a file outside the checkpoint
    "manifest with a size of 1e400": (
        lambda c: (c / "manifest.json").write_text('{"files": {"controller.json": {"bytes": 1e400, "sha256": "x"}}}'),
        "manifest.json cannot be read (OverflowError)"),
    "manifest naming a file outside the checkpoint": (
        lambda c: (c / "manifest.json").write_text('{"files": {"../../../metrics.jsonl": {"bytes": 1, "sha256": "x"}}}'),
        "manifest.json names '../../../metrics.jsonl', not a file inside the checkpoint"),
}


@pytest.mark.slow
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_newest_checkpoint_is_passed_over_with_a_warning_naming_what_is_wrong(finished, run_copy, damage):
    do, says = DAMAGES[damage]
    do(run_copy / "checkpoints" / "step-000004")
    best, warned = newest_usable(run_copy)
    assert best is not None and best.name == "step-000002"
    assert len(warned) == 1 and warned[0].startswith(f"checkpoint step-000004 is not usable: {says}"), warned
    assert warned[0].endswith("using step-000002, the newest one that is") and "\n" not in warned[0]
    # the undamaged run is taken as it is, nothing warned: the check is no false alarm
    intact, none = newest_usable(finished)
    assert intact is not None and intact.name == "step-000004" and none == []


@pytest.mark.slow
def test_a_checkpoint_written_before_manifests_is_still_checked_by_reading_it(run_copy):
    for ckpt in (run_copy / "checkpoints").iterdir():  # (as an older streamrl wrote them: no manifest, no mark of one)
        (ckpt / integrity.MANIFEST).unlink()
        controller = json.loads((ckpt / "controller.json").read_text())
        (ckpt / "controller.json").write_text(json.dumps({k: v for k, v in controller.items() if k != "manifest"}))
    best, warned = newest_usable(run_copy)
    assert best is not None and best.name == "step-000004" and warned == []  # an older run's folder resumes
    cut(run_copy / "checkpoints" / "step-000004" / "trainer" / "dcp" / "__1_0.distcp", 0.5)
    best, warned = newest_usable(run_copy)
    assert best is not None and best.name == "step-000002"
    assert warned[0].startswith("checkpoint step-000004 is not usable: trainer/dcp/__1_0.distcp is "), warned
    cut(run_copy / "checkpoints" / "step-000002" / "trainer" / "trainer.pt")
    best, problems = folders.usable(run_copy)
    assert best is None and problems[1].startswith("step-000002 is not usable: trainer/trainer.pt cannot be loaded")


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["trainer.pt cut short", "a shard deleted"])
def test_a_resume_goes_on_from_the_checkpoint_before_a_damaged_one_and_finishes_the_run(run_copy, damage):
    do, says = DAMAGES[damage]
    do(run_copy / "checkpoints" / "step-000004")
    proc = streamrl("recipe", "resume", str(run_copy), "--set", "run.steps=5", "--plain", "--no-report")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    warned = [line for line in stderr_lines(proc) if line.startswith("streamrl: warning: checkpoint")]
    assert len(warned) == 2, proc.stderr  # once, on one line each
    assert warned[0].startswith(f"streamrl: warning: checkpoint step-000004 is not usable: {says}")
    assert warned[0].endswith("using step-000002, the newest one that is")
    assert warned[1] == ("streamrl: warning: checkpoints/step-000004 is kept as damaged-step-000004 "
                         "(the resumed run writes that step again)")
    assert "resumed from step-000002" in proc.stderr
    records = read_records(run_copy)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]  # steps 3 and 4 run again, then step 5
    names = sorted(p.name for p in (run_copy / "checkpoints").iterdir())
    # the damaged checkpoint is kept aside for a look, and the steps it held were written anew
    assert names == ["damaged-step-000004", "step-000004", "step-000005"]
    assert integrity.verify(run_copy / "checkpoints" / "step-000004") is None


@pytest.mark.slow
def test_a_resume_with_no_usable_checkpoint_is_one_line_naming_each(run_copy):
    cut(run_copy / "checkpoints" / "step-000004" / "trainer" / "trainer.pt")
    (run_copy / "checkpoints" / "step-000002" / "trainer" / "dcp" / "__0_0.distcp").unlink()
    proc = streamrl("recipe", "resume", str(run_copy))
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in stderr_lines(proc) if not line.startswith("streamrl: warning:")]
    assert errors == [f"streamrl: error: {run_copy}: no usable checkpoint to resume from "
                      f"(step-000004 is not usable: {errors[0].split('step-000004 is not usable: ')[1]}"]
    assert "trainer/trainer.pt is" in errors[0] and "step-000002 is not usable: trainer/dcp/__0_0.distcp is missing" in errors[0]


# -- metrics.jsonl ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_torn_last_metrics_line_is_dropped_with_a_warning_and_the_run_resumes_from_it(run_copy):
    from streamrl.run.run_folder import RunFolder

    metrics = run_copy / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    # a crash in the middle of writing step 5's record (the checkpoint is after step 4)
    metrics.write_text("\n".join(lines) + "\n" + lines[-1][: len(lines[-1]) // 2])
    loaded, folder = RunFolder.for_resume(run_copy, ["run.steps=6"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        folder.open(loaded, [], folders.read(folder.latest_checkpoint()))
    warned = [str(w.message) for w in caught if issubclass(w.category, RunWarning)]
    assert warned == [f"{metrics}: its last line (line 5) was cut off, as a crash in the middle of writing it "
                      "leaves it, and is dropped"]
    assert [r["step"] for r in folder.records] == [0, 1, 2, 3]
    assert metrics.read_text().splitlines() == lines  # the file is whole again


@pytest.mark.slow
def test_a_bad_metrics_line_in_the_middle_is_a_one_line_error_naming_the_file_and_the_line(run_copy):
    metrics = run_copy / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    lines[1] = lines[1][:40]
    metrics.write_text("\n".join(lines) + "\n")
    proc = streamrl("recipe", "resume", str(run_copy), "--set", "run.steps=6")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert stderr_lines(proc) == [f"streamrl: error: {metrics}: line 2 of 4 is not a JSON record "
                                  f"({stderr_lines(proc)[0].split('is not a JSON record (')[1]}"]
    assert "only a last line is ever cut off by a crash" in proc.stderr
    from streamrl.telemetry.metrics import read

    with pytest.raises(UserError, match="line 2 of 4"):
        read(metrics)


# -- a full disk ------------------------------------------------------------------------------------
# The embedded cluster's processes (and the run's own) import this at start-up: fsync of any file
# of the second checkpoint fails as a full disk makes it fail. (A small tmpfs would be the real
# thing, but mounting one needs root.) torch.distributed.checkpoint fsyncs every file it writes.
FULL_DISK = """
import errno, os

_fsync = os.fsync


def fsync(fd):
    if "/.tmp-step-000004/" in os.readlink(f"/proc/self/fd/{fd}"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return _fsync(fd)


os.fsync = fsync
"""


@pytest.mark.slow
def test_a_full_disk_while_checkpointing_is_one_line_and_keeps_the_older_checkpoints_simulated_enospc(
        tiny_model, tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(FULL_DISK)
    recipe = write_tiny_recipe(tmp_path, tiny_model)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), str(ROOT)])}
    proc = streamrl("recipe", "run", str(recipe), *sets(*SHARDED, "run.steps=6"), "--plain", "--no-report",
                    env=env, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    (run,) = (tmp_path / "runs").iterdir()
    errors = [line for line in stderr_lines(proc) if line.startswith("streamrl: error:")]
    assert errors == [f"streamrl: error: checkpoint step-000004 could not be written to {run / 'checkpoints'}: "
                      f"no space left on device; {errors[0].split('no space left on device; ')[1]}"]
    assert errors[0].endswith(f"its partial folder was removed, the older checkpoints are kept; the last "
                              f"checkpoint is step-000002 (resume with: streamrl recipe resume {run}, "
                              "--set to change the recipe)")
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-000002"]  # no .tmp-step-000004 left
    assert integrity.verify(run / "checkpoints" / "step-000002") is None
    state = json.loads((run / "status.json").read_text())
    assert state["state"] == "failed" and state["error"].startswith("CheckpointFailed: checkpoint step-000004")
    # the older checkpoint is whole: a resume (with room on the disk again) finishes the run
    proc = streamrl("recipe", "resume", str(run), "--plain", "--no-report")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from step-000002" in proc.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000004", "step-000006"]
    loaded = torch.load(run / "checkpoints" / "step-000006" / "trainer" / "trainer.pt", weights_only=False)
    assert loaded["version"] == 6


@pytest.mark.slow
def test_a_real_full_disk_while_checkpointing_is_one_line_and_a_resume_with_room_finishes_real_tmpfs(tiny_recipe, tmp_path,
                                                                                                     shared_cluster):
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    # a disk of 9.5 MB: two checkpoints of the tiny model (4 MB each) and the run folder fit, a third does not
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=9500k,mode=0700", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"this machine cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        proc = streamrl("recipe", "run", str(tiny_recipe), *sets(f"run.out_dir={disk}", "run.steps=8",
                                                                 "run.checkpoint_every=2", *shared_cluster.sets),
                        "--plain", "--no-report")
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr
        (run,) = disk.iterdir()
        errors = [line for line in stderr_lines(proc) if line.startswith("streamrl: error:")]
        assert len(errors) == 1 and errors[0].startswith(
            f"streamrl: error: checkpoint step-000006 could not be written to {run / 'checkpoints'}: "), errors
        # torch's zip writer says "unexpected pos" for a short write; the line says what it means
        assert ("no space left on device" in errors[0] or "the disk is full, or nearly" in errors[0]), errors[0]
        assert errors[0].endswith(f"its partial folder was removed, the older checkpoints are kept; the last "
                                  f"checkpoint is step-000004 (resume with: streamrl recipe resume {run}, "
                                  "--set to change the recipe)")
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
        assert integrity.verify(run / "checkpoints" / "step-000004") is None
        # room again: the resume finishes the run from step-000004
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        proc = streamrl("recipe", "resume", str(run), *sets(*shared_cluster.sets), "--plain", "--no-report")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "resumed from step-000004" in proc.stderr
        assert [r["step"] for r in read_records(run)] == list(range(8))
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


# -- a poisoned update ------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_ruinous_update_is_never_checkpointed_and_a_resume_can_pick_an_earlier_checkpoint(tmp_path, shared_cluster):
    # The shipped PPO recipe stopped at step 10, resumed with trainer.lr = 1e9 and a checkpoint
    # after every step: step 11's update is finite but ruins the policy (before, its checkpoint
    # was written, step 12's gradient was NaN, and every resume from step-000011 failed the same
    # way). It stops at step 11 itself, nothing of it checkpointed, naming the checkpoint to go
    # on from and an earlier one. (On the shared cluster: the checks are the controller's.)
    on = shared_cluster.sets
    first = streamrl("recipe", "run", "recipes/ppo.toml",
                     *sets("run.steps=10", "run.checkpoint_every=5", f'run.out_dir="{tmp_path}"', *on), "--plain",
                     "--no-report")
    assert first.returncode == 0, first.stderr[-3000:]
    (run,) = tmp_path.iterdir()
    bad = streamrl("recipe", "resume", str(run), *sets("run.steps=20", "trainer.lr=1e9", "run.checkpoint_every=1", *on),
                   "--plain", "--no-report")
    assert bad.returncode == 1 and "Traceback" not in bad.stderr, bad.stderr[-3000:]
    last = stderr_lines(bad)[-1]
    assert last.startswith("streamrl: error: step 11: the update changed the weights' norm from "), last
    assert "more than trainer.max_weight_change = 1 of it" in last and "the last checkpoint is step-000010" in last
    assert f"resume from an earlier one, step-000005 (streamrl recipe resume {run} --from step-000005)" in last
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000005", "step-000010"]
    # a sane learning rate goes on from the last checkpoint
    good = streamrl("recipe", "resume", str(run),
                    *sets("run.steps=12", "trainer.lr=5e-4", "run.checkpoint_every=1", *on),
                    "--plain", "--no-report")
    assert good.returncode == 0, good.stderr[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000011", "step-000012"]
    # --from picks an older checkpoint; the newer one is set aside, the steps after it run again
    again = streamrl("recipe", "resume", str(run), "--from", "step-11", *sets("run.steps=13", *on), "--plain",
                     "--no-report")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from step-000011" in again.stderr
    assert ("streamrl: warning: checkpoints/step-000012 is kept as passed-over-step-000012 (the resumed run writes "
            "that step again)") in stderr_lines(again)
    records = read_records(run)
    assert [r["step"] for r in records] == list(range(13))
    missing = streamrl("recipe", "resume", str(run), "--from", "step-99")
    assert missing.returncode == 2 and stderr_lines(missing)[-1] == (
        f"streamrl: error: --from step-99: no such checkpoint in {run / 'checkpoints'} (there are: "
        "step-000012, step-000013)")


@pytest.mark.slow
def test_a_policy_transformers_refuses_to_save_at_the_end_is_one_line_naming_the_last_checkpoint(tiny_model, tmp_path,
                                                                                               shared_cluster):
    import json
    import shutil

    # a model folder whose config still says it was GGUF-quantized: it loads and trains, and
    # transformers refuses to save it
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gguf"}}))
    recipe = write_tiny_recipe(tmp_path, model)
    proc = streamrl("recipe", "run", str(recipe), *sets("run.steps=2", "run.checkpoint_every=2", *shared_cluster.sets),
                    "--plain", "--no-report")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("streamrl: error: every step ran, but the trained policy could not be saved to ")
    assert "is quantized with gguf" in line and "the last checkpoint is step-000002" in line
    run = only_run(tmp_path / "runs")
    assert len(read_records(run)) == 2
    assert json.loads((run / "status.json").read_text())["state"] == "failed"


@pytest.mark.parametrize("name, text, says", [
    ("learners.json", '{"learners": {"a": {}}}', "learner 'a' is not a table, a summary and has_state"),
    ("learners.json", '{"learners": {"../x": {"table": {}, "summary": {}, "has_state": false}}}',
     "'../x' is not a learner's name"),
    ("learners.json", '{"learners": {"a": {"table": {}, "summary": {"steps_trained": -1}, "has_state": true}}}',
     "learner 'a''s steps_trained is not a count"),
    # the folder a learner was built from: the run's own, never a model elsewhere on the disk
    ("learners.json", '{"learners": {"a": {"table": {}, "summary": {}, "has_state": true, "start": "/models/other"}}}',
     "learner 'a''s start is not a folder of the run's learners/ ('/models/other')"),
    ("learners.json", '{"learners": {"a": {"table": {}, "summary": {}, "has_state": true, '
                      '"start": "learners/start-a-3/../../../x"}}}',
     "learner 'a''s start is not a folder of the run's learners/ ('learners/start-a-3/../../../x')"),
    ("serve_traffic.json", '{"groups": [[{"uid": "x"}]]}', "a group is not a list of samples, each with its prompt"),
    ("serve_traffic.json", '{"groups": {}}', "groups is not a list"),
])
def test_a_side_learner_or_traffic_file_not_as_written_is_the_checkpoints_problem(tmp_path, name, text, says):
    from streamrl.checkpoints.integrity import json_problem

    (tmp_path / "controller.json").write_text('{"next_step": 2, "policy_version": 2, "records": 2}')
    (tmp_path / name).write_text(text)
    assert json_problem(tmp_path) == f"{name} does not hold what a checkpoint writes there ({says})"
    (tmp_path / name).write_text('{"learners": {}, "groups": []}')
    assert json_problem(tmp_path) is None


# -- folders made here (no run): the order, the sweep, what a manifest does not list -----------------
def fake_checkpoint(run: Path, step: int, manifest: bool = True) -> Path:
    """A checkpoint folder as :func:`folders.write` leaves one (a trainer file of a few bytes)."""
    ckpt = folders.folder(run) / f"{folders.PREFIX}{step:06d}"
    (ckpt / "trainer").mkdir(parents=True)
    (ckpt / "trainer" / "sim_trainer.json").write_text(json.dumps({"version": step}))
    (ckpt / "controller.json").write_text(json.dumps({"next_step": step, "policy_version": step, "records": step}))
    if manifest:
        integrity.write_manifest(ckpt)
    return ckpt


def test_checkpoints_past_step_999999_are_ordered_by_their_step_not_their_name(tmp_path):
    # by name, step-1000000 sorted before step-999999: a resume took the older one, and the
    # rotation after a write removed the one just written
    older, newer = fake_checkpoint(tmp_path, 999_999), fake_checkpoint(tmp_path, 1_000_000)
    assert folders.latest(tmp_path) == newer and folders.usable_all(tmp_path) == [older, newer]
    assert folders.named(tmp_path, "1000000") == newer
    assert folders.set_aside(tmp_path, older) == ["passed-over-step-1000000"]  # (newer than the one resumed)
    assert folders.latest(tmp_path) == older


def test_a_checkpoint_write_sweeps_the_unfinished_writes_a_killed_run_left(tmp_path, scheduler_only):
    fake_checkpoint(tmp_path, 2)
    left = folders.folder(tmp_path) / ".tmp-step-000003"
    (left / "trainer").mkdir(parents=True)
    (left / "trainer" / "trainer.pt").write_bytes(b"x" * 1000)  # (a full-size copy of the weights, in life)
    # (no trainer rank to save here: the controller's part alone, on a real scheduler)
    made = folders.write(scheduler_only, [], None, tmp_path, 4, 4, 4, keep=2, files={"dispatch.json": b"{}"})
    assert made.name == "step-000004" and not left.exists()
    assert sorted(p.name for p in folders.folder(tmp_path).iterdir()) == ["step-000002", "step-000004"]


def test_a_checkpoint_is_on_disk_before_an_older_one_is_removed(tmp_path, scheduler_only, monkeypatch):
    # (without fsync a power cut after retention found the new checkpoint's files empty and
    # nothing older to resume from)
    fake_checkpoint(tmp_path, 2)
    synced, real = [], os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    made = folders.write(scheduler_only, [], None, tmp_path, 4, 4, 4, keep=1, files={"dispatch.json": b"{}"})
    tmp = str(folders.folder(tmp_path) / ".tmp-step-000004")
    assert {f"{tmp}/{p.name}" for p in made.iterdir()} | {tmp} <= set(synced)
    assert str(folders.folder(tmp_path)) in synced  # (the rename)
    assert [p.name for p in folders.folder(tmp_path).iterdir()] == ["step-000004"]
    # a folder that cannot be synced: the checkpoint stands, the one before it is kept, one warning

    def failing(fd):
        if os.readlink(f"/proc/self/fd/{fd}") == str(folders.folder(tmp_path)):
            raise OSError(5, "Input/output error")
        return real(fd)
    monkeypatch.setattr(os, "fsync", failing)
    with pytest.warns(RunWarning, match="step-000006: the checkpoints folder could not be synced to disk "
                                        r"\(Input/output error\); the checkpoint before it is kept too"):
        folders.write(scheduler_only, [], None, tmp_path, 6, 6, 6, keep=1, files={"dispatch.json": b"{}"})
    assert [p.name for p in sorted(folders.folder(tmp_path).iterdir())] == ["step-000004", "step-000006"]
    with pytest.warns(RunWarning):  # (and no more than that: a folder that never syncs does not fill the disk)
        folders.write(scheduler_only, [], None, tmp_path, 8, 8, 8, keep=1, files={"dispatch.json": b"{}"})
    assert [p.name for p in sorted(folders.folder(tmp_path).iterdir())] == ["step-000006", "step-000008"]


def test_a_checkpoint_that_lost_its_manifest_is_damaged_not_taken_for_an_old_one(tmp_path, scheduler_only):
    def trainer(folder):
        (folder / "trainer").mkdir()
        (folder / "trainer" / "weights.bin").write_bytes(b"x" * 100)
    made = folders.write(scheduler_only, [], None, tmp_path, 4, 4, 4, keep=2, also=trainer)
    assert integrity.verify(made) is None
    (made / integrity.MANIFEST).unlink()  # (a copy of the run folder cut short before its last file)
    assert integrity.verify(made) == "manifest.json is missing (the checkpoint was written with one: a copy cut short?)"
    # one from before manifests (no such mark in its controller.json) is still checked by reading it
    controller = json.loads((made / "controller.json").read_text())
    (made / "controller.json").write_text(json.dumps({k: v for k, v in controller.items() if k != "manifest"}))
    assert integrity.verify(made) is None


def test_what_a_resume_reads_must_be_a_listed_bounded_file(tmp_path):
    ckpt = fake_checkpoint(tmp_path, 2)
    assert integrity.verify(ckpt) is None
    # a side learners' file copied in from another run after the manifest: would be acted on
    (ckpt / "learners.json").write_text('{"learners": {}}')
    assert integrity.verify(ckpt) == ("learners.json is not among the files its manifest.json lists (it was added "
                                      "after the checkpoint was written)")
    (ckpt / "learners.json").unlink()
    # without a manifest (an older streamrl's): a FIFO or a link to an endless device is not read
    legacy = fake_checkpoint(tmp_path, 3, manifest=False)
    os.mkfifo(legacy / "dispatch.json")
    assert integrity.verify(legacy) == "dispatch.json is not a file"  # (it waited for a writer for ever)
    (legacy / "dispatch.json").unlink()
    (legacy / "serve_traffic.json").symlink_to("/dev/zero")
    assert integrity.verify(legacy) == "serve_traffic.json is not a file"
    (legacy / "serve_traffic.json").unlink()
    assert integrity.verify(legacy) is None
    # and one whose trainer part never arrived (an interrupted copy) is passed over, not blamed
    # on the trainer's set-up when it fails to load
    shutil.rmtree(legacy / "trainer")
    assert integrity.verify(legacy) == "trainer/ is missing or empty"
    best, warned = newest_usable(tmp_path)
    assert best == ckpt and warned[0].startswith("checkpoint step-000003 is not usable: trainer/ is missing")


def test_the_policy_is_written_whole_then_renamed_keeping_removed_learners_policies(tmp_path):
    # (the run's calls stood in for) a recipe without [[learners]] whose added learner was
    # removed: its policy, saved as it left, was deleted with the old policy folder
    from types import SimpleNamespace

    from streamrl.checkpoints import saving

    out = tmp_path / "policy"
    (out / "removed").mkdir(parents=True)
    (out / "removed" / "config.json").write_text('{"kept": true}')
    (out / "critic").mkdir()
    (out / "critic" / "config.json").write_text("{}")  # (a stale part of the main policy: not kept)
    (out / "config.json").write_text("{")  # (half of a save cut short)
    written = []

    def submit(fn, path, **kwargs):
        assert ".tmp-policy" in path  # (never into the folder that is read)
        (Path(path) / "config.json").write_text('{"model_type": "llama"}')
        written.append(path)
        return path

    ctl = SimpleNamespace(dispatcher=SimpleNamespace(finish=lambda: None), finish=lambda folder: None,
                          resolved=SimpleNamespace(learners=[SimpleNamespace(name="main")]),
                          recipe=SimpleNamespace(learners=[]), last_step=None,
                          client=SimpleNamespace(submit=submit, gather=lambda futures: futures),
                          topology=SimpleNamespace(incarnations={}, writers=lambda: [{}]))
    assert saving.policy(ctl, out) == str(out)
    assert json.loads((out / "config.json").read_text()) == {"model_type": "llama"}
    assert json.loads((out / "removed" / "config.json").read_text()) == {"kept": True}
    assert not (out / "critic").exists() and not list(tmp_path.glob(".tmp-*")) and len(written) == 1
