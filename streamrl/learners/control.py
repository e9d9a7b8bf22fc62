"""Adding and removing learners while the run goes on: ``streamrl learners list|add|remove RUN_DIR``.

The control channel is the run's own Dask scheduler (its address is in the run folder's
``status.json``). A command puts a request on the Dask ``Queue`` :data:`REQUESTS` and waits for
the answer in a Dask ``Variable`` named after the request; the run reads the queue at each
step boundary (:func:`serve`), so a learner added joins at the next step and one removed leaves
before it. ``list`` needs no channel: it reads the run folder's newest record.

An added learner starts from the served policy's current weights (saved into the run folder,
``learners/start-<name>-<step>/``, and loaded from there, so any trainer that can ``save`` and be built
from a model folder can be copied), from the initial model (``--from initial``), or from its own
state in the newest checkpoint (``--resume``: a learner that failed or was removed). With the
embedded cluster streamrl starts its worker (``learner-<name>``); on a cluster you run, start one
first (the answer says how).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
import uuid
from pathlib import Path

from distributed import Client, Queue, Variable

from streamrl.errors import UserError
from streamrl.telemetry.run_files import lines_of
from streamrl.telemetry.text import error_line, message_line, one_line

#: The Dask queue requests travel on (one run per scheduler at a time).
REQUESTS = "streamrl-learners-control"

#: Seconds a command waits for the run to answer (a step boundary must come).
ANSWER_TIMEOUT = 600.0

#: The largest ``status.json`` read (a run writes a few hundred bytes there).
STATUS_BYTES = 1 << 20


# -- the command side --------------------------------------------------------------------------------
def scheduler_of(run_dir: Path) -> str:
    """The address of the running run's scheduler, from ``status.json``; one line if the run is
    not running."""
    status = run_dir / "status.json"
    try:
        # (a file, and bounded before it is parsed: a FIFO there waits for ever, a link to /dev/zero never ends)
        if status.exists() and (not status.is_file() or status.stat().st_size > STATUS_BYTES):
            raise ValueError(f"not a file of at most {STATUS_BYTES} bytes")
        state = json.loads(status.read_text())
    except FileNotFoundError:
        raise UserError(f"{run_dir}: not a run folder (no status.json)") from None
    except (OSError, ValueError, RecursionError) as exc:
        raise UserError(f"{status}: cannot be read ({type(exc).__name__}: {message_line(exc, 120)}); expected the "
                        "run's status record") from None
    if not isinstance(state, dict):
        raise UserError(f"{status}: expected a JSON object with a 'state' (the run's status record)")
    if state.get("state") != "running" or not isinstance(state.get("scheduler"), str) or not state["scheduler"]:
        raise UserError(f"{run_dir}: the run is not running (state {state.get('state')!r}); learners are added "
                        "and removed while it runs")
    if not _held(run_dir):
        # (killed with -9, or its machine's OOM killer: on a cluster that outlives it the scheduler
        # still answers, and the request would wait the whole timeout for a run that is gone)
        raise UserError(f"{run_dir}: the run's process (pid {str(state.get('pid'))[:20]!r}) is gone, without saying why "
                        f"(killed?); learners are added and removed while it runs; resume it with: "
                        f"streamrl recipe resume {run_dir}")
    return state["scheduler"]


def _held(run_dir: Path) -> bool:
    """Does a process hold the run folder (its ``.lock``, which a running command holds with
    ``flock`` and the kernel lets go when the process ends, however it ends)? A folder of a
    streamrl that wrote no lock counts as held: nothing tells."""
    try:
        fd = os.open(Path(run_dir) / ".lock", os.O_RDONLY)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # (BlockingIOError: held)
        return True
    finally:
        os.close(fd)  # (a lock this probe took goes with it)
    return False


def ask(run_dir: Path, request: dict, timeout: float = ANSWER_TIMEOUT) -> str:
    """Send ``request`` to the run in ``run_dir`` and return its answer (raises
    :class:`UserError` with the run's message when it refused)."""
    address = scheduler_of(run_dir)
    try:
        client = Client(address, timeout=10, set_as_default=False)
    except (OSError, ValueError, TypeError) as exc:  # (ValueError: status.json's address is not one)
        raise UserError(f"{run_dir}: cannot reach the run's scheduler at {address[:200]!r}, status.json's scheduler "
                        f"({error_line(exc, 200)})") from None
    try:
        rid = uuid.uuid4().hex
        answer = Variable(f"{REQUESTS}-{rid}", client=client)
        # (the run's folder in it: on a cluster that outlives runs, a request no run read is
        # still on the queue when the next run starts, and must not be carried out by that one)
        Queue(REQUESTS, client=client).put({**request, "id": rid, "run": str(Path(run_dir).resolve())})
        try:
            reply = answer.get(timeout=timeout)
            answer.delete()
            Variable(f"{REQUESTS}-{rid}-begun", client=client).delete()
        except TimeoutError:
            # withdrawn: a request the run reads after this is not carried out behind the back
            # of a command that said it had no answer. The run marks a request begun before it
            # looks for the withdrawal, and this looks for the mark after withdrawing it: the
            # scheduler takes the two one at a time, so one of them sees the other.
            try:
                Variable(f"{REQUESTS}-{rid}-withdrawn", client=client).set(True)
                begun = _flag(client, f"{REQUESTS}-{rid}-begun")
            except OSError:  # (the scheduler went away: the run ended)
                raise UserError(f"{run_dir}: the run ended before it answered the request") from None
            if begun:
                raise UserError(f"{run_dir}: no answer from the run within {timeout:.0f} s, but it has begun the "
                                "request and carries it out; `streamrl learners list` says when") from None
            raise UserError(f"{run_dir}: no answer from the run within {timeout:.0f} s (it reads requests between "
                            "steps; is a step that long?); the request is withdrawn") from None
        except OSError:  # (CommClosedError) the scheduler went away: the run ended first
            raise UserError(f"{run_dir}: the run ended before it read the request") from None
    finally:
        client.close()
    if not reply.get("ok"):
        raise UserError(reply.get("message", "refused"))
    return reply.get("message", "done")


def listing(run_dir: Path) -> list[dict]:
    """Every learner of the run as its newest record says (``metrics.jsonl``'s ``learners``)."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        raise UserError(f"{run_dir}: no metrics.jsonl yet (not a run folder, or no step has finished)")
    if not metrics.is_file():  # (a FIFO would wait for ever, a folder cannot be read)
        raise UserError(f"{metrics}: not a file; expected the run's step records")
    last = None
    try:
        for line in lines_of(metrics):  # (each bounded: a line of gigabytes is passed over, not read whole)
            try:
                record = json.loads(line) if line is not None else None
            except (ValueError, RecursionError):
                continue  # a torn last line
            if isinstance(record, dict) and isinstance(record.get("step"), int):  # (a step's record)
                last = record
    except OSError as exc:
        raise UserError(f"{metrics}: cannot be read ({error_line(exc, 200)})") from None
    if last is None:
        raise UserError(f"{metrics}: no step's record yet")
    learners = last.get("learners")
    if not learners:
        return [{"name": "main", "state": "training", "served": True, "steps_trained": last["step"] + 1,
                 "reward_mean": last.get("reward_mean"), "eval/reward_mean": last.get("eval/reward_mean")}]
    if not isinstance(learners, dict) or not all(isinstance(e, dict) for e in learners.values()):
        raise UserError(f"{metrics}: the last step's 'learners' is not an object of learners")
    return [{"name": name, **entry} for name, entry in learners.items()]


# -- the run side ------------------------------------------------------------------------------------
def serve(side, run_dir: Path, step: int) -> list[str]:
    """At a step boundary (``step``: the next one): carry out every request waiting; returns a
    line per request for the console. A refused request is answered, never raised: the run goes
    on. ``side``: the run's :class:`~streamrl.learners.extension.SideLearners`."""
    client = side.context.client
    try:
        requests = Queue(REQUESTS, client=client).get(batch=True)
    except Exception:
        return []
    lines = []
    mine = str(Path(run_dir).resolve())
    for request in requests:
        if not isinstance(request, dict):
            continue
        rid = request.get("id")
        if request.get("run") != mine:  # (another run's, left on a cluster that outlived it): not carried out
            # answered all the same: a command that sees this folder by another path (a container's
            # mount) learns why, instead of waiting for its timeout
            try:
                Variable(f"{REQUESTS}-{rid}", client=client).set(
                    {"ok": False, "message": f"the request names run folder {request.get('run')!r}; this run's is "
                                             f"{mine!r} (another run's request, or this folder by another path)"})
            except Exception:  # noqa: BLE001 -- nobody may be waiting for it
                pass
            continue
        try:
            Variable(f"{REQUESTS}-{rid}-begun", client=client).set(True)
            if _flag(client, f"{REQUESTS}-{rid}-withdrawn"):
                lines.append("a request was withdrawn (its command stopped waiting); not carried out")
                continue  # (nobody waits for its answer)
        except Exception:  # noqa: BLE001 -- the scheduler's trouble: the request as if not withdrawn
            pass
        try:
            if request.get("op") == "add":
                message = add(side, run_dir, step, request)
            elif request.get("op") == "remove":
                message = remove(side, run_dir, request["name"])
            else:
                raise UserError(f"unknown request {request.get('op')!r}")
            reply = {"ok": True, "message": message}
        except Exception as exc:
            text = str(exc) if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"
            # (the request's own values may be in it: a name of megabytes, an escape sequence)
            reply = {"ok": False, "message": one_line(text.splitlines()[0], 300) if text else type(exc).__name__}
        lines.append(reply["message"])
        Variable(f"{REQUESTS}-{rid}", client=client).set(reply)
    return lines


def _flag(client, name: str) -> bool:
    # whether the other side (the run or the command) set the Dask Variable ``name``; read once
    flag = Variable(name, client=client)
    try:
        flag.get(timeout=0.1)
    except TimeoutError:
        return False
    flag.delete()
    return True


def add(side, run_dir: Path, step: int, request: dict) -> str:
    """Place a new learner (``request``: ``table`` -- a ``[[learners]]`` table -- ``start``:
    ``served`` | ``initial``, ``resume``) to train from step ``step``."""
    from dataclasses import replace

    from streamrl.checkpoints import folders
    from streamrl.on_worker import task_functions
    from streamrl.plugins.resolve import learner_plan
    from streamrl.learners import runtime
    from streamrl.plugins.resolve import check_algorithm
    from streamrl.recipe.learners import LearnerConfig, check_stream_keys
    from streamrl.recipe.recipe import validate_section
    from streamrl.recipe.toml_input import check_finite

    run = side.context
    resolved, topo = run.resolved, run.topology
    check_finite(request["table"])  # (as a recipe's tables are: lr = inf passes a "> 0" check)
    table = validate_section(LearnerConfig, request["table"], "learner").model_dump()
    name = table["name"]
    try:
        check_stream_keys(table.get("trainer"), "learner")  # (as a recipe's [[learners]] are)
    except ValueError as e:
        raise UserError(str(e)) from None
    fanout = side.fanout
    known = fanout.learners if fanout else {}
    if name in known and known[name].state == "training":
        raise UserError(f"learner {name!r} is already training; remove it first or pick another name")
    if name == resolved.learners[0].name:
        raise UserError(f"learner {name!r} is the main learner (it trains on the train pool)")
    resume_from = None
    if request.get("resume"):
        latest = folders.latest(run_dir)
        saved = latest / "learners" / name if latest else None
        if saved is None or not saved.is_dir():
            raise UserError(f"learner {name!r}: no state of it in the newest checkpoint "
                            f"({latest.name if latest else 'none yet'}) to resume from")
        resume_from = saved
        if not request["table"].get("algorithm") and (latest / runtime.STATE).exists():
            # (its table as it was; a learners.json that does not list it: the one asked for)
            entry = json.loads((latest / runtime.STATE).read_text()).get("learners", {}).get(name)
            table = entry["table"] if isinstance(entry, dict) and isinstance(entry.get("table"), dict) else table
    plan = learner_plan(resolved, name, table, served=False)
    check_algorithm(resolved, plan)  # (its epochs, and groups big enough for it, as a recipe's learner)
    plan.added = True
    worker = plan.worker
    runtime.ensure_worker(run.client, topo, resolved.recipe, worker)
    start = request.get("start", "served")
    start_model = None
    joined_at = step
    if start == "served" and resume_from is None:
        # the served policy as it is now, after the last step: saved, and the new trainer built
        # from it. In async mode the next step's training may have run first (it is submitted
        # as its groups come, before this): the steps its weights hold are not handed to it again
        # (named for its step too: a learner added again under its name must not overwrite the
        # folder an older checkpoint's learner was built from)
        start_folder = f"learners/start-{name}-{step}"
        folder = run_dir / start_folder
        version = run.client.submit(task_functions.save_policy_now, str(folder), after=run.last_optimizer_step,
                                    trainer_id=topo.incarnations, key=f"save-start-{name}-{time.time_ns()}",
                                    **topo.train_pin).result()
        joined_at = max(step, version // max(1, resolved.algorithm.build().epochs))  # (optimizer steps per step)
        start_model = str(folder)
    else:
        start_folder = None
    if resume_from is not None and (latest / runtime.STATE).exists():  # (built from what it was built from)
        entry = json.loads((latest / runtime.STATE).read_text()).get("learners", {}).get(name)
        entry = entry if isinstance(entry, dict) else {}
        try:
            start_model = runtime.started_from(entry, run_dir).get("model_path")
        except UserError as e:
            raise UserError(f"learner {name!r}: {e}") from None
        start_folder = entry.get("start") if start_model else None
    learner = runtime.place_one(run.client, resolved, plan, topo.pins, joined_at=joined_at,
                                task=fanout.task if fanout is not None and fanout.task is not None else run.task,
                                model_path=start_model)
    learner = replace(learner, start=start_folder)
    if resume_from is not None:
        try:
            run.client.submit(task_functions.load_trainer_checkpoint, str(resume_from), plan.resident, pure=False,
                              **learner.view.train_pin).result()
        except Exception as exc:  # (a state another model or algorithm wrote): placed for nothing, let go
            _let_go(side, learner)
            raise UserError(f"learner {name!r}: its state in {latest.name} could not be loaded "
                            f"({error_line(exc, 200, first_line=True)})") from None
        if learner.evaluator is not None:  # (placing evaluated its starting policy, unordered with the load)
            learner.evaluator.cancel()
        # its counts go on from those of the state it resumes (the checkpoint's, not the ones it
        # had when it left: the steps it trained after that checkpoint are lost with their state)
        counts = runtime.saved_counts(latest, name)
        if not counts and name in known:  # (a checkpoint of an older streamrl: the counts it had)
            old = known[name]
            counts = {k: getattr(old, k) for k in runtime.COUNTS}
        learner = replace(learner, **counts)
    side.add(learner)
    where = {"served": "the served policy's current weights", "initial": "the initial model"}.get(start, start)
    origin = f"its state in {resume_from.parent.parent.name}" if resume_from is not None else where
    return f"learner {name!r} ({plan.algorithm.component.name}) added on worker {worker}, from {origin}; " \
           f"it trains from step {learner.joined_at + 1}"


def _let_go(side, lr) -> None:
    """Release what placing learner ``lr`` took -- its evaluation, its trainer and evaluation
    engine on their worker, and (embedded cluster) the worker when no other learner trains there."""
    from streamrl.learners.evaluate import engine_resident

    run, fanout = side.context, side.fanout
    if lr.evaluator is not None:
        lr.evaluator.cancel()
    for resident_name in (lr.plan.resident, engine_resident(lr.name)):
        try:
            run.client.unregister_worker_plugin(resident_name)
        except Exception:
            pass  # (not registered: no [eval])
    others = fanout.learners.values() if fanout is not None else ()
    shared = any(other.plan.worker == lr.plan.worker and other.state != "removed" for other in others
                 if other is not lr)
    if run.topology.can_grow and not shared and lr.plan.worker in (run.topology.spec_cluster.worker_spec or {}):
        run.topology.stop_worker(lr.plan.worker)  # (a worker other learners still train on stays)


def remove(side, run_dir: Path, name: str) -> str:
    """Stop learner ``name`` after the steps it has queued: save its policy to
    ``policy/<name>/``, release its trainer and (embedded cluster) its worker."""
    run, fanout = side.context, side.fanout
    if name == run.resolved.learners[0].name:
        raise UserError(f"learner {name!r} is the main learner; it cannot be removed while the run goes on")
    if fanout is None or name not in fanout.learners or fanout.learners[name].state == "removed":
        known = ", ".join(fanout.learners) if fanout else "none"
        raise UserError(f"no learner {name!r} to remove (side learners: {known})")
    lr = fanout.learners[name]
    if lr.state == "training":
        fanout.drain(only=[name])  # (its own steps: another learner's slow queue is not its removal's)
    saved = fanout.save_policies(run_dir / "policy", only=[name])
    lr.state = "removed"
    _let_go(side, lr)
    where = saved.get(name)
    return f"learner {name!r} removed after {lr.steps_trained} steps" + (f"; its policy is in {where}" if where else "")
