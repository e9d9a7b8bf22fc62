"""Running samples moved between generate workers, for a scheduler that ``moves_samples``.

A sample's instance is fixed when its chunk is placed; the ``longtail`` scheduler may later want
a straggler -- far past its group's estimate, on an instance that will finish well after
another -- to go on where there is room. This extension is the scheduler's eyes and hands in a
run: a thread in the ``streamrl`` process asks every generate worker what its engine decodes
(``Client.run``: an answer from the worker's event loop, not a task, as every task slot may be
waiting on the engine), hands that to :meth:`Scheduler.moves`, and tells the source worker to take
each chosen sample out. The chunk task there hands the sample, its tokens so far, to a task on
the target worker, which re-prefills and finishes it; the chunk returns it finished, so the
reward and the trainer see one whole sample, once (``on_worker/task_functions.generate_chunk``).

A look that fails (a worker gone, a scheduler that raised) is skipped and said once: moves only
speed generation up, and every sample finishes where it is without them. A look waits at most
:data:`LOOK_TIMEOUT_S` for the workers.
"""

from __future__ import annotations

import numbers
import threading
import time
import warnings
from pathlib import Path

from streamrl.cluster import pool_workers
from streamrl.errors import RunWarning
from streamrl.contracts.step_extension import StepExtension
from streamrl.on_worker import move_tasks


#: Seconds a look, or a move, may wait for the workers' answers. A worker killed since the last look
#: never answers at its old address (the scheduler's broadcast would wait for the connection for
#: long); the look is given up, the workers' addresses asked again, and the next look goes on.
LOOK_TIMEOUT_S = 5.0


class SampleMoves(StepExtension):
    """The mover of the module's docstring; idle unless the run's scheduler ``moves_samples``."""

    order = 50

    def __init__(self):
        self.context = None
        self.thread: threading.Thread | None = None
        self.stop = threading.Event()
        self.looks = 0
        """Looks at the engines so far."""
        self.moved = 0
        """Samples taken out of their instance so far."""
        self.look_s = 0.0
        """Seconds spent looking and moving, in all."""
        self.warned = False
        self.recorded = (0, 0, 0.0)  # (moved, looks, look_s) at the last record
        self.address: dict[str, str] = {}  # generate worker name -> address, kept between looks

    def placed(self, context) -> None:
        """Start looking when the scheduler moves samples."""
        scheduler = context.scheduler
        if scheduler is None or not getattr(scheduler, "moves_samples", False) or self.thread is not None:
            return
        # (an engine that cannot hand a sample over was refused when the recipe was resolved)
        self.context = context
        self.every = float(getattr(getattr(scheduler, "config", None), "move_every_s", 0.25))
        self.thread = threading.Thread(target=self._loop, name="streamrl-sample-moves", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.wait(self.every):
            start = time.perf_counter()
            try:
                self.look()
            except Exception as exc:  # noqa: BLE001 -- a look that fails moves nothing; samples finish where they are
                self.address = {}  # (a worker lost: the next look asks where the workers are now)
                if not self.warned and not self.stop.is_set():
                    self.warned = True
                    warnings.warn(f"sample moves: a look at the engines failed ({type(exc).__name__}: {exc}); "
                                  "samples finish where they are until a look succeeds", RunWarning, stacklevel=1)
            self.look_s += time.perf_counter() - start

    def look(self) -> int:
        """One look: what every engine decodes, the scheduler's moves, each carried out; returns
        how many samples left their instance."""
        run = self.context
        names = list(run.topology.generate)
        address = self.address
        if any(n not in address for n in names):  # a new or restarted worker: ask the scheduler again
            address = self.address = {str(info.get("name", addr)): addr
                                      for addr, info in pool_workers.workers(run.client).items()}
        live = [address[n] for n in names if n in address]
        answers = (run.client.run(move_tasks.requests_now, workers=live, on_error="return",
                                  callback_timeout=LOOK_TIMEOUT_S) if live else {})
        seen = [answers.get(address.get(n)) for n in names]
        if any(isinstance(s, BaseException) for s in seen):
            self.address = {}  # (a worker gone from its address: the next look asks where it is now)
        seen = [s if s is not None and not isinstance(s, BaseException) else None for s in seen]
        self.looks += 1
        moved = 0
        for move in run.scheduler.moves(seen):
            uid, source, target = self._checked(move, len(names))
            # (a target that did not answer the look is gone, restarting or stuck: a sample sent
            # there waits on it, and its step with it)
            if source == target or seen[source] is None or seen[target] is None or names[target] not in run.topology.pins:
                continue
            taken = run.client.run(move_tasks.move_sample, uid, run.topology.pins[names[target]],
                                   workers=[address[names[source]]], on_error="return", callback_timeout=LOOK_TIMEOUT_S)
            moved += taken.get(address[names[source]]) is True
        self.moved += moved
        return moved

    @staticmethod
    def _checked(move, workers: int) -> tuple[str, int, int]:
        """A scheduler's move as ``(sample uid, source, target)``, the two indices in
        ``range(workers)`` (a negative one would wrap round to another worker); ``ValueError``
        naming the move otherwise (the look fails, said once, and samples finish where they are)."""
        try:
            uid, source, target = move
        except (TypeError, ValueError):
            raise ValueError(f"the scheduler's moves() gave {move!r}; expected (sample uid, source index, "
                             "target index)") from None
        for index in (source, target):
            if isinstance(index, bool) or not isinstance(index, numbers.Integral) or not 0 <= index < workers:
                raise ValueError(f"the scheduler's moves() gave worker index {index!r} in {move!r}; expected "
                                 f"0..{workers - 1} (positions in the list of engines it was given)")
        return str(uid), int(source), int(target)

    def record(self, step: int, record) -> None:
        """Since the last record, when the run moves samples: ``moves/moved`` (samples taken
        out of their instance), ``moves/looks`` and ``moves/look_s`` (the mover's own cost)."""
        if self.thread is None:
            return
        now = (self.moved, self.looks, self.look_s)
        before, self.recorded = self.recorded, now
        record.extra.update({"moves/moved": now[0] - before[0], "moves/looks": now[1] - before[1],
                             "moves/look_s": round(now[2] - before[2], 3)})

    def stopping(self) -> None:
        """Stop looking: the step ends with what it has."""
        self.stop.set()

    def finish(self, policy_dir: Path) -> None:
        """The last step is done: nothing is left to move, and a look must not meet the workers
        as the cluster stops."""
        self.close()

    def close(self) -> None:
        """Stop the thread."""
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=5)
