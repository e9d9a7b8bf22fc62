"""What a run leaves behind, written from the controller's state: a checkpoint of the whole run
after a step (``checkpoints/folders.py`` writes and reads the files) and, at the end, the trained
policy as a model folder. Kept apart from the step loop (``run/controller.py``), which only
says when."""

from __future__ import annotations

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


def policy(ctl, out: Path) -> str:
    """Write the trained policy of ``ctl`` to ``out`` (after the ranker's last lesson and the
    step extensions' finish: the elastic pool's last change, the side learners' policies in
    ``out/<name>``); returns the folder: ``out``, or ``out/<main learner>`` when the recipe has
    ``[[learners]]``."""
    ctl.dispatcher.finish()
    ctl.finish(out)
    out = out / ctl.resolved.learners[0].name if ctl.recipe.learners else out
    stamp = time.time_ns()  # (a fresh key: a finished save of another run must not answer for this one)
    return ctl.client.gather([
        ctl.client.submit(task_functions.save_policy, str(out), after=ctl.last_step,
                          trainer_id=ctl.topology.incarnations, key=f"save-policy-{stamp}-{i}", **pin)
        for i, pin in enumerate(ctl.topology.writers())])[0]
