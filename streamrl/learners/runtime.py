"""What the controller asks of the side learners: place them, record them, checkpoint, resume
and save them. The controller holds a :class:`~streamrl.learners.fanout.Fanout` (None for a run
with one learner) and calls these at the points of its loop where the main learner does the same.

A checkpoint waits for every side learner's queued steps first (``Fanout.drain``), so each has
trained every step before the checkpoint's (or skipped it, counted): a resumed run hands them the
next step, and nothing is trained twice or lost for them. Their states sit in the checkpoint's
folder, ``learners/<name>/`` and ``learners.json``, under the same manifest.
"""

from __future__ import annotations

import json
import shutil
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

from distributed import Client, Future

from streamrl.errors import RunWarning, UserError
from streamrl.on_worker import task_functions
from streamrl.flow.placement import trainer_context
from streamrl.on_worker.resident import Resident, ResidentLost
from streamrl.cluster.pool_workers import LEARN
from streamrl.learners import evaluate
from streamrl.plugins.resolve import LearnerPlan
from streamrl.recipe.recipe import Recipe
from streamrl.learners.fanout import LOOK_EVERY_S, Fanout, LearnerView, SideLearner
from streamrl.telemetry.text import error_line

STATE = "learners.json"


@dataclass
class Placing:
    """A side learner whose trainer is being built on its worker (:func:`begin_place`)."""

    plan: LearnerPlan
    view: LearnerView
    incarnation: Future
    epochs: int
    joined_at: int
    make_evaluator: object


def begin_place(client: Client, recipe: Recipe, plan: LearnerPlan, trainer_context, pins: dict[str, dict],
                joined_at: int = 0, make_evaluator=None) -> Placing:
    """Register the learner's trainer as a resident and start building it on its worker (the
    model loads there now); :func:`finish_place` waits for it. Several learners, and the rest of
    the run's placement, build at the same time: built one after another, each waited ~4 s
    (mostly its worker importing torch and transformers) and two learners added ~8 s to the
    start of a run. ``trainer_context``: ``flow/placement.trainer_context``'s for this learner's
    algorithm. One line naming the worker when it is not in the cluster."""
    if plan.worker not in pins:
        threads = recipe.pools.train.threads if recipe.pools.train else 1
        raise UserError(f"learners: learner {plan.name!r} trains on a worker named {plan.worker!r}, and the cluster "
                        f"has none; start one with: dask worker {client.scheduler.address} --name {plan.worker} "
                        f"--nthreads {threads} --resources \"{LEARN}={threads}\"")
    from functools import partial

    threads = recipe.pools.train.torch_threads if recipe.pools.train else 1
    client.register_plugin(Resident(plan.resident, partial(plan.trainer.build, trainer_context), torch_threads=threads,
                                    seed=recipe.run.seed, what=f"learner {plan.name!r}'s trainer"))
    view = LearnerView(client, plan, pins)
    built = client.submit(task_functions.trainer_incarnation, plan.resident,
                          key=f"trainer-id-{plan.name}-{time.time_ns()}",
                          **view.train_pin)
    return Placing(plan, view, built, trainer_context.algorithm.epochs, joined_at, make_evaluator)


def finish_place(placing: Placing) -> SideLearner:
    """Wait for the learner's trainer (:func:`begin_place`), read its incarnation, and start its
    evaluation (the starting policy first) when the run has ``[eval]``."""
    plan, view = placing.plan, placing.view
    view.incarnations = {plan.worker: placing.incarnation.result()}
    learner = SideLearner(plan, view, epochs=placing.epochs, joined_at=placing.joined_at)
    if placing.make_evaluator is not None:  # ``learners/evaluate.py``
        learner.evaluator = placing.make_evaluator(plan, view.train_pin, view.incarnations)
        learner.evaluate(0)
    return learner


def begin(client: Client, resolved, pins: dict[str, dict], task=None) -> list[Placing]:
    """Start building the recipe's side learners (``resolved.side_learners``) on their workers,
    all at once; :func:`start` waits for them. ``task``: the run's built task (its held-out
    prompts)."""
    return [begin_one(client, resolved, plan, pins, task=task) for plan in resolved.side_learners]


