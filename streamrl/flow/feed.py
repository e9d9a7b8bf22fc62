"""Feeding the trainer across steps (``async`` mode).

Between two steps the controller has bookkeeping to do: hear that the optimizer step finished,
wait for the new weights to reach the engines (the admission of a later step needs them), take
the busy clocks, build and write the record. On a small workload that is a fifth of a step
(docs/benchmarks.md), and the trainer -- the bottleneck -- idled through it. In ``async`` mode the next step's groups were
generated ahead, so a thread can hand them to the trainer as soon as the optimizer step is done
while the controller's own thread does the rest (``Controller.step(start_next_training=True)``).

The thread *waits* for the previous optimizer step instead of passing it to Dask as a
dependency: a chain of steps each depending on the last would keep the whole run's lineage in
the scheduler.
"""

from __future__ import annotations

import threading


class Feed:
    """A step's training submitted from a thread: its loop waits for groups to be scored and
    hands them to the train pool while the controller finishes the step before."""

    def __init__(self, step: int, submit, *args):
        self.step = step
        self._out, self._error = None, None
        # a daemon: a run that fails cancels the generation it waits on, and exits regardless
        self._thread = threading.Thread(target=self._run, args=(submit, *args), daemon=True, name=f"feed-step-{step}")
        self._thread.start()

    def _run(self, submit, *args) -> None:
        try:
            self._out = submit(*args)
        except BaseException as exc:  # raised again in the controller's thread by result()
            self._error = exc

    def result(self):
        """What the submit function returned (its exception, raised here)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._out
