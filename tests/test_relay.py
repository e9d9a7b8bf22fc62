"""Weight fan-out through a relay (the ``dask`` transfer's ``relay``) and bf16 on the wire.

The relay's claim is about where bytes come from, so the cluster test reads each generate
worker's own Dask transfer log: with a relay, only the relay worker takes the payload from the
train worker; the others take it from the relay worker and never fetch the export itself.
Without one (same cluster, next version) every generate worker fetches the export -- which shows
the log can tell the two apart.
"""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from streamrl.transfer.dask import DaskTransfer, DaskTransferConfig


def test_bf16_on_the_wire_halves_fp32_and_comes_back_in_its_own_dtype():
    g = torch.Generator().manual_seed(0)
    sent = {"w": torch.randn(256, 64, generator=g), "half": torch.randn(8, generator=g).to(torch.bfloat16),
            "steps": torch.arange(4)}
    plain = DaskTransfer(DaskTransferConfig()).send(sent, 1)
    wire = DaskTransfer(DaskTransferConfig(wire_dtype="bfloat16"))
    payload = wire.send(sent, 1)
    assert len(payload) < 0.55 * len(plain)
    got = wire.receive(payload, 1)
    assert {n: t.dtype for n, t in got.items()} == {n: t.dtype for n, t in sent.items()}
    assert torch.equal(got["w"], sent["w"].to(torch.bfloat16).float())  # rounded once, cast back
    assert torch.equal(got["half"], sent["half"]) and torch.equal(got["steps"], sent["steps"])
    # a payload sent as trained is read back untouched by a receiver configured either way
    assert torch.equal(wire.receive(plain, 1)["w"], sent["w"])


def test_sites_name_generate_workers_once():
    assert DaskTransferConfig(relay=True, sites=[["generate-0", "generate-1"], ["generate-2"]]).sites
    with pytest.raises(ValidationError, match="'train-0' is not a generate worker"):
        DaskTransferConfig(relay=True, sites=[["generate-0", "train-0"]])
    with pytest.raises(ValidationError, match="'generate-1' is in two sites"):
        DaskTransferConfig(relay=True, sites=[["generate-0", "generate-1"], ["generate-1"]])


def sources(client, generate: dict[str, str], prefix: str) -> dict[str, set[str]]:
    """``{generate worker: names of the workers it fetched keys starting with prefix from}``."""
    names = {addr: info["name"] for addr, info in client.sync(client.scheduler.identity, n_workers=-1)["workers"].items()}

    def log(dask_worker):
        return [(str(t["who"]), [str(k) for k in t["keys"]]) for t in dask_worker.transfer_incoming_log]

    out = {}
    for addr, entries in client.run(log, workers=list(generate.values())).items():
        out[names[addr]] = {names.get(who, who) for who, keys in entries if any(prefix in k for k in keys)}
    return out


@pytest.mark.slow
def test_a_relay_worker_fans_the_weights_out_to_its_site(tiny_recipe):
    from streamrl.cluster import lifecycle
    from streamrl.run import runner
    from streamrl.run.controller import Controller
    from streamrl.on_worker.resident import ENGINE, TRAINER
    from streamrl.flow.weights import publish, wait_loaded
    from streamrl.recipe.recipe import load_recipe

    loaded = load_recipe(str(tiny_recipe), ["pools.generate.workers=3", "run.mode=stream",
                                            'transfer={name="dask", relay=true}'])
    resolved = runner.resolve(loaded)
    dask_cluster, client = lifecycle.start(loaded.recipe)
    try:
        ctl = Controller(resolved, client, lifecycle.check_pools(client))
        ctl.place_residents()
        for step in range(2):  # the controller's own publications, through the recipe's relay
            record = ctl.step(step)
            assert record["policy_version"] == step + 1
        addr = {info["name"]: a for a, info in client.sync(client.scheduler.identity, n_workers=-1)["workers"].items()}
        generate = {n: addr[n] for n in ctl.topology.generate}
        assert sorted(generate) == ["generate-0", "generate-1", "generate-2"]

        relayed = sources(client, generate, "relay-weights")
        exported = sources(client, generate, "export-weights")
        assert exported == {"generate-0": {"train-0"}, "generate-1": set(), "generate-2": set()}, exported
        assert relayed == {"generate-0": set(), "generate-1": {"generate-0"}, "generate-2": {"generate-0"}}, relayed

        def engine_state(dask_worker):
            engine = dask_worker.plugins[ENGINE].get()
            return engine.version, {n: p.detach().clone() for n, p in engine.model.named_parameters()}

        def trainer_state(dask_worker):
            return {n: t.detach().clone() for n, t in dask_worker.plugins[TRAINER].get().named_weights().items()}

        trained = next(iter(client.run(trainer_state, workers=[addr["train-0"]]).values()))
        for name, (version, params) in client.run(engine_state, workers=list(generate.values())).items():
            assert version == 2, (name, version)
            assert all(torch.equal(params[n], trained[n].to(params[n].dtype)) for n in params), name

        # the same cluster without a relay: generate-1 and -2 now fetch from the train worker
        topo = ctl.topology
        wait_loaded(publish(client, None, 3, topo.train_pin, topo.generate_pins(), tag="-direct",
                            trainer_id=topo.incarnations))
        direct = sources(client, generate, "export-weights-3")
        # each fetched the export itself -- from the train worker, or from a generate worker that
        # already held it (Dask fetches from any holder: under load generate-0 was often first)
        assert all(direct[n] for n in generate) and "train-0" in set().union(*direct.values()), direct
        assert not any(sources(client, generate, "relay-weights-3").values())
    finally:
        lifecycle.stop(dask_cluster, client)
