"""Weight publication after an optimizer step: one export on the train worker, one load per
generate worker, through the recipe's transfer (``[transfer]``).

streamrl orders and prioritises the work so a transfer only moves tensors: the export runs after
the step (it depends on it), every load after the export, both at a Dask priority above any
generate task (on a busy generate worker a load must not queue behind generation submitted
earlier), and a load never takes an engine back to an older version (``weight_tasks.load_weights``).

With a relay (the ``dask`` transfer's ``relay``) the generate workers of a site take the payload
from one of them, not from the train worker: a ``relay-weights-<v>`` task pinned to the site's
first worker depends on the export, and the site's loads depend on the relay's key. Dask fetches
a dependency from a worker that holds it, and only the relay worker holds that key, so the
payload crosses the link between the pools once per site.
"""

from __future__ import annotations

from distributed import Client, Future, Variable, wait

from streamrl.errors import RunStopped
from streamrl.on_worker import weight_tasks
from streamrl.on_worker.resident import ResidentLost
from streamrl.telemetry import spans

#: Dask priority of weight export/load tasks: above any generate task (schedulers use the
#: predicted-length rank, at most the prompts per step, as generate priorities).
LOAD_PRIORITY = weight_tasks.LOAD_PRIORITY

#: Dask ``Variable`` holding the newest export: a generate worker restarted mid-run (a fresh
#: engine at the base weights) loads it before it generates (``weight_tasks.catch_up``).
LATEST = weight_tasks.LATEST


def relay(payload):
    """Generate worker, one per site: the payload itself. Its result lives on this worker only,
    so the site's loads, which depend on this task's key, fetch the payload from here."""
    return payload


def relay_sites(transfer_config, generate: list[str]) -> list[list[str]] | None:
    """The sites a publication relays to (``transfer_config``: the recipe's transfer config;
    ``generate``: the generate workers now), or None without a relay. A transfer with no
    ``relay`` option (one whose payload is a token) never relays."""
    from streamrl.transfer.dask import DaskTransferConfig  # (the transfer that relays: its config says so)

    if not isinstance(transfer_config, DaskTransferConfig) or not transfer_config.relay:
        return None
    return [list(site) for site in transfer_config.sites] or [list(generate)]


def publish(client: Client, after: Future | None, version: int, train_pin: dict,
            generate_pins: dict[str, dict], tag: str = "", trainer_id: str | dict | None = None,
            loads_after: list[Future] | None = None, sites: list[list[str]] | None = None,
            sender: tuple[str, str] = ("", "")) -> list[Future]:
    """Submit the export (on the train worker, ``train_pin``: ``cluster/lifecycle.worker_pins``) and one load per
    generate worker (``{name: pin}``); returns the load futures (each resolves to the seconds
    the load took). ``tag`` makes the keys new when a version is published again (a resume), so
    Dask does not answer with a finished task. ``loads_after``: tasks every load waits for (a
    repeatable run: the generation that must still see the older weights). ``sites``: generate
    workers grouped by site (:func:`relay_sites`); in a site of two or more workers now in
    ``generate_pins``, the first relays to the others; None: every load fetches from the train
    worker. ``sender``: the train worker's name and address, so that a generate worker catching
    up (``weight_tasks.catch_up``) can tell its loss from a slow export."""
    with spans.phase(version - 1, "publish"):  # the step that made this version
        payload = client.submit(weight_tasks.export_weights, version, after=after, trainer_id=trainer_id,
                                receivers=len(generate_pins), key=spans.step_key("export-weights", version, f"v{version}{tag}"),
                                priority=LOAD_PRIORITY, **train_pin)
        Variable(LATEST, client=client).set(payload)
        # (a missed payload is sent again from there)
        Variable(weight_tasks.LATEST_SENDER, client=client).set(
            {"pin": train_pin, "name": sender[0], "address": sender[1]})
        source = {name: payload for name in generate_pins}
        for site in sites or []:
            here = [name for name in site if name in generate_pins]
            if len(here) < 2:  # (a relay for one worker would only add a hop)
                continue
            relayed = client.submit(relay, payload, key=spans.step_key("relay-weights", version, f"{here[0]}{tag}"),
                                    priority=LOAD_PRIORITY, **generate_pins[here[0]])
            source.update(dict.fromkeys(here, relayed))
        return [client.submit(weight_tasks.load_weights, source[name], version, after=loads_after,
                              resend_at=train_pin,
                              key=spans.step_key("load-weights", version, f"{name}{tag}"), priority=LOAD_PRIORITY,
                              **pin)
                for name, pin in generate_pins.items()]


#: Seconds a weight load may take, a worker restart included, before the run gives up on it.
LOAD_TIMEOUT = 600.0


def wait_loaded(loads: list[Future], timeout: float = LOAD_TIMEOUT) -> None:
    """Block until every generate worker has loaded the published weights (raise if one failed,
    and :class:`~streamrl.errors.RunStopped` naming the load if one has not finished within ``timeout``)."""
    try:
        wait(loads, timeout=timeout)
    except TimeoutError:
        pending = [f for f in loads if not f.done()]
        keys = sorted(spans.key_text(f.key) for f in pending) or ["?"]
        # (RunStopped: the run folder adds the checkpoint it can go on from, and the command)
        raise RunStopped(f"weight load {keys[0]} did not finish within {timeout:.0f} s (is that generate "
                        "worker alive? see the dashboard)") from None
    for f in loads:
        try:
            f.result()
        except (ResidentLost, RunStopped):  # the trainer restarted, or refused the step: that is the news
            raise
        except Exception as exc:  # e.g. a broadcast that timed out: say which load, in one line
            raise RunStopped(f"weight load {spans.key_text(f.key)} failed: {exc}") from None
