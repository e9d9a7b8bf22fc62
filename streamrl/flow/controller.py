"""The controller: the loop of a run, in the ``streamrl`` process. Read this first (or, without
Dask, ``streamrl/reference.py``: the same algorithm in one process).

Per step it submits one generate task per prompt group (generate pool), one reward task per
group (reward pool), train tasks on micro-batches of scored groups (train pool), one optimizer
step, and the publication of the new weights to every generate worker. It passes *futures* from
task to task, so Dask moves samples and weights worker to worker; the controller only sees
small stats dicts. How a step overlaps with the next is the mode's business (``flow/modes.py``);
where each group runs is the dispatcher's (``scheduling/dispatch.py``).

Every mode accumulates gradients over the step's samples with the same scaling (1 / samples)
and steps once per pass, so ``batch``, ``stream`` and the reference loop give the same update.
With ``algorithm.epochs = E`` the first pass streams and E - 1 more go over the whole batch;
the weights are published after the last, so the policy version counts steps (batches).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from distributed import Client, Future, SpecCluster, as_completed, wait

from streamrl import cluster
from streamrl.api import Trainer
from streamrl.errors import UserError
from streamrl.flow import checkpoints, elastic, modes, placement, remote
from streamrl.flow.feed import Feed
from streamrl.flow.resolve import Resolved
from streamrl.flow.weights import publish, wait_loaded
from streamrl.scheduling.dispatch import Dispatcher
from streamrl.telemetry import bubbles
from streamrl.telemetry.record import summarize


def check_prompts(task: str, step: int, prompts: list, wanted: int, seen: set[str]) -> None:
    """A task must give ``wanted`` prompts with uids never used before in the run (``seen``,
    updated): samples and tasks are keyed by uid, so a repeated one would be generated once and
    trained many times."""
    if len(prompts) != wanted:
        raise UserError(f"task {task!r}: prompts(step={step}, n={wanted}) returned {len(prompts)} prompts")
    uids = [p.uid for p in prompts]
    again = sorted({u for u in uids if uids.count(u) > 1} | (set(uids) & seen))
    if again:
        raise UserError(f"task {task!r}: prompt uid {again[0]!r} repeats in step {step}; every prompt of "
                        "a run needs its own uid (e.g. f\"{step}-{i}\")")
    seen.update(uids)


class Controller:
    """Owns the run loop; see the module docstring."""

    def __init__(self, resolved: Resolved, client: Client, pools: dict[str, dict[str, str]],
                 spec_cluster: SpecCluster | None = None):
        """``spec_cluster``: the embedded cluster, which an elastic generate pool grows and shrinks."""
        r = self.recipe = resolved.recipe
        self.resolved = resolved
        self.client = client
        self.pools = pools
        self.task = resolved.task.build()
        # Work is addressed to workers by *name*: a worker its nanny restarts comes back on a new
        # address with the same name, and tasks pinned to it wait for it instead of for ever.
        self.generate_workers = {name: name for name in sorted(pools["generate"])}
        # Rank 0 of the train pool exports, checkpoints and saves the policy. With one train
        # worker every train task is pinned to it; with several, Dask gives each ready micro-batch
        # to whichever rank is free and every rank takes part in the optimizer step.
        self.train_workers = sorted(pools["train"])
        self.train_worker = self.train_workers[0]
        # The ranker lives on the rank pool, else on the first reward worker.
        self.rank_worker = sorted(pools.get("rank") or pools["reward"])[0] if resolved.ranker else None
        # ... and through a restart: tasks that must run on one worker are pinned by its resource
        self.pin = cluster.pins(client)
        self.train_pin = self.pin[self.train_worker]
        world = len(self.train_workers)
        if world > 1 and not resolved.trainer.component.declared(Trainer, "data_parallel", False):
            raise UserError(f"pools.train.workers: trainer {r.trainer.name!r} trains on one worker; "
                            f"set pools.train.workers = 1 (got {world})")
        # fsdp: the ranks hold shards, so every forward/backward is a collective (training/fsdp.py)
        self.sharded = world > 1 and r.trainer.strategy == "fsdp"
        if self.sharded and resolved.trainer.component.declared(Trainer, "shard", Trainer.shard) is Trainer.shard:
            raise UserError(f"trainer.strategy: trainer {r.trainer.name!r} cannot shard its state; "
                            "set trainer.strategy = \"ddp\"")
        self.generate_pins = {name: self.pin[name] for name in self.generate_workers}
        self.mode = modes.make(r.run.mode, r.run.max_staleness, r.run.steps)
        self.epochs = resolved.algorithm.build().epochs  # algorithms are light; built here only to ask
        self.version = 0
        self.last_step: list[Future] | None = None  # every rank's last optimizer step
        self.fed: Feed | None = None  # the next step's training, handed over early (step(feed_next=True))
        self.fed_scored: list[Future] = []  # its groups
        self.boundary: float | None = None  # when the last step's record was taken
        # a feed admits generation from its thread while this one writes the record: the
        # dispatcher (placement and lessons) and the submission counters are shared
        self.lock = threading.Lock()
        self.dispatcher: Dispatcher | None = None
        self.clock = None
        self.submit_s, self.submitted_groups = 0.0, 0  # submitting generation, since the last record
        self.elastic: elastic.ElasticPool | None = None
        cfg = r.pools.generate.elastic if r.pools.generate else None
        if cfg is not None and spec_cluster is not None:  # (benchmarks that run no steps pass none)
            level = logging.getLogger("distributed.worker").getEffectiveLevel()
            self.elastic = elastic.ElasticPool(self, spec_cluster, cfg, level)

    def place_residents(self) -> None:
        """Build the engines, trainer, reward, transfer and ranker on their workers; start the
        clocks. Calling it again starts over from the initial weights."""
        placement.place(self.client, self.resolved, self.generate_workers, self.train_worker, self.rank_worker,
                        self.sharded)
        scheduler = self.resolved.scheduler.build() if self.resolved.scheduler else None
        self.dispatcher = Dispatcher(self.client, self.generate_workers, self.recipe.trainer.samples_per_prompt,
                                     scheduler, self.rank_worker)
        self.mode = modes.make(self.recipe.run.mode, self.recipe.run.max_staleness, self.recipe.run.steps)
        self.version = 0
        self.last_step = None
        self.fed = None
        self.boundary = None
        self.seen_uids: set[str] = set()
        self.clock = bubbles.snapshot(self.client)  # busy clocks at the last step boundary
        self.join_train_group()
        # each rank's trainer incarnation: a train task that lands on a restarted rank fails
        self.trainer_ids = {
            name: self.client.submit(remote.trainer_incarnation, key=f"trainer-id-{name}-{time.time_ns()}",
                                     **self.pin[name]).result()
            for name in self.train_workers}

    def join_train_group(self) -> None:
        """Several train workers: one ``torch.distributed`` group, rendezvous at rank 0."""
        world = len(self.train_workers)
        if world == 1:  # a group left from an earlier run on this cluster would wait for peers
            self.client.submit(remote.join_train_group, 0, 1, "", 0.0, pure=False, **self.train_pin).result()
            return
        address = self.client.submit(remote.rendezvous_address, key=f"rendezvous-{time.time_ns()}",
                                     **self.train_pin).result()
        timeout = self.recipe.cluster.startup_timeout
        joins = [self.client.submit(remote.join_train_group, rank, world, address, timeout, self.recipe.trainer.strategy,
                                    pure=False, key=f"join-train-group-{name}", **self.pin[name])
                 for rank, name in enumerate(self.train_workers)]
        for f in joins:
            f.result()

    @property
    def groups_per_task(self) -> int:
        """Prompt groups per generate/reward task (``pools.generate.groups_per_task``)."""
        return self.recipe.pools.generate.groups_per_task if self.recipe.pools.generate else 1

    # -- one step -------------------------------------------------------------------------
    def submit_generation(self, step: int, min_version: int | None = None) -> list[Future]:
        """Generate + reward tasks for every prompt of ``step``; returns the futures of the scored
        bundles (lists of ``pools.generate.groups_per_task`` groups).
        ``min_version`` (default: the current one) is the policy every engine holds by now; an
        engine found older (its worker was restarted) catches up before it generates."""
        t0 = time.time()
        t = self.recipe.trainer
        min_version = self.version if min_version is None else min_version
        prompts = self.task.prompts(step, t.prompts_per_step)
        check_prompts(self.recipe.task.name, step, prompts, t.prompts_per_step, self.seen_uids)
        with self.lock:
            placed = self.dispatcher.place(step, prompts)
        # Bundles of ``groups_per_task`` prompts that go to the same place: the scheduler's
        # worker (in its order), or any generate worker.
        per_task = self.groups_per_task
        by_place: dict[str | None, list[int]] = {}
        for i in range(len(prompts)):
            by_place.setdefault(placed[i][0] if i in placed else None, []).append(i)
        scored = []
        for name, idx in by_place.items():
            for j in range(0, len(idx), per_task):
                chunk = idx[j:j + per_task]
                bundle = [prompts[i] for i in chunk]
                where: dict = {"resources": {"generate": 1}}
                priorities = [placed[i][1] if i in placed else 0.0 for i in chunk]
                if name is not None:  # pinned by the scheduler; Dask priority follows the engine's
                    where = {**cluster.at(self.pin[name], generate=1), "priority": int(max(priorities))}
                key = bundle[0].uid + (f"+{len(bundle) - 1}" if len(bundle) > 1 else "")
                gen = self.client.submit(remote.generate_groups, bundle, t.samples_per_prompt, submitted=time.time(),
                                         engine_priorities=priorities, min_version=min_version,
                                         key=f"generate-{key}", retries=1, **where)
                scored.append(self.client.submit(remote.score_groups, gen, key=f"reward-{key}",
                                                 resources={"reward": 1}, retries=1))
                if name is not None and self.elastic:  # a retired worker first runs out its groups
                    self.elastic.track(name, gen)
        with self.lock:
            self.submit_s += time.time() - t0
            self.submitted_groups += len(prompts)
        return scored

    def submit_epochs(self, step: int, scored: list[Future], total_samples: int,
                      stream: bool, after: list[Future] | None = None) -> tuple[Future, list[list[Future]]]:
        """Every pass (``algorithm.epochs``) over the step's groups: the first as the mode
        says, the others over the whole batch in submission order once it is scored. Each pass
        starts on the train workers after ``after`` (default: the last optimizer step submitted;
        ``[]``: nothing).
        Returns the last optimizer step and each pass's train tasks; :attr:`last_step` becomes
        every rank's last optimizer step."""
        after = self.last_step if after is None else after
        passes = []
        for epoch in range(self.epochs):
            after, trains = self.submit_training(step, scored, total_samples, stream and epoch == 0, epoch, after)
            passes.append(trains)
        self.last_step = after
        return after[0], passes

    def submit_training(self, step: int, scored: list[Future], total_samples: int, stream: bool,
                        epoch: int = 0, after: list[Future] | None = None) -> tuple[list[Future], list[Future]]:
        """Train tasks over the step's scored groups (after the optimizer steps ``after``), then one
        optimizer step per rank; returns those optimizer steps and the train tasks.

        ``stream=False``: the groups in submission order (all are scored). ``stream=True``: in
        completion order. Without a token budget, one train task per ``groups_per_micro_batch``
        ready groups. With ``trainer.micro_batch_tokens``, whatever is ready each time fewer than
        two train tasks are outstanding (one running, one queued), cut to the budget on the train
        worker (``flow/microbatch.py``).
        """
        t = self.recipe.trainer
        dynamic = t.micro_batch_tokens > 0
        # each scored future is a bundle of groups_per_task groups
        bundles_per_task = max(1, t.groups_per_micro_batch // self.groups_per_task)
        trains: list[Future] = []
        suffix = f"-epoch{epoch}" if epoch else ""

        world = len(self.train_workers)
        turns: dict[str, Future] = {}  # sharded: each rank's last train task (the rounds' order)

        def where() -> dict:
            # one rank: pinned to it. Several (ddp): streamed micro-batches go to any free rank; a
            # batch's, known up front, round-robin (balanced, and the same split every run).
            # Sharded: round-robin always -- rounds of one task per rank, see below
            if world == 1:
                return cluster.at(self.train_pin, train=1)
            if stream and not self.sharded:
                return {"resources": {"train": 1}}
            return cluster.at(self.pin[self.train_workers[len(trains) % world]], train=1)

        def submit(chunk):
            rank = self.train_workers[len(trains) % world]
            # sharded ranks must run their tasks in the order given, so that the k-th task of
            # every rank meets the others' k-th in its collectives: each waits for its rank's last
            later = [*(after or []), turns[rank]] if self.sharded and rank in turns else after
            trains.append(self.client.submit(
                remote.train_groups, *chunk, scale=1.0 / total_samples, micro_batch_tokens=t.micro_batch_tokens,
                groups_per_micro_batch=0 if dynamic else t.groups_per_micro_batch, after=later,
                trainer_id=self.trainer_ids, key=f"train-{step}{suffix}-{len(trains):03d}", **where()))
            turns[rank] = trains[-1]

        if not stream:
            size = -(-len(scored) // world) if dynamic else bundles_per_task
            for i in range(0, len(scored), size):
                submit(scored[i:i + size])
        else:
            ac = as_completed(scored)
            expected, seen, buf = {f.key for f in scored}, 0, []
            for fut in ac:
                if fut.key in expected:
                    buf.append(fut)
                    seen += 1
                if not buf:
                    continue
                if dynamic:
                    # hand over what is ready only when the trainer is about to run dry
                    if sum(not f.done() for f in trains) < 2 * world or seen == len(scored):
                        submit(buf)
                        buf = []
                        if seen < len(scored):
                            ac.add(trains[-1])  # wake up when it finishes
                elif len(buf) == bundles_per_task or seen == len(scored):
                    submit(buf)
                    buf = []
                if seen == len(scored):
                    break
        while self.sharded and len(trains) % world:  # the last round: the other ranks' empty turns
            submit([])
        # every rank steps, together (they sum their gradients first), after every micro-batch
        steps = [self.client.submit(remote.optimizer_step, *trains, trainer_id=self.trainer_ids,
                                    key=f"optimizer-step-{step}{suffix}" + (f"-rank{rank}" if rank else ""),
                                    **cluster.at(self.pin[name], train=1))
                 for rank, name in enumerate(self.train_workers)]
        return steps, trains

    def step(self, step: int, feed_next: bool = False) -> dict:
        """Run one full step in the recipe's mode and return its ``metrics.jsonl`` record.

        ``feed_next`` (``async`` mode): once this step's weights are published, hand the train
        pool the next step's groups (from a thread, as they are scored) before this step's
        result and bookkeeping, so the trainer goes from one step to the next without waiting
        for the controller. The caller must then run the next step before a checkpoint."""
        # A step runs boundary to boundary (what the runner does between two steps included), so
        # step times add up to the run's wall time; a fed step's training began before this call.
        t0 = self.boundary if self.boundary is not None else time.time()
        fed, self.fed = self.fed, None
        t = self.recipe.trainer
        if fed is not None and fed.step == step:
            step_fut, passes = fed.result()
            admitted = time.time()
        else:
            scored = self.mode.scored(self, step)
            admitted = time.time()
            step_fut, passes = self.submit_epochs(step, scored, t.prompts_per_step * t.samples_per_prompt,
                                                  self.mode.streams)
        trained_at: list[float] = []
        step_fut.add_done_callback(lambda _: trained_at.append(time.time()))
        version = step + 1  # one published policy per step, however many optimizer steps
        generate_workers = len(self.generate_workers)  # those that generated this step's groups
        if self.elastic:  # a worker that has joined takes part in this publication
            step_fut.result()  # (bringing it up to date may export the new weights for it alone)
            self.elastic.before_publish(version)
        # Published before the step is done: the export depends on the optimizer step and runs
        # right after it on the train worker (its priority is above any train task), without
        # waiting for the controller to hear of the step and come back.
        loads = publish(self.client, step_fut, version, self.train_pin, self.generate_pins,
                        trainer_id=self.trainer_ids)
        if self.elastic:
            for name, load in zip(self.generate_pins, loads):
                self.elastic.track(name, load)
        self.mode.published(version, loads)
        feeding = feed_next and self.mode.feeds and not self.elastic and self.mode.ahead(step + 1)
        if feeding:
            self.fed = Feed(step + 1, self._feed, step + 1, step_fut)
        step_stats = step_fut.result()
        if feeding:  # meanwhile, here: the next step's admission (it waits for the weights just published)
            self.mode.admit(self, step + 1)
        t_trained = trained_at[0] if trained_at else time.time()
        self.version = version
        if self.epochs > 1:  # how far the last pass moved from the generating policy
            last = [f.result() for f in passes[-1]]
            n = sum(m["samples"] for m in last)
            step_stats = {**step_stats, "epochs": self.epochs,
                          "last_epoch_clip_frac": sum(m.get("clip_frac_sum", 0.0) for m in last) / n,
                          "last_epoch_loss": sum(m["loss_sum"] for m in last) / n}
        # The step is done: later tasks need not depend on it. Holding it would make Dask, if the
        # train worker died, replay the whole run's lineage to recompute a result nobody needs.
        # (A fed next step holds its own optimizer steps here.)
        if self.fed is None:
            self.last_step = None
        before, self.clock = self.clock, bubbles.snapshot(self.client)
        self.boundary = self.clock[0]
        record = summarize(step, self.version, [f.result() for f in passes[0]], step_stats, t0, t_trained, self.clock[0])
        record.pools = bubbles.pool_bubbles(before, self.clock, self.pools)
        # the accounting window runs boundary to boundary, so it includes the controller's own
        # time between steps (writing metrics), which is idle time for every pool too
        record.accounting_window_s = round(self.clock[0] - before[0], 4)
        record.controller_s = round(admitted - before[0], 4)
        with self.lock:
            record.submit_s, record.submitted_groups = round(self.submit_s, 4), self.submitted_groups
            self.submit_s, self.submitted_groups = 0.0, 0
            record.extra = self.dispatcher.learn(step, record.sample_log)
        record.generate_workers = generate_workers
        if self.elastic:
            self.elastic.after_record(record)
            record.extra["elastic"] = self.elastic.take_events()
        return record.as_dict()

    def _feed(self, step: int, previous: Future) -> tuple[Future, list[list[Future]]]:
        # (in the Feed's thread) once the step before is done -- waited for here, not passed
        # as a dependency: a chain of steps each depending on the last would keep the whole
        # run's lineage in the scheduler -- the step's groups to the trainer as they are scored
        wait([previous])
        scored = self.fed_scored = self.mode.take(step)
        t = self.recipe.trainer
        return self.submit_epochs(step, scored, t.prompts_per_step * t.samples_per_prompt, True, after=[])

    # -- checkpoints ----------------------------------------------------------------------
    def checkpoint(self, run_dir: Path, next_step: int, records: int) -> Path:
        """Write a checkpoint after the last submitted optimizer step (``flow/checkpoints.py``)."""
        files = self.dispatcher.checkpoint_files(f"{next_step}-{time.time_ns()}")
        return checkpoints.write(self.client, self.writers(), self.last_step, run_dir, next_step, self.version,
                                 records, self.recipe.run.keep_checkpoints, self.trainer_ids, files=files)

    def writers(self) -> list[dict]:
        """The ranks that write checkpoints and the policy: rank 0, or every rank if sharded."""
        return [self.pin[name] for name in self.train_workers] if self.sharded else [self.train_pin]

    def resume(self, checkpoint: Path) -> int:
        """After :meth:`place_residents`: restore the trainer, put its weights on every engine
        (so nothing generates with the base weights), and continue the mode; returns the next step."""
        state = checkpoints.read(checkpoint)
        # every rank starts from the same state
        checkpoints.restore_trainer(self.client, [self.pin[name] for name in self.train_workers], checkpoint)
        self.dispatcher.restore(checkpoint)  # what was learned about lengths, ranker included
        self.version = state["policy_version"]
        wait_loaded(publish(self.client, None, self.version, self.train_pin, self.generate_pins,
                            tag=f"-resume-{time.time_ns()}", trainer_id=self.trainer_ids))
        self.mode.resume(state["next_step"], self.version)
        return state["next_step"]

    def close(self) -> None:
        """Cancel generation submitted ahead (``async``): a controller that resumes on the same
        cluster submits the same keys and must not be handed the old, stale samples."""
        self.client.cancel([f for fs in self.mode.pending() for f in fs])
        if self.fed is not None:  # the next step's generation, taken by a feed in flight
            self.client.cancel(self.fed_scored)

    def save_policy(self, out: Path) -> str:
        """Write the trained policy (after the ranker's last lesson); returns the folder."""
        self.dispatcher.finish()
        if self.elastic:
            self.elastic.finish()
        stamp = time.time_ns()  # (a fresh key: a finished save of another run must not answer for this one)
        return self.client.gather([
            self.client.submit(remote.save_policy, str(out), after=self.last_step, trainer_id=self.trainer_ids,
                               key=f"save-policy-{stamp}-{i}", **pin) for i, pin in enumerate(self.writers())])[0]
