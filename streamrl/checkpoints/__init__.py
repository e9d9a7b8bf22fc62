"""Checkpoints, one story: the trainer's state files, read safely (``trainer_state.py``), a run's
checkpoint folders, written by the trainer's ranks and read on resume (``folders.py``), and what
a run leaves from the controller's state: a checkpoint after a step, the final policy
(``saving.py``)."""