def start(client: Client, resolved, repeatable: bool, placing: list[Placing], task=None) -> Fanout | None:
    """The run's side learners, placed (:func:`begin`); None when the run has one learner."""
    if not placing:
        return None
    fanout = Fanout(client, resolved.recipe, [], repeatable)
    fanout.task = task
    for p in placing:
        fanout.add(finish_place(p))
    return fanout


def begin_one(client: Client, resolved, plan: LearnerPlan, pins: dict[str, dict], joined_at: int = 0,
              task=None, model_path: str | None = None) -> Placing:
    """Start building one side learner's trainer on its worker (and, with ``[eval]``, its
    evaluation engine once placed) from the recipe's model, or from ``model_path`` (a policy
    saved during the run)."""
    greedy = resolved.engine.capabilities().greedy

    def make_evaluator(plan: LearnerPlan, pin: dict, trainer_id: dict):
        return evaluate.evaluator(client, resolved, task, plan.name, plan.resident, pin, LEARN, greedy, trainer_id)

    context = trainer_context(resolved, algorithm=plan.algorithm, model_path=model_path,
                              # (added while running: it may start from a policy saved then, so it
                              # shares no base and publishes merged weights, which every engine loads)
                              learner="" if plan.added else plan.name)
    if plan.added:
        context = replace(context, engine=replace(context.engine, adapters=0))
    return begin_place(client, resolved.recipe, plan, context, pins, joined_at,
                       make_evaluator if task is not None and resolved.recipe.eval is not None else None)


def place_one(client: Client, resolved, plan: LearnerPlan, pins: dict[str, dict], joined_at: int = 0,
              task=None, model_path: str | None = None) -> SideLearner:
    """Build one side learner on its worker and wait for it (:func:`begin_one`)."""
    return finish_place(begin_one(client, resolved, plan, pins, joined_at, task, model_path))


def ensure_worker(client: Client, topo, recipe, worker: str) -> None:
    """A learner's worker (``learner-<...>``, :attr:`LearnerPlan.worker`) is up: the embedded
    cluster starts it when it is not (a learner added during the run, on a resume; a worker
    learners share is started once); ``topo.pins`` is brought up to date either way."""
    from streamrl.cluster import lifecycle
    from streamrl.cluster.pool_workers import learner_worker_spec

    up = lifecycle.worker_pins(client)  # (the topology's pins keep workers that have left)
    if worker not in up and topo.can_grow:
        topo.start_worker(worker, learner_worker_spec(recipe, worker.removeprefix("learner-")))
        deadline = time.time() + recipe.cluster.startup_timeout
        while worker not in up and time.time() < deadline:
            time.sleep(0.2)
            up = lifecycle.worker_pins(client)
    topo.pins.update(up)
    if worker not in up:
        topo.pins.pop(worker, None)  # (place() then says how to start it)


def record(fanout: Fanout, resolved, step_record) -> dict[str, dict]:
    """``metrics.jsonl``'s ``learners``: every learner's figures by name, the main one's from
    this step's record (it trained on this step), the side learners' from their last finished
    step (they may lag by their queue)."""
    main = resolved.learners[0]
    evaluated = {k: v for k, v in step_record.extra.items() if k.startswith("eval/")}
    out = {main.name: {"state": "training", "served": main.served, "worker": "train pool",
                       "algorithm": main.algorithm.component.name, "steps_trained": step_record.step + 1,
                       "step": step_record.step, "policy_version": step_record.policy_version,
                       "reward_mean": step_record.reward_mean, "loss": step_record.loss,
                       "grad_norm": step_record.grad_norm, **evaluated}}
    out.update(fanout.harvest())
    return out


def _saved(fanout: Fanout, lr, saving, step: int) -> bool:
    """Wait for side learner ``lr``'s save as long as its worker is up (a large learner on a slow
    disk takes what it takes; the checkpoint's own deadline is the backstop); False when its
    worker was gone for good meanwhile (:meth:`Fanout.look` failed it)."""
    while True:
        try:
            saving.result(timeout=LOOK_EVERY_S)
            return True
        except TimeoutError:
            fanout.look(step)
            if lr.state != "training":
                fanout.client.cancel([saving])
                return False


