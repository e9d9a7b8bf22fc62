"""Checkpoints, one story: a run's checkpoint folders, written by the trainer's ranks, verified
and read on resume (``folders.py``; the trainer's own state files are ``training/trainer_state.py``), and what
a run leaves from the controller's state: a checkpoint after a step, the final policy
(``saving.py``)."""
