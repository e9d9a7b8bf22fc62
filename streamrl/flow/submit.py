"""Submission: plain functions from a step's inputs (and futures) to the futures of its tasks.

Nothing here keeps state between calls: the topology (``flow/topology.py``) says where work
goes, the recipe how it is cut, and the futures passed in what it waits for. The controller
(``run/controller.py``) and the benchmarks call these; Dask moves the data worker to worker.

Every pass accumulates gradients over the step's samples with the same scaling (1 / samples)
and steps once, so ``batch``, ``stream`` and the reference loop give the same update. With
``algorithm.epochs = E`` the first pass streams and E - 1 more go over the whole batch.
"""

from __future__ import annotations

import time
from typing import Callable

from distributed import Future, as_completed

from streamrl.cluster import lifecycle
from streamrl.errors import UserError
from streamrl.on_worker import task_functions, weight_tasks
from streamrl.flow.topology import Topology
from streamrl.recipe.recipe import Recipe
from streamrl.sample import Prompt
from streamrl.telemetry import spans


def check_prompts(task: str, step: int, prompts: list, wanted: int, seen: set[str]) -> None:
    """A task must give ``wanted`` prompts with uids never used before in the run (``seen``,
    updated): samples and tasks are keyed by uid, so a repeated one would be generated once and
    trained many times. Each is a :class:`Prompt` whose uid is text, whose text is text and
    whose ``token_ids``, when given, are ints: what the engines and the records rely on."""
    if not isinstance(prompts, (list, tuple)):
        raise UserError(f"task {task!r}: prompts(step={step}, n={wanted}) returned {type(prompts).__name__}; "
                        "expected a list of Prompt")
    for i, p in enumerate(prompts):
        wrong = ("" if isinstance(p, Prompt) else f"is a {type(p).__name__}, not a Prompt")
        wrong = wrong or ("" if isinstance(p.uid, str) and p.uid else f"has uid {p.uid!r}; expected non-empty text")
        wrong = wrong or ("" if isinstance(p.text, str) else f"has text of type {type(p.text).__name__}; expected str")
        wrong = wrong or ("" if p.token_ids is None or (isinstance(p.token_ids, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in p.token_ids)) else
            "has token_ids that are not a list of ints")
        if wrong:
            raise UserError(f"task {task!r}: prompts(step={step}) returned a prompt at index {i} that {wrong}")
    if len(prompts) != wanted:
        raise UserError(f"task {task!r}: prompts(step={step}, n={wanted}) returned {len(prompts)} prompts")
    uids = [p.uid for p in prompts]
    again = sorted({u for u in uids if uids.count(u) > 1} | (set(uids) & seen))
    if again:
        raise UserError(f"task {task!r}: prompt uid {again[0]!r} repeats in step {step}; every prompt of "
                        "a run needs its own uid (e.g. f\"{step}-{i}\")")
    seen.update(uids)


def groups_per_task(recipe: Recipe) -> int:
    """Prompt groups per generate/reward task (``pools.generate.groups_per_task``)."""
    return recipe.pools.generate.groups_per_task if recipe.pools.generate else 1


def samples_per_step(recipe: Recipe) -> int:
    """Samples a step trains on (every pass's gradients are scaled by one over this)."""
    return recipe.trainer.prompts_per_step * recipe.trainer.samples_per_prompt


#: A scheduler's placement of one prompt group: ``(worker, priority, samples)`` per piece
#: (``samples`` empty: the whole group), one piece unless the group was split into chunks.
Pieces = list[tuple[str, float, tuple[int, ...]]]