def checkpoint(fanout: Fanout, next_step: int, previous: Path | None):
    """The ``also`` of ``checkpoints.write``: each side learner's trainer into
    ``learners/<name>/`` and their states into ``learners.json``. A learner that failed keeps the
    state of the checkpoint before (``previous``), when it had one there."""
    def write(folder: Path) -> None:
        fanout.drain()
        states = {}
        for lr in fanout.learners.values():
            target = folder / "learners" / lr.name
            target.parent.mkdir(exist_ok=True)
            saved = False
            if lr.state == "training":
                try:
                    # (after its queued steps: a drain that timed out leaves some, and a save
                    # between two of them, or during one, is a state no resume should start from)
                    queued = lr.inflight[-1].last if lr.inflight else None
                    saving = fanout.client.submit(task_functions.save_trainer_checkpoint, str(target), after=queued,
                                                  trainer=lr.plan.resident, trainer_id=lr.view.incarnations,
                                                  pure=False, **lr.view.train_pin)
                    saved = _saved(fanout, lr, saving, next_step - 1)
                    if not saved:  # (its worker gone for good: failed by the look, the save let go)
                        shutil.rmtree(target, ignore_errors=True)
                    else:  # the steps it waited for are in the state saved: read, so its counts say so
                        fanout._harvest(lr)
                except OSError:  # (the run's folder full, the scheduler gone: the checkpoint's failure, said so)
                    raise
                except Exception as exc:  # noqa: BLE001 -- its worker restarted since its last step
                    # (ResidentLost), or its own save failed (its GPU out of memory, a plugin trainer's
                    # bug): that learner's loss, not the run's checkpoint's
                    fanout.fail(lr, next_step - 1, exc)
                    shutil.rmtree(target, ignore_errors=True)
            if not saved and previous is not None and (previous / "learners" / lr.name).is_dir():
                shutil.copytree(previous / "learners" / lr.name, target)
                saved = True
            summary = lr.summary()
            if saved and lr.state != "training":  # (the state copied is the one before: so are its counts)
                summary = {**summary, **_counts(_saved_summary(previous, lr.name))}
            states[lr.name] = {"table": lr.plan.table, "summary": summary, "has_state": saved,
                               "added": bool(lr.plan.added), "start": lr.start}
        (folder / STATE).write_text(json.dumps({"next_step": next_step, "learners": states}, indent=1))
    return write


#: The counts of a learner that go with its trainer's state (a resume from that state restores them).
COUNTS = ("steps_trained", "skipped_steps", "samples_trained", "last_step")


def _saved_summary(checkpoint: Path | None, name: str) -> dict:
    """Learner ``name``'s summary in ``checkpoint``'s ``learners.json`` ({} without one)."""
    path = checkpoint / STATE if checkpoint is not None else None
    if path is None or not path.exists():
        return {}
    entry = json.loads(path.read_text())["learners"].get(name)
    return entry["summary"] if entry else {}


def _counts(summary: dict) -> dict:
    return {k: summary[k] for k in COUNTS if k in summary}


def saved_counts(checkpoint: Path, name: str) -> dict:
    """The counts of learner ``name`` that go with its state in ``checkpoint``."""
    return _counts(_saved_summary(checkpoint, name))


def started_from(entry: dict, run_dir: Path) -> dict:
    """``place_one``'s ``model_path`` for a checkpoint's learner (its ``learners.json`` entry):
    the folder it was built from when that was not the recipe's model (its reference policy is
    that folder's: built from the recipe's, a KL or DPO learner's objective would change),
    relative to the run folder ``run_dir`` (a folder moved elsewhere keeps it)."""
    start = entry.get("start")
    if not start:
        return {}
    folder = run_dir / str(start)
    # (the run's own learners/ folder: a path elsewhere would build it from any model on the disk)
    if not folder.resolve().is_relative_to((run_dir / "learners").resolve()):
        raise UserError(f"it was built from {str(start)[:120]!r}, which is not a folder of the run's learners/")
    if not (folder / "config.json").is_file():
        raise UserError(f"it was built from {folder}, which is gone (its reference policy with it)")
    return {"model_path": str(folder)}


