"""Weight publication after an optimizer step: one export on the train worker, one load per
generate worker, through the recipe's transfer (``[transfer]``).

streamrl orders and prioritises the work so a transfer only moves tensors: the export runs after
the step (it depends on it), every load after the export, both at a Dask priority above any
generate task (on a busy generate worker a load must not queue behind generation submitted
earlier), and a load never takes an engine back to an older version (``remote.load_weights``).
"""

from __future__ import annotations

from distributed import Client, Future, wait

from streamrl.flow import remote

#: Dask priority of weight export/load tasks: above any generate task (schedulers use the
#: predicted-length rank, at most the prompts per step, as generate priorities).
LOAD_PRIORITY = 1_000_000


def publish(client: Client, after: Future | None, version: int, train_worker: str,
            generate_workers: dict[str, str], tag: str = "") -> list[Future]:
    """Submit the export and one load per generate worker (``{name: address}``); returns the
    load futures (each resolves to the seconds the load took). ``tag`` makes the keys new when
    a version is published again (a resume), so Dask does not answer with a finished task."""
    payload = client.submit(remote.export_weights, version, after=after, key=f"export-weights-{version}{tag}",
                            workers=[train_worker], allow_other_workers=False, priority=LOAD_PRIORITY)
    return [client.submit(remote.load_weights, payload, version, key=f"load-weights-{version}{tag}-{name}",
                          workers=[addr], allow_other_workers=False, priority=LOAD_PRIORITY)
            for name, addr in generate_workers.items()]


def wait_loaded(loads: list[Future]) -> None:
    """Block until every generate worker has loaded the published weights (raise if one failed)."""
    wait(loads)
    for f in loads:
        f.result()
