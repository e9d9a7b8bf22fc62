"""The run modes (``run.mode``), each a small strategy over the same step loop.

A mode answers two questions per step: which scored-group futures the step trains on (and
whether the trainer may start before all are scored), and what to do with the weight loads of
the new version (wait for them, or let them overlap the next step).

* ``batch``     -- generate the step's groups, wait until all are scored, then train.
* ``colocated`` -- the same stage order; the train workers also hold an engine and take generate
  tasks (``cluster/pool_workers.worker_spec``), so every worker generates, then trains (the verl-like baseline).
* ``stream``    -- train each scored group as soon as it is ready (StreamRL); wait for the loads.
* ``async``     -- as ``stream``, and generation of later steps is admitted while the trainer
  trains, at most ``run.max_staleness`` versions behind (``flow/admission.py``); loads overlap.
"""

from __future__ import annotations

from typing import Callable

from distributed import Future, wait

from streamrl.flow import admission
from streamrl.flow.weights import wait_loaded

#: What a mode calls to submit a step's generation: ``generate(step, min_version)`` returns the
#: futures of its scored groups (``min_version`` None: the policy the engines hold now).
Generate = Callable[[int, "int | None"], list[Future]]


class Batch:
    """Generate all, then train; weights loaded before the next step."""

    streams = False
    """True: micro-batches are cut in completion order while generation goes on."""
    feeds = False
    """True: the next step's groups may be submitted before a step ends (:meth:`ahead`), so the
    controller can hand them to the trainer before its own bookkeeping
    (``Controller.step(start_next_training=True)``)."""

    def scored(self, generate: Generate, step: int) -> list[Future]:
        """The step's scored groups."""
        scored = generate(step, None)
        wait(scored)  # the trainer sees nothing until the whole batch is scored
        return scored

    def published(self, version: int, loads: list[Future]) -> None:
        """The new version's weight loads were submitted."""
        wait_loaded(loads)

    def resume(self, step: int, version: int) -> None:
        """A resumed run starts at ``step``; every engine already holds ``version``."""

    def pending(self) -> list[list[Future]]:
        """Scored-group futures submitted for steps not yet trained."""
        return []


class Stream(Batch):
    """Train groups as they are scored; weights loaded before the next step."""

    streams = True

    def scored(self, generate: Generate, step: int) -> list[Future]:
        return generate(step, None)


class Async(Stream):
    """Generation runs up to ``max_staleness`` steps ahead; weight loads overlap training.

    Admission control: at the start of training step ``s`` submit the generation of the steps
    ``s .. s + k`` not yet submitted, after waiting for the weight loads the staleness bound
    requires (only those). Generation is paced, never dropped.
    """

    feeds = True

    def __init__(self, max_staleness: int, last_step: int):
        self.k, self.last_step = max_staleness, last_step
        self.in_flight: dict[int, list[Future]] = {}  # scored futures of admitted steps
        self.loads: dict[int, list[Future]] = {}  # weight loads not yet awaited, by version
        self.loaded_version = 0
        self.next_to_admit = 0

    def scored(self, generate: Generate, step: int) -> list[Future]:
        self.admit(generate, step)
        return self.take(step)

    def admit(self, generate: Generate, step: int) -> None:
        """Admission at the start of training ``step``: wait for the loads the bound requires,
        then submit generation of the window ``step .. step + k``."""
        p = admission.plan(step, self.k, self.last_step, self.next_to_admit, self.loaded_version)
        for v in range(self.loaded_version + 1, p.wait_for_version + 1):
            wait_loaded(self.loads.pop(v))
        self.loaded_version = max(self.loaded_version, p.wait_for_version)
        for g in p.admit:
            self.in_flight[g] = generate(g, self.loaded_version)
            self.next_to_admit = g + 1

    def ahead(self, step: int) -> bool:
        """Whether ``step``'s generation is already submitted (so its training can be fed)."""
        return step in self.in_flight

    def take(self, step: int) -> list[Future]:
        """The scored futures of an admitted ``step``, now the trainer's."""
        return self.in_flight.pop(step)

    def published(self, version: int, loads: list[Future]) -> None:
        self.loads[version] = loads  # awaited by scored() when the bound requires

    def resume(self, step: int, version: int) -> None:
        # nothing was generated ahead: admission starts over at the resumed step
        self.next_to_admit, self.loaded_version = step, version

    def pending(self) -> list[list[Future]]:
        return list(self.in_flight.values())


def make(mode: str, max_staleness: int, steps: int) -> Batch:
    """The strategy for ``run.mode``."""
    if mode == "async":
        return Async(max_staleness, steps - 1)
    return {"batch": Batch, "colocated": Batch, "stream": Stream}[mode]()
