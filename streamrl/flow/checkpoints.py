"""Checkpoints of a run: the trainer's state and the controller's, together, at a step boundary.

``<run folder>/checkpoints/step-000040/`` holds ``trainer/`` (written by the trainer on its
worker: weights, optimizer, schedules, RNG states) and ``controller.json`` (the next step to run,
the policy version, how many metrics records belong to the run so far). A checkpoint is built in
a ``.tmp-`` folder and renamed only once both parts are there, so a crash mid-write leaves the
previous checkpoint as the newest one. The ``run.keep_checkpoints`` newest are kept.

What is not saved, on purpose: samples in flight. Prompts are a function of the step
(``task.prompts(step, n)``), so a resumed run generates the prompts of every step after the
checkpoint again -- in ``async`` mode, too, the ones generated ahead -- and trains each step's
prompts once.

What the run learned about output lengths is saved too: ``ranker.pt`` (the length ranker's
``state_dict`` after the lessons of every step up to the checkpoint) and ``dispatch.json`` (the
lengths the scheduler sizes its work by), so a resumed run ranks and places its prompts as the
uninterrupted run would have.
"""

from __future__ import annotations

import json
import os
import time
import shutil
from pathlib import Path

from distributed import Client, Future

from streamrl.flow import remote

PREFIX = "step-"


def folder(run_dir: Path) -> Path:
    """Where a run keeps its checkpoints."""
    return run_dir / "checkpoints"


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    done = sorted(p for p in folder(run_dir).glob(f"{PREFIX}*") if (p / "controller.json").exists())
    return done[-1] if done else None


def write(client: Client, train_pins: list[dict], after: Future | None, run_dir: Path, next_step: int,
          version: int, records: int, keep: int, trainer_id: str | dict | None = None,
          files: dict[str, bytes] | None = None) -> Path:
    """Write the checkpoint taken after step ``next_step - 1``; returns its folder. The trainer's
    part is written by the ranks in ``train_pins`` together (rank 0 alone unless sharded);
    ``files`` (name: bytes) go beside it (the dispatcher's and ranker's state)."""
    final = folder(run_dir) / f"{PREFIX}{next_step:06d}"
    tmp = folder(run_dir) / f".tmp-{PREFIX}{next_step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    stamp = time.time_ns()
    # (a fresh key: the same step written again -- a resumed run -- must not be answered with
    # the first write's finished task, which wrote into a folder that is gone)
    client.gather([client.submit(remote.save_trainer_checkpoint, str(tmp / "trainer"), after=after, trainer_id=trainer_id,
                                 key=f"checkpoint-{next_step}-{stamp}-{i}", pure=False, **pin)
                   for i, pin in enumerate(train_pins)])
    for name, blob in (files or {}).items():
        (tmp / name).write_bytes(blob)
    (tmp / "controller.json").write_text(json.dumps(
        {"next_step": next_step, "policy_version": version, "records": records}, indent=2))
    shutil.rmtree(final, ignore_errors=True)  # a resumed run writing the same step again
    os.replace(tmp, final)
    for old in sorted(folder(run_dir).glob(f"{PREFIX}*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def read(checkpoint: Path) -> dict:
    """The controller's part of a checkpoint."""
    return json.loads((checkpoint / "controller.json").read_text())


def restore_trainer(client: Client, train_pins: list[dict], checkpoint: Path) -> None:
    """Load the trainer's part into the (freshly placed) trainer of every rank, all at once
    (sharded ranks read their shards together)."""
    stamp = time.time_ns()
    client.gather([client.submit(remote.load_trainer_checkpoint, str(checkpoint / "trainer"),
                                 key=f"restore-{checkpoint.name}-{stamp}-{i}", pure=False, **pin)
                   for i, pin in enumerate(train_pins)])
