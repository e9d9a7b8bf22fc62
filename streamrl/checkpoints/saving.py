"""What a run leaves behind, written from the controller's state: a checkpoint of the whole run
after a step (``checkpoints/folders.py`` writes and reads the files) and, at the end, the trained
policy as a model folder. Kept apart from the step loop (``run/controller.py``), which only
says when."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from streamrl.checkpoints import folders
from streamrl.on_worker import task_functions


def checkpoint(ctl, run_dir: Path, next_step: int, records: int) -> Path:
    """Write a checkpoint of ``ctl`` (a :class:`~streamrl.run.controller.Controller`) after its
    last submitted optimizer step: the trainer's state on every writer rank, what the dispatcher
    learned, the side learners' states; returns the checkpoint folder."""
    files = ctl.dispatcher.checkpoint_files(f"{next_step}-{time.time_ns()}")
    also = ctl.checkpoint_writer(next_step, folders.latest(run_dir))  # (the step extensions' state)
    return folders.write(ctl.client, ctl.topology.writers(), ctl.last_step, run_dir, next_step,
                             ctl.version, records, ctl.recipe.run.keep_checkpoints,
                             ctl.topology.incarnations, files=files, also=also,
                             prompt_order=folders.prompt_order(ctl.recipe))


#: Folders a trainer writes inside its policy folder (its critic, a LoRA learner's adapter).
OWN_FOLDERS = ("critic", "adapter")


def policy(ctl, out: Path) -> str:
    """Write the trained policy of ``ctl`` to ``out`` (after the ranker's last lesson and the
    step extensions' finish: the elastic pool's last change, the side learners' policies in
    ``out/<name>``); returns the folder: ``out``, or ``out/<main learner>`` when the recipe has
    ``[[learners]]``.

    Written whole into a folder beside ``out``, then renamed to it: a save cut short (a killed
    worker, a second Ctrl-C) leaves no half-written model where one is read (``streamrl eval``
    would score it), and a resume writes it again from the last checkpoint. What ``out`` held
    (the policy of a learner removed while the run went on) is kept."""
    tmp = out.parent / f".tmp-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    ctl.dispatcher.finish()
    ctl.finish(tmp)
    name = ctl.resolved.learners[0].name if ctl.recipe.learners else None
    stamp = time.time_ns()  # (a fresh key: a finished save of another run must not answer for this one)
    ctl.client.gather([
        ctl.client.submit(task_functions.save_policy, str(tmp / name if name else tmp), after=ctl.last_step,
                          trainer_id=ctl.topology.incarnations, key=f"save-policy-{stamp}-{i}", **pin)
        for i, pin in enumerate(ctl.topology.writers())])
    if out.is_dir():
        # a learner's policy saved when it was removed (a folder holding a model); the main
        # policy's own files and folders are this save's
        for kept in out.iterdir():
            if kept.is_dir() and (kept / "config.json").is_file() and not (tmp / kept.name).exists() \
                    and kept.name not in OWN_FOLDERS:
                os.replace(kept, tmp / kept.name)
        shutil.rmtree(out)
    folders.sync_tree(tmp)
    os.replace(tmp, out)
    return str(out / name if name else out)
