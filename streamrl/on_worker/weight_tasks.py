"""The tasks that carry the policy from the train pool to the generate pool: the trainer's weights
exported through the run's transfer, loaded into each engine, sent again to a worker that missed
them, and caught up by a generate worker that was restarted (it holds the base weights until
then). ``flow/weights.py`` submits them; the generate tasks call :func:`catch_up`.
"""

from __future__ import annotations

import re
import threading
import time

from distributed import get_worker

from streamrl.cluster.pool_workers import workers
from streamrl.contracts.generation import ReceiveMissed
from streamrl.errors import WeightShapeMismatch
from streamrl.on_worker.resident import ENGINE, TRAINER, TRANSFER, ResidentLost, expect, resident

LATEST = "streamrl-latest-weights"  # the newest publication's payload future (a Dask Variable)
LATEST_SENDER = "streamrl-latest-weights-sender"  # who exported LATEST: {"pin", "name", "address"}
WEIGHTS_LOCK = threading.Lock()
"""Held by a train worker's exports (``export_weights``, ``export_held``) while they read the
trainer's weights, and by its optimizer step while it changes them: with more than one task
thread (``pools.train.threads``, or a colocated run's generation there) an export beside a step
would send a payload labelled one version holding some of the next; and one export at a time
(the receivers are set on the one transfer object, and an elastic join's export for one worker
must not size a publication's group, or the other way round). The policy saved for a learner
added during the run, and a checkpoint's save, are ordered after the step by their tasks'
dependencies instead."""

#: Dask priority of weight export/load tasks (``weights.LOAD_PRIORITY``)
LOAD_PRIORITY = 1_000_000


def export_weights(version: int, after=None, trainer_id: str | dict | None = None, receivers: int = 1):
    """Train pool: the transfer's payload of the trainer's current weights, for ``receivers``
    generate workers."""
    expect(TRAINER, trainer_id)
    with WEIGHTS_LOCK:
        resident(TRANSFER).receivers = receivers
        return resident(TRANSFER).send(resident(TRAINER).named_weights(), version)


def resend_weights(version: int) -> tuple:
    """Train pool: the transfer's payload of the newest weights it sent (``version`` or later)
    for one generate worker that missed them; returns ``(payload, version)``."""
    return resident(TRANSFER).resend(version)


def receive_again(transfer, version: int, resend_at: dict | None, missed: ReceiveMissed) -> tuple[dict, int]:
    """Generate pool: the weights of ``version`` (or newer) once more, served to this worker
    alone by the train worker (``resend_at``: its pin); returns ``(weights, version)``. Without
    a pin, or when that fails too, the load fails with both reasons."""
    from distributed import worker_client

    if resend_at is None:
        raise missed
    try:
        with worker_client() as client:  # leaves the worker's thread pool while it waits
            payload, sent = client.submit(resend_weights, version, key=f"resend-weights-{version}-"
                                          f"{get_worker().name}-{time.time_ns()}", priority=LOAD_PRIORITY,
                                          pure=False, **resend_at).result(timeout=CATCH_UP_TIMEOUT)
        return transfer.receive(payload, sent), sent
    except Exception as exc:
        raise RuntimeError(f"{missed}; sent again: {exc}") from None


_LOAD_LOCK = threading.Lock()


CATCH_UP_TIMEOUT = 120.0


def export_held(version: int) -> object | None:
    """Train pool: the transfer's payload of the trainer's current weights for one generate worker
    when they are policy ``version`` (its optimizer steps so far are that version's), else None."""
    trainer = resident(TRAINER)
    epochs = max(1, int(getattr(getattr(trainer, "algorithm", None), "epochs", 1) or 1))
    with WEIGHTS_LOCK:
        if trainer.version != version * epochs:
            return None
        resident(TRANSFER).receivers = 1
        return resident(TRANSFER).send(trainer.named_weights(), version)


def catch_up(engine, min_version: int) -> None:
    """A generate worker restarted by its nanny holds a fresh engine at the base weights: load the
    newest published weights (``weights.LATEST``) before generating with it.

    The newest publication's export may wait for the very step this worker's generation belongs
    to (a repeatable run submits a step's training, and the export after it, before its groups
    are generated): when that export is not done and is newer than ``min_version``, the train
    worker's current weights are exported for this worker alone if they are ``min_version``'s,
    rather than waited for until the wait times out."""
    from distributed import Variable, worker_client

    with worker_client() as client:  # leaves the worker's thread pool while it waits
        payload_future = Variable(LATEST, client=client).get(timeout=CATCH_UP_TIMEOUT)
        version = int(re.search(r"export-weights-(\d+)", str(payload_future.key)).group(1))
        sender = Variable(LATEST_SENDER, client=client).get(timeout=CATCH_UP_TIMEOUT)
        payload = None
        if version > min_version and not payload_future.done():
            payload = client.submit(export_held, min_version, key=f"export-held-{min_version}-"
                                    f"{get_worker().name}-{time.time_ns()}", priority=LOAD_PRIORITY, pure=False,
                                    **sender["pin"]).result(timeout=CATCH_UP_TIMEOUT)
            if payload is not None:
                version = min_version
        if payload is None:
            payload = _published(client, payload_future, version, sender)
    # the same receive, lock and version check as a publication (a collective's group is likely
    # over or full by now: then the train worker sends to this worker alone)
    load_weights(payload, version, resend_at=sender["pin"])
    if engine.version < min_version:
        raise RuntimeError(f"engine on worker {get_worker().name} holds v{engine.version}, "
                           f"needs v{min_version}: the published weights are older")


def _published(client, payload_future, version: int, sender: dict):
    """The payload of a publication, once its export is done. The train worker that exported it
    must still be up: when it was killed, its payload went with it, and Dask would recompute the
    export from the step's lineage, whose generation may be this very task, waiting here (the
    run would stop only when this wait times out). So a lost sender fails at once, as the
    trainer's loss does everywhere."""
    deadline = time.monotonic() + CATCH_UP_TIMEOUT
    while True:
        try:
            return payload_future.result(timeout=1.0)
        except TimeoutError:
            if sender["address"] and sender["address"] not in workers(client):
                raise ResidentLost(f"worker {sender['name']} was restarted and its trainer lost its state "
                                   f"(with the weights v{version} it published)") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"the weights v{version} were not exported by worker {sender['name']} "
                                   f"within {CATCH_UP_TIMEOUT:.0f} s") from None


def load_weights(payload, version: int, after=None, resend_at: dict | None = None) -> float:
    """Generate pool: load published weights into the engine; returns the seconds it took.
    ``resend_at``: the train worker's pin, asked for the weights again when the payload was
    missed (:class:`ReceiveMissed`).

    Loads of two versions may run on two threads of one worker (async mode, staleness >= 2);
    the lock and the version check keep the engine from going back to an older policy.
    """
    t0 = time.perf_counter()
    engine = resident(ENGINE)
    transfer = resident(TRANSFER)
    try:
        weights = transfer.receive(payload, version)  # always: a collective counts on every member
    except ReceiveMissed as missed:  # its group lost a member, or was over before this worker came
        weights, version = receive_again(transfer, version, resend_at, missed)
    with _LOAD_LOCK:
        if version > engine.version:
            try:
                engine.load_weights(weights, version)
            except WeightShapeMismatch as exc:  # which transfer brought them: one line says it all
                raise WeightShapeMismatch(f"{exc}, through {get_worker().plugins[TRANSFER].what}; the trainer "
                                          "and the engine must hold the same model, and the transfer must "
                                          "carry each tensor whole") from None
    return time.perf_counter() - t0
