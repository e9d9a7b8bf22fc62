"""The elastic generate pool (``[pools.generate] elastic = { min = .., max = .. }``).

A fixed split of the generate and train sides is only right for the lengths it was planned on.
Between steps the controller asks :func:`decide` whether the trainer waited for samples while
generation used its whole pool (add a generate worker) or the rest could have generated the
step comfortably (retire one). A change goes one worker at a time through ``starting``,
``joining``, ``active`` and ``draining``, so the run never blocks on a process start, and a
worker added must pay for itself (:func:`paid`) or it is retired again. docs/architecture.md
("Elastic generate pool") has each state and the rule.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time

from distributed import Future, wait

from streamrl.cluster import pool_workers
from streamrl.on_worker import task_functions, weight_tasks
from streamrl.contracts.step_extension import StepExtension
from streamrl.on_worker.resident import ENGINE, TRANSFER
from streamrl.flow.weights import LOAD_PRIORITY
from streamrl.flow.topology import Topology
from streamrl.recipe.pools import ElasticConfig
from streamrl.recipe.recipe import Recipe
from streamrl.telemetry import bubbles

#: Steps measured with a new worker (and before it was asked for) to judge whether it paid.
PROBE_STEPS = 3

#: Steps before a worker was asked for that its gain is measured against (the step-to-step
#: spread shrinks with more; older steps describe a policy further from the current one).
BASELINE_STEPS = 6

#: Standard errors of the measured gain a worker is given the benefit of (see :func:`paid`).
PROBE_Z = 1.5

#: Seconds between checks whether a draining worker still runs a task.
RETIRE_POLL_S = 0.05

#: Seconds a draining worker that an endpoint sends requests to waits, at most, for the endpoint
#: to say it sends no more (its replica watcher looks every 2 s, and asks the endpoint's worker,
#: which may be busy, to drop it): a request sent meanwhile must be running, and counted, when
#: the worker is found idle.
SERVED_DROP_S = 60.0


def generation_busy(busy_s: float, window_s: float, generate_s: float, n: int, ahead: bool) -> float:
    """Share of the generate pool's capacity its work used while the step's generation ran.

    Where generation runs ahead of training (``async``) that is the whole step. In ``stream``
    and ``batch`` it is the step's generation window only, from the step's start to its last
    sample (``generate_s``): after it the pool waits for new weights by design (a third of a
    ``stream`` step with one worker, docs/benchmarks.md), which says nothing about whether
    generation kept up, and an idle share over the whole step never showed it saturated."""
    span = window_s if ahead or generate_s <= 0 else min(generate_s, window_s)
    return min(1.0, busy_s / (n * span)) if span > 0 and n > 0 else 0.0


def paid(before: list[float], after: list[float], min_gain: float) -> tuple[bool, float, float]:
    """Did the worker added pay? ``(paid, gain, margin)`` from tokens/s of the steps ``before``
    it was asked for and ``after`` it joined: ``gain`` is the ratio of their means less 1,
    ``margin`` ``PROBE_Z`` standard errors of that gain, estimated from the two windows' pooled
    step-to-step spread. It did not pay only when ``gain + margin < min_gain``: a worker is kept
    unless the steps show it clearly did not help (a retired worker that helped costs a process
    start and a weight load to get back, and holds the pool small for ``hold_steps``)."""
    b, a = statistics.fmean(before), statistics.fmean(after)
    gain = a / max(b, 1e-9) - 1.0
    dof = len(before) + len(after) - 2
    if dof < 1:
        return gain >= min_gain, gain, 0.0
    pooled = sum((x - b) ** 2 for x in before) + sum((x - a) ** 2 for x in after)
    rel_sd = (pooled / dof) ** 0.5 / max(b, 1e-9)
    margin = PROBE_Z * rel_sd * (1 / len(before) + 1 / len(after)) ** 0.5
    return gain + margin >= min_gain, gain, margin


def decide(gen_busy: float, train_idle: float, n: int, cfg: ElasticConfig) -> int:
    """+1 (add a generate worker), -1 (retire one) or 0, from one step's generate-pool use while
    generation ran (:func:`generation_busy`), the train pool's idle share and the pool's size ``n``.

    Grow when the trainer waited (idle above ``grow_when_train_idle``) while generation used its
    whole pool (busy at least ``1 - grow_when_generate_idle_below``); when the trainer waited and
    the pool did not, the time went elsewhere (the controller, a weight load) and more workers
    would not help. Shrink when ``n - 1`` workers would have done the same generation at most
    ``shrink_when_busy_below`` busy (``gen_busy * n / (n - 1)``): generation is then not what the
    step waits for, whatever the trainer does.
    """
    if train_idle > cfg.grow_when_train_idle and gen_busy >= 1.0 - cfg.grow_when_generate_idle_below and n < cfg.max:
        return 1
    if n > cfg.min and gen_busy * n / (n - 1) <= cfg.shrink_when_busy_below:
        return -1
    return 0


async def _offer(slots: int, dask_worker=None) -> int:
    """Runs on a worker (``client.run``): offer ``slots`` of the ``generate`` resource. With 0,
    the scheduler sends it no more generate tasks and the worker starts none of those it holds."""
    await dask_worker.set_resources(generate=slots)
    return slots


def offer_slots(topo: Topology, name: str, addr: str | None, slots: int) -> None:
    """Generate worker ``name`` (at ``addr``) offers ``slots`` generate slots now and after a
    restart by its nanny (a worker added with 0 and then given its slots came back with 0:
    groups pinned to it could never run)."""
    topo.keep_resources(name, generate=slots)
    if addr:
        topo.client.run(_offer, slots, workers=[addr], on_error="ignore")  # lost: handled as any loss


def _executing(dask_worker=None) -> int:
    """Runs on a worker (``client.run``): how many tasks it is executing now, and served requests
    it decodes (an endpoint's replica: no task carries them)."""
    return len(dask_worker.state.executing) + bubbles.served_in_flight()


def _running(client, addr: str) -> bool:
    """Does the worker at ``addr`` execute a task now? (False once it is gone.)"""
    try:
        n = client.run(_executing, workers=[addr], on_error="return").get(addr)
    except Exception:  # no such worker any more
        return False
    return isinstance(n, int) and n > 0


def _serves(client, addr: str) -> bool:
    """Is the worker at ``addr`` sent served requests (an endpoint's replica)?"""
    try:
        got = client.run(bubbles.takes_requests, workers=[addr], on_error="return").get(addr)
    except Exception:  # no such worker any more
        return False
    return got is True


class ElasticPool:
    """Grows and retires generate workers of one run; see the module docstring."""

    def __init__(self, topology: Topology, recipe: Recipe, cfg: ElasticConfig, log_level: int,
                 placed: bool, ahead: bool, publishes: bool = True):
        """``topology``: one that can grow (``Topology.can_grow``); ``placed``: a scheduler pins
        groups to workers; ``ahead``: generation runs ahead of training (``async``), so the
        generate pool's use is judged over the whole step; ``publishes``: False when the engines
        keep the starting model (a run that serves it while learners train), so a worker added
        joins with it too, not with the trainer's weights."""
        self.topo, self.recipe, self.cfg, self.log_level = topology, recipe, cfg, log_level
        self.client = topology.client
        self.placed, self.ahead, self.publishes = placed, ahead, publishes
        self.next_index = topology.next_generate_index()
        self.starting: str | None = None  # its process is coming up
        self.started_at = 0.0
        self.activated: dict[str, str] = {}  # active since this boundary: {name: address}
        self.joining: tuple[str, int, Future] | None = None  # (name, version, its weight load)
        self.pinned: dict[str, list[Future]] = {}  # tasks pinned to an active worker, not yet done
        self.draining: dict[str, threading.Thread] = {}  # each retires its worker once it ran out
        self.quiet = 0  # steps left before the next decision
        self.rates: list[float] = []  # tokens/s of every step so far
        self.baseline: list[float] = []  # tokens/s of the steps before the worker now starting was asked for
        self.probe: tuple[str, list[float], int] | None = None  # (worker added, baseline, first step with it)
        self.hold = 0  # steps left without growing (the last worker added did not pay)
        self.events: list[str] = []  # what changed since the last record
        self.gpu_slots: dict[str, int] = {}  # worker added -> its place in cuda_visible_devices (else its number)

    # -- what the controller calls --------------------------------------------------------
    def track(self, name: str, fut: Future) -> None:
        """A task pinned to generate worker ``name`` (a placed group, a weight load)."""
        self.pinned.setdefault(name, []).append(fut)

    def before_publish(self, version: int) -> None:
        """The trainer now holds ``version``, not yet published: a joined worker that holds the
        newest published one becomes active, so this publication reaches it."""
        if self.joining is None or not self.joining[2].done():
            return
        name, joined, fut = self.joining
        self.joining = None
        if fut.status != "finished":  # a worker that cannot load is reported and dropped
            self._failed(name, fut)
            return
        if joined != version - 1 and self.publishes:
            # versions were published while it joined (a model load can take several steps):
            # bring it to the trainer's weights now; its engine is built, so this is one
            # export and one load, like a publication
            self._join(name, version)
            wait([self.joining[2]])
            fut, self.joining = self.joining[2], None
            if fut.status != "finished":
                self._failed(name, fut)
                return
        addr = self.topo.address(name)
        offer_slots(self.topo, name, addr, self.recipe.pools.generate.threads)
        self.topo.add_generate(name)
        self.activated[name] = addr  # counted in the pool's accounting from the next step on
        self.probe = (name, self.baseline, len(self.rates) + 1)  # the step now ending had the old size
        self.events.append(f"+{name}")
        self.quiet = self.cfg.cooldown_steps

    def after_record(self, record, version: int) -> None:
        """At a step boundary, after its record (the trainer now holds policy ``version``): move
        the state machine on and decide."""
        # the workers the record's busy time is summed over: those accounted during the step (a
        # worker drained in it still was; one that joined is from the next step on)
        accounted = len(self.topo.pools.get("generate", {})) or len(self.topo.generate)
        for name, addr in self.activated.items():
            self.topo.account(name, addr)
        self.activated = {}
        for name, thread in list(self.draining.items()):
            if not thread.is_alive():
                del self.draining[name]
                self.topo.drop(name)
        for futs in self.pinned.values():
            futs[:] = [f for f in futs if not f.done()]
        if self.starting is not None and self.topo.address(self.starting):
            name, self.starting = self.starting, None
            self.topo.refresh_pins()
            self._join(name, version)
        elif self.starting is not None and time.time() - self.started_at > self.recipe.cluster.startup_timeout:
            self.events.append(f"!{self.starting} did not start within cluster.startup_timeout")
            self.topo.drop(self.starting)
            self.starting = None
            self._gave_up()
        self.rates.append(record.tokens_per_s)
        self.hold = max(0, self.hold - 1)
        busy = self.starting or self.joining or self.draining
        if self.quiet > 0 or busy:
            self.quiet = max(0, self.quiet - (0 if busy else 1))
            return
        if self.probe is not None:  # did the last worker added pay for itself?
            name, baseline, since = self.probe
            after = self.rates[since:]
            if len(after) < PROBE_STEPS:
                return
            self.probe = None
            ok, gain, margin = paid(baseline, after, self.cfg.min_gain)
            if not ok:
                self.hold = self.cfg.hold_steps
                self._drain(f"(tokens/s {gain:+.0%} +- {margin:.0%})")
                return
        pools = record.pools
        if "generate" not in pools or "train" not in pools:
            return
        n = len(self.topo.generate)
        busy = generation_busy(pools["generate"]["busy_s"], record.accounting_window_s, record.generate_s, accounted,
                               ahead=self.ahead)
        change = decide(busy, pools["train"]["idle_ratio"], n, self.cfg)
        # a worker asked for now would join with too few steps left to pay for its start
        left = self.recipe.run.steps - (record.step + 1)
        if change > 0 and self.hold == 0 and left > PROBE_STEPS + 1:
            self._start()
        elif change < 0:
            self._drain()

    def finish(self, timeout: float = 60.0) -> None:
        """At the end of the run: let a worker still joining or draining get there, so the
        cluster does not stop a process in the middle of loading a model."""
        if self.joining is not None:
            try:
                wait([self.joining[2]], timeout=timeout)
            except TimeoutError:  # stopped with the cluster, as it would have been anyway
                pass
        if self.starting is not None:
            deadline = time.time() + timeout
            while self.topo.address(self.starting) is None and time.time() < deadline:
                time.sleep(RETIRE_POLL_S)
        for thread in self.draining.values():
            thread.join(timeout)

    def take_events(self) -> str:
        """What changed since the last call, as ``"+generate-1 -generate-2"`` (empty: nothing)."""
        out, self.events = " ".join(self.events), []
        return out

    # -- the steps of a change ------------------------------------------------------------
    def _start(self) -> None:
        name = f"generate-{self.next_index}"
        self.next_index += 1
        # the GPUs no worker of the pool holds (names are never reused: one added after a
        # shrink wrapped onto a GPU in use while another stood idle)
        held = {self.gpu_slots.get(n, int(n.rsplit("-", 1)[1]))
                for n in [*self.topo.generate, *self.draining, *([self.joining[0]] if self.joining else [])]}
        slot = self.gpu_slots[name] = min(s for s in range(len(held) + 1) if s not in held)
        spec = pool_workers.pool_worker_spec(self.recipe, "generate", self.next_index - 1, self.log_level, slots=0,
                                             gpu_slot=slot)
        self.topo.start_worker(name, spec)
        self.starting, self.started_at = name, time.time()
        # the first step (model warm-up, empty caches) is no baseline when others exist
        self.baseline = (self.rates[1:] or self.rates)[-BASELINE_STEPS:]
        self.events.append(f"~{name}")

    def _join(self, name: str, version: int) -> None:
        client, topo = self.client, self.topo
        pin = topo.pins[name]
        tag = f"join-{name}-{time.time_ns()}"
        if version == 0 or not self.publishes:  # the base weights: build the engine and the transfer end, nothing to load
            engine = client.submit(task_functions.warm_up, ENGINE, key=f"load-engine-{tag}", pure=False, **pin)
            fut = client.submit(task_functions.warm_up, TRANSFER, after=engine, key=f"load-transfer-{tag}",
                                pure=False, **pin)
        else:
            payload = client.submit(weight_tasks.export_weights, version, trainer_id=topo.incarnations, receivers=1,
                                    key=f"export-weights-{version}-{tag}", priority=LOAD_PRIORITY,
                                    **topo.train_pin)
            wait([payload])  # exported before the next optimizer step can change the weights
            fut = client.submit(weight_tasks.load_weights, payload, version, key=f"load-weights-{version}-{tag}",
                                resend_at=topo.train_pin, priority=LOAD_PRIORITY, **pin)
        self.joining = (name, version, fut)

    def _failed(self, name: str, fut: Future) -> None:
        """A worker that could not join is reported in the record and retired; the run goes on."""
        self.events.append(f"!{name} failed to join: {type(fut.exception()).__name__}: {fut.exception()}")
        self.topo.stop_worker(name)
        self._gave_up()

    def _gave_up(self) -> None:
        # a worker that could not start or join is not asked for again at once: every step
        # would start a process and load a model, and fail the same way
        self.hold = self.cfg.hold_steps
        self.quiet = self.cfg.cooldown_steps

    def _drain(self, why: str = "") -> None:
        name = max(self.topo.generate, key=lambda n: int(n.rsplit("-", 1)[1]))  # the newest
        self.topo.remove_generate(name)
        addr = self.topo.address(name)
        if addr and not self.placed:
            # generate tasks go to any worker with a free slot: stop new ones coming here; those
            # queued here go back to the others when it retires, as soon as it runs nothing.
            # (Groups a scheduler pinned here keep their slots and run out first.)
            offer_slots(self.topo, name, addr, 0)
        # in the background: a later step may need a group queued here, so waiting for the next
        # step boundary could wait for ever
        thread = threading.Thread(target=self._retire_when_done, args=(name, addr, self.pinned.pop(name, [])),
                                  name=f"streamrl-retire-{name}", daemon=True)
        thread.start()
        self.draining[name] = thread
        self.events.append(f"-{name}" + (f" {why}" if why else ""))
        self.quiet = self.cfg.cooldown_steps

    def _retire_when_done(self, name: str, addr: str | None, pinned: list[Future]) -> None:
        """Background thread: wait for the tasks pinned to it (weight loads, placed groups) and
        for it to run nothing, then retire it gracefully (results only it holds are copied to
        another worker first; groups queued on it go to the others)."""
        client = self.client
        wait(pinned)
        deadline = time.time() + SERVED_DROP_S
        while addr and _serves(client, addr) and time.time() < deadline:
            time.sleep(0.5)
        while addr and _running(client, addr):
            time.sleep(RETIRE_POLL_S)
        client.retire_workers(names=[name], close_workers=True)


class ElasticGrowth(StepExtension):
    """The elastic generate pool as a step extension (``contracts/step_extension.py``): made once the
    residents are placed (and kept when the run starts over), it tracks every task pinned to a
    generate worker, brings a joining worker up to date before a publication, and decides at
    each step's record."""

    order = 20
    holds_boundary = True  # a joining worker is brought up to date between publication and training

    def __init__(self, cfg: ElasticConfig):
        self.cfg = cfg
        self.pool: ElasticPool | None = None

    def placed(self, context) -> None:
        """Start managing the pool (once: a run that starts over keeps the workers it has)."""
        if self.pool is None:
            level = logging.getLogger("distributed.worker").getEffectiveLevel()
            self.pool = ElasticPool(context.topology, context.recipe, self.cfg, level,
                                    placed=context.resolved.scheduler is not None, ahead=context.feeds_ahead,
                                    publishes=context.publishes)

    def pinned(self, worker: str | None, future: Future) -> None:
        """A retired worker first runs out the tasks pinned to it."""
        if worker is not None:
            self.pool.track(worker, future)

    def before_publish(self, version: int, step_future: Future) -> None:
        """A worker that has joined takes part in this publication (bringing it up to date may
        export the new weights for it alone, so the step must be done)."""
        step_future.result()
        self.pool.before_publish(version)

    def record(self, step: int, record) -> None:
        """Decide, and say in the record what changed (``elastic``)."""
        self.pool.after_record(record, record.policy_version)
        record.extra["elastic"] = self.pool.take_events()

    def finish(self, policy_dir) -> None:
        """Let a worker still joining or draining get there before the cluster stops."""
        self.pool.finish()