def generation(topo: Topology, recipe: Recipe, step: int, prompts: list[Prompt],
               placed: dict[int, Pieces], min_version: int,
               on_generate: Callable[[str | None, Future], None] | None = None, movable: bool = False) -> list[Future]:
    """Generate + reward tasks for step ``step``'s ``prompts`` (``placed``: a scheduler's
    ``{index: pieces}``, else empty); returns the futures of the scored bundles (lists of
    ``groups_per_task`` groups; a group split into chunks is a bundle of its own, joined by its
    reward task). ``min_version`` is the policy every engine holds by now; an engine found older
    (its worker was restarted) catches up before it generates. ``on_generate(worker, future)``
    hears of each generate task (``worker``: the one a scheduler pinned it to, else None).
    ``movable``: the scheduler moves running samples, so chunks are generated to let them go."""
    client, n = topo.client, recipe.trainer.samples_per_prompt
    # Bundles of groups_per_task prompts that go to the same place: the scheduler's worker (in
    # its order), or any generate worker.
    per_task = groups_per_task(recipe)
    by_place: dict[str | None, list[int]] = {}
    scored = []
    for i in range(len(prompts)):
        pieces = placed.get(i)
        if pieces and (len(pieces) > 1 or pieces[0][2]):
            scored.append(chunked(topo, step, prompts[i], pieces, min_version, on_generate, movable))
            continue
        by_place.setdefault(pieces[0][0] if pieces else None, []).append(i)
    whole = {i: (p[0][0], p[0][1]) for i, p in placed.items() if p}
    for name, idx in by_place.items():
        for j in range(0, len(idx), per_task):
            chunk = idx[j:j + per_task]
            bundle = [prompts[i] for i in chunk]
            where: dict = {"resources": {"generate": 1}}
            priorities = [whole[i][1] if i in whole else 0.0 for i in chunk]
            if name is not None:  # pinned by the scheduler; Dask priority follows the engine's
                where = {**lifecycle.with_resources(topo.pins[name], generate=1),
                         "priority": dask_priority(max(priorities))}
            key = bundle[0].uid + (f"+{len(bundle) - 1}" if len(bundle) > 1 else "")
            with spans.phase(step, "generate"):
                gen = client.submit(task_functions.generate_groups, bundle, n, submitted=time.time(),
                                    engine_priorities=priorities, min_version=min_version,
                                    key=spans.step_key("generate", step, key), retries=1, **where)
            with spans.phase(step, "reward"):
                scored.append(client.submit(task_functions.score_groups, gen, key=spans.step_key("reward", step, key),
                                            resources={"reward": 1}, retries=1))
            if on_generate is not None:
                on_generate(name, gen)
    return scored


#: Largest Dask priority :func:`dask_priority` hands on: below a weight load's, which must go
#: ahead of generation on a worker whose threads are all busy (a length estimate can be any size),
#: and below a moved sample's continuation (``LOAD_PRIORITY - 1``), which has waited long enough.
DASK_PRIORITY_LIMIT = weight_tasks.LOAD_PRIORITY - 2


def dask_priority(priority: float) -> int:
    """A scheduler's priority as Dask takes it: an integer, clamped to
    :data:`DASK_PRIORITY_LIMIT`. A length estimate can be any size (infinity: first of all), and
    Dask sends a task's priority negated to its worker, where one outside 64 bits does not
    serialize and the task never runs; above a weight load's it would queue the load behind it.
    The engine still gets the exact priority to order its queue."""
    return int(max(-DASK_PRIORITY_LIMIT, min(DASK_PRIORITY_LIMIT, priority)))


def chunked(topo: Topology, step: int, prompt: Prompt, pieces: Pieces, min_version: int,
            on_generate: Callable[[str | None, Future], None] | None, movable: bool = False) -> Future:
    """One group split into chunks: a generate task per chunk, pinned to its worker, and one
    reward task that joins them (each sample once) and scores the group; returns its future."""
    client, gens = topo.client, []
    for worker, priority, samples in pieces:
        where = {**lifecycle.with_resources(topo.pins[worker], generate=1), "priority": dask_priority(priority)}
        with spans.phase(step, "generate"):
            gen = client.submit(task_functions.generate_chunk, prompt, list(samples), submitted=time.time(),
                                engine_priority=priority, min_version=min_version, movable=movable,
                                key=spans.step_key("generate", step, f"{prompt.uid}:{samples[0]}"), retries=1, **where)
        gens.append(gen)
        if on_generate is not None:
            on_generate(worker, gen)
    with spans.phase(step, "reward"):
        return client.submit(task_functions.score_chunks, *gens, key=spans.step_key("reward", step, prompt.uid),
                             resources={"reward": 1}, retries=1)


def epochs(topo: Topology, recipe: Recipe, passes: int, step: int, scored: list[Future], stream: bool,
           after: list[Future] | None, samples: int | None = None,
           ordered: bool = False) -> tuple[list[Future], list[list[Future]]]:
    """``passes`` passes over the step's groups (``algorithm.epochs``): the first as the mode
    says (``stream``), the others over the whole batch once it is scored, each after the last.
    Returns every rank's last optimizer step and each pass's train tasks.

    On one rank the later passes take the groups in submission order. On several, every pass
    trains the first pass's micro-batches (in its order) on the same ranks: what the first pass kept of a group (its advantages, a critic's values: see
    ``training/backward_pass.FirstPass``) is held by the rank that trained it, and a group
    another rank met anew in a later pass was counted again by a running normaliser and had its
    value clip bounded around the wrong values."""
    runs, chunks = [], None
    several = passes > 1 and len(topo.train) > 1
    for epoch in range(passes):
        after, trains, made = training(topo, recipe, step, scored, stream and epoch == 0, epoch, after, samples,
                                       ordered, chunks=chunks, keep_places=several)
        chunks = made if several else None
        runs.append(trains)
    return after, runs