def resume(fanout: Fanout | None, client: Client, resolved, topo, checkpoint: Path, repeatable: bool = False,
           task=None) -> Fanout | None:
    """Restore every side learner of ``checkpoint`` (those added during the run are placed
    again first; one of the recipe's that the recipe no longer has is not) into its freshly
    built trainer; returns the fan-out (new when the recipe had none but the run had added
    some: ``repeatable`` and ``task`` as the run's, so it trains in order and evaluates)."""
    path = checkpoint / STATE
    if not path.exists():
        return fanout
    from streamrl.plugins.resolve import learner_plan

    saved = json.loads(path.read_text())["learners"]
    step = int(checkpoint.name.removeprefix("step-")) if checkpoint.name.removeprefix("step-").isdigit() else 0
    for name, entry in saved.items():
        if fanout is None or name not in fanout.learners:
            if entry["summary"].get("state") == "removed":
                continue  # (left the run before this checkpoint: nothing to place)
            if entry.get("added") is False:  # (the recipe's, taken out of it since: the user's choice)
                warnings.warn(RunWarning(f"learner {name!r} of the checkpoint is no longer in the recipe's "
                                         "[[learners]]: not resumed (`streamrl learners add --resume` brings it "
                                         "back)"), stacklevel=2)
                continue
            try:
                plan = learner_plan(resolved, name, entry["table"], served=False)
                plan.added = True
                ensure_worker(client, topo, resolved.recipe, plan.worker)
                learner = place_one(client, resolved, plan, topo.pins, entry["summary"].get("joined_at", 0),
                                    task=fanout.task if fanout is not None else task,
                                    **started_from(entry, checkpoint.parent.parent))
                learner.start = entry.get("start")  # (and the next checkpoint says so again)
            except ResidentLost:
                raise
            except Exception as exc:  # (its table no longer resolves here: a plugin gone) -- the others go on
                warnings.warn(RunWarning(f"learner {name!r} (added during the run) cannot be placed again: "
                                         f"{error_line(exc, 290, first_line=True)}; the run goes on without it"),
                              stacklevel=2)
                continue
            if fanout is None:
                fanout = Fanout(client, resolved.recipe, [], repeatable)
                fanout.task = task
            fanout.add(learner)
        lr = fanout.learners[name]
        summary = entry["summary"]
        for key in COUNTS:
            setattr(lr, key, summary.get(key, getattr(lr, key)))
        if lr.evaluator is not None and (entry["has_state"] or summary.get("state") in ("failed", "removed")):
            # its placing evaluated its starting policy, unordered with the state loaded below: the
            # base's figures (or the trained weights as version 0) would be recorded as the learner's
            lr.evaluator.cancel()
        if summary.get("state") in ("failed", "removed"):
            lr.state, lr.failure = summary["state"], summary.get("failure")
        if entry["has_state"] and lr.state == "training":
            try:
                client.submit(task_functions.load_trainer_checkpoint, str(checkpoint / "learners" / name),
                              lr.plan.resident, pure=False, **lr.view.train_pin).result()
            except ResidentLost:
                raise
            except Exception as exc:  # (resumed with another model or algorithm for it): it fails, alone
                fanout.fail(lr, step, RuntimeError(
                    f"its state in {checkpoint.name} could not be loaded ({error_line(exc, 200, first_line=True)}); "
                    "was the run resumed with another model or algorithm for it?"))
        elif lr.state == "training":
            warnings.warn(RunWarning(f"learner {name!r}: the checkpoint holds no state of it; it starts over"),
                          stacklevel=2)
    return fanout


def finish(fanout: Fanout | None, out: Path) -> None:
    """At the end of the run: every side learner's queued steps, policy (``out/<name>``) and
    final evaluation, and ``learners.json`` beside ``out``."""
    if fanout is not None:
        fanout.drain()
        fanout.save_policies(out)
        fanout.finish_evaluations()
        write_final(fanout, out.parent / "learners.json")


def write_final(fanout: Fanout, path: Path) -> None:
    """At the end of the run: every side learner as it ended (what it trained after the last
    record, its final evaluation) into ``learners.json`` in the run folder."""
    path.write_text(json.dumps(fanout.harvest(), indent=1))
