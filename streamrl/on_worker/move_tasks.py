"""What runs on a generate worker when the run moves running samples between instances (a
scheduler whose ``moves_samples`` is set; ``extensions/sample_moves.py`` looks and decides in the
``streamrl`` process): what an engine decodes now, a sample taken out, and the task that finishes
it on the worker it moved to."""

from __future__ import annotations

from distributed import get_worker

from streamrl.contracts.generation import Engine
from streamrl.on_worker.resident import ENGINE, resident
from streamrl.on_worker.weight_tasks import catch_up


#: ``{sample uid: submit() keywords of the worker it moves to}``, on the worker it leaves: set by
#: :func:`move_sample`, read by the ``task_functions.generate_chunk`` task that hands the sample over.
MOVE_TARGETS: dict[str, dict] = {}


def requests_now(dask_worker=None):
    """Run on a generate worker by ``Client.run`` (not a task: it must answer while every task
    slot waits on the engine): what its engine decodes now (``Engine.requests_now``), or None
    where no engine that moves samples is built."""
    plugin = dask_worker.plugins.get(ENGINE) if dask_worker is not None else None
    engine = getattr(plugin, "obj", None)
    if engine is None or not engine_moves(engine):
        return None
    return engine.requests_now()


def move_sample(uid: str, pin: dict, dask_worker=None) -> bool:
    """Run on a generate worker by ``Client.run``: take running sample ``uid`` out of its engine,
    to be finished where ``pin`` (``submit()`` keywords) places a task. False when it is not
    running there any more."""
    engine = getattr(dask_worker.plugins.get(ENGINE), "obj", None)
    if engine is None:
        return False
    MOVE_TARGETS[uid] = pin
    if not engine.move_out(uid):
        MOVE_TARGETS.pop(uid, None)
        return False
    return True


def continue_moved(partial, priority: float):
    """Generate pool, on the worker a sample moved to: finish it (``Engine.continue_sample``),
    with a policy no older than the one it left (a restarted worker catches up first)."""
    engine = resident(ENGINE)
    newest = max(partial.token_versions or [partial.policy_version])
    if engine.version < newest:
        catch_up(engine, newest)
    sample = engine.continue_sample(partial, priority)
    sample.worker = str(get_worker().name)
    return sample


def engine_moves(engine) -> bool:
    """Whether ``engine`` can hand running samples between instances (its class overrides
    ``Engine.move_out``)."""
    return type(engine).move_out is not Engine.move_out