def training(topo: Topology, recipe: Recipe, step: int, scored: list[Future], stream: bool,
             epoch: int = 0, after: list[Future] | None = None, samples: int | None = None,
             ordered: bool = False, chunks: list[list[Future]] | None = None,
             keep_places: bool = False) -> tuple[list[Future], list[Future], list[list[Future]]]:
    """Train tasks over the step's scored groups (after the optimizer steps ``after``), then one
    optimizer step per rank; returns those optimizer steps, the train tasks and the chunks of
    scored futures each task was given. Gradients are averaged over ``samples`` (default: the
    recipe's samples per step).

    ``chunks``: train exactly these, in this order, round-robin over the ranks (a later pass
    over a step: the first pass's chunks, on the ranks that trained them). ``keep_places``: place
    every chunk round-robin, even streamed, so that a later pass can find it again.

    ``stream=False``: the groups in submission order (all are scored). ``stream=True``: in
    completion order. Without a token budget, one train task per ``groups_per_micro_batch``
    ready groups. With ``trainer.micro_batch_tokens``, whatever is ready each time fewer than
    two train tasks per rank are outstanding (one running, one queued), cut to the budget on the
    train worker (``on_worker/microbatch.py``).

    ``ordered=True`` (a repeatable run): the same micro-batches in the same order every run,
    whatever the timing -- fixed chunks of groups in submission order, round-robin over the
    ranks, each rank's task after its last. Training still starts as soon as the first chunk is
    scored, but a late group holds back the chunks after it.
    """
    client, t = topo.client, recipe.trainer
    dynamic = t.micro_batch_tokens > 0
    # each scored future is a bundle of groups_per_task groups
    bundles_per_task = max(1, t.groups_per_micro_batch // groups_per_task(recipe))
    scale = 1.0 / (samples or samples_per_step(recipe))
    trains: list[Future] = []
    suffix = f"epoch{epoch}-" if epoch else ""
    ranks, sharded = topo.train, topo.sharded
    world = len(ranks)
    # a learner's own worker (``learners/fanout.py``) offers its own resource and holds its
    # trainer under its own name; its keys say whose they are
    res, held, tag = topo.train_resource, topo.trainer_resident, topo.key_tag
    chained = sharded or ordered  # each rank runs its tasks in the order given
    pinned = chained or keep_places  # each task on the rank round-robin names
    given: list[list[Future]] = []  # each train task's chunk of scored futures
    turns: dict[str, Future] = {}  # chained: each rank's last train task (the rounds' order)

    def where() -> dict:
        # one rank: pinned to it. Several (ddp): streamed micro-batches go to any free rank; a
        # batch's, known up front, round-robin (balanced, and the same split every run).
        # Sharded: round-robin always -- rounds of one task per rank, see below
        if world == 1:
            return lifecycle.with_resources(topo.train_pin, **{res: 1})
        if stream and not pinned:
            return {"resources": {res: 1}}
        return lifecycle.with_resources(topo.pins[ranks[len(trains) % world]], **{res: 1})

    def submit(chunk):
        rank = ranks[len(trains) % world]
        # sharded ranks must run their tasks in the order given, so that the k-th task of
        # every rank meets the others' k-th in its collectives: each waits for its rank's last
        later = [*(after or []), turns[rank]] if chained and rank in turns else after
        with spans.phase(step, "train"):
            trains.append(client.submit(
                task_functions.train_groups, *chunk, scale=scale, micro_batch_tokens=t.micro_batch_tokens,
                groups_per_micro_batch=0 if dynamic else t.groups_per_micro_batch, after=later,
                trainer_id=topo.incarnations, trainer=held,
                key=spans.step_key(f"train{tag}", step, f"{suffix}{len(trains):03d}"), **where()))
        turns[rank] = trains[-1]
        given.append(list(chunk))

    if chunks is not None:
        for chunk in chunks:
            submit(chunk)
    elif not stream or ordered:
        size = -(-len(scored) // world) if dynamic and not ordered else bundles_per_task
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
    while sharded and len(trains) % world and chunks is None:  # the last round: the other ranks' empty turns
        submit([])
    # every rank steps, together (they sum their gradients first), after every micro-batch
    with spans.phase(step, "train"):
        steps = [client.submit(task_functions.optimizer_step, *trains, trainer_id=topo.incarnations, trainer=held,
                               step=step,
                               key=spans.step_key(f"optimizer-step{tag}", step, f"{suffix}rank{rank}"),
                               **lifecycle.with_resources(topo.pins[name], **{res: 1}))
                 for rank, name in enumerate(ranks)]
    return steps, trains, given
