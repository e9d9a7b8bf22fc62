"""Data-parallel training over two train workers (real processes, a real gloo process group):
the same samples give the update one worker gives, in stream and batch modes, with whole
replicas (ddp: both ranks end bit-identical) and with sharded state (fsdp)."""

from __future__ import annotations

import pytest
import torch
from distributed import wait

from streamrl.cluster import lifecycle
from streamrl.flow import submit
from streamrl.on_worker import task_functions
from streamrl.run.controller import Controller
from streamrl.run.runner import resolve
from streamrl.training.trainer import weights_from_bytes
from tests.helpers import close_cluster, parity_recipe

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    loaded = parity_recipe(tmp_path_factory.mktemp("dp"), tiny_model, ["pools.train.workers=2"])
    dask_cluster, client = lifecycle.start(loaded.recipe)
    pools = lifecycle.check_pools(client)
    assert sorted(pools["train"]) == ["train-0", "train-1"]
    yield resolve(loaded), client, pools
    close_cluster(client, dask_cluster)


def held(ctl, name) -> tuple[int, int]:
    """Parameter elements the rank holds, and the model's total."""
    def count():
        from streamrl.on_worker.resident import TRAINER, resident

        ps = list(resident(TRAINER).model.parameters())
        local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in ps)
        return local, sum(p.numel() for p in ps)
    return ctl.client.submit(count, pure=False, **ctl.topology.pins[name]).result()


def weights(ctl, name, after, key):
    return weights_from_bytes(ctl.client.submit(task_functions.trainer_weights, after=after, key=key,
                                                **ctl.topology.pins[name]).result())


def train(ctl, step, scored, stream):
    """Every pass over ``scored`` on ``ctl``'s train pool: (every rank's optimizer step, the passes)."""
    return submit.epochs(ctl.topology, ctl.recipe, ctl.epochs, step, scored, stream, after=None,
                         samples=4 * len(scored))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("stream", [True, False])
def test_two_train_workers_give_the_one_worker_update(setup, stream, strategy):
    resolved, client, pools = setup
    one = Controller(resolved, client, {**pools, "train": {"train-0": pools["train"]["train-0"]}})
    one.place_residents()  # a fresh trainer on train-0, no process group: the oracle
    tag = 10 * (strategy == "fsdp") + stream
    scored = one.generate(60 + tag)
    wait(scored)
    # fsdp: 3 of the 4 groups, so that one rank has a turn with nothing to train
    scored = scored if strategy == "ddp" else scored[:3]
    mode = f"{strategy}-{'stream' if stream else 'batch'}"
    resolved.recipe.trainer.groups_per_micro_batch = 1  # 1 group per train task to share out
    step, _ = train(one, 200 + tag, scored, stream)
    alone = weights(one, "train-0", step, f"alone-{mode}")

    resolved.recipe.trainer.strategy = strategy
    try:
        two = Controller(resolved, client, pools)
        two.place_residents()  # fresh trainers on both, joined in one group (and sharded: fsdp)
    finally:
        resolved.recipe.trainer.strategy = "ddp"
    step, passes = train(two, 300 + tag, scored, stream)
    ranks = {x["trained_on"] for f in passes[0] for x in f.result().sample_log}
    rank0 = weights(two, "train-0", step, f"rank0-{mode}")
    local, whole = held(two, "train-1")
    assert local == whole if strategy == "ddp" else local < 0.6 * whole  # fsdp: about half each
    if strategy == "ddp":
        rank1 = weights(two, "train-1", step, f"rank1-{mode}")
        assert all(torch.equal(rank0[n], rank1[n]) for n in rank0), "the ranks must stay identical"
    assert rank0.keys() == alone.keys()
    gap = max((rank0[n] - alone[n]).abs().max().item() for n in rank0)  # measured: 1e-8 to 1.3e-6
    lr = resolved.trainer.config.lr
    # the same update up to float summation order (Adam's first step is ~lr * sign(g); see test_flow)
    off = sum(int(((rank0[n] - alone[n]).abs() > 0.02 * lr).sum()) for n in rank0)
    total = sum(t.numel() for t in rank0.values())
    assert off <= 1e-4 * total, (off, total, gap)
    if stream and strategy == "ddp":
        assert ranks <= {"train-0", "train-1"}  # whichever rank was free
    else:
        assert ranks == {"train-0", "train-1"}  # round-robin: a batch's always, fsdp's always


def test_fsdp_with_bf16_params_keeps_float32_shards_and_gives_the_one_worker_update(setup):
    # trainer.precision = "bf16-params" sharded is FSDP's own mixed precision: float32 shards
    # (the masters) gathered as bf16 for compute over gloo, gradients reduced in float32
    resolved, client, pools = setup
    config = resolved.trainer.config
    config.precision, was = "bf16-params", config.precision
    try:
        one = Controller(resolved, client, {**pools, "train": {"train-0": pools["train"]["train-0"]}})
        one.place_residents()
        scored = one.generate(90)
        wait(scored)
        resolved.recipe.trainer.groups_per_micro_batch = 1
        step, _ = train(one, 400, scored, True)
        alone = weights(one, "train-0", step, "alone-bf16")
        resolved.recipe.trainer.strategy = "fsdp"
        try:
            two = Controller(resolved, client, pools)
            two.place_residents()
        finally:
            resolved.recipe.trainer.strategy = "ddp"
        step, _ = train(two, 500, scored, True)
        rank0 = weights(two, "train-0", step, "rank0-bf16")
    finally:
        config.precision = was

    def shard_dtypes():
        from streamrl.on_worker.resident import TRAINER, resident

        return {str(p.to_local().dtype) for p in resident(TRAINER).model.parameters()}
    assert client.submit(shard_dtypes, pure=False, **two.topology.pins["train-1"]).result() == {"torch.float32"}
    assert all(w.dtype == torch.bfloat16 for w in alone.values())  # one worker exports its bf16 policy
    assert rank0.keys() == alone.keys()
    # the same update within what bf16 compute and rounding allow: Adam's first step moves each
    # weight by ~lr, and the bf16 policy is its float32 masters rounded (relative step 2**-8)
    lr = config.lr
    off = sum(int(((rank0[n].float() - alone[n].float()).abs() > 2 ** -8 * rank0[n].abs() + 0.5 * lr).sum())
              for n in rank0)
    total = sum(t.numel() for t in rank0.values())
    # measured: 0.27% of the weights past that bound (a near-zero gradient whose sign bf16 flips
    # moves Adam's first step by 2 lr); a rank that trained nothing or on the wrong samples: ~100%
    assert off <= 1e-2 * total, (off, total)


def test_every_pass_of_a_step_trains_each_group_on_the_rank_that_trained_it_first(setup):
    # what the first pass kept of a group (its advantages, a critic's values) is on the rank that
    # trained it: a later pass that gave it to the other rank had it counted again by REINFORCE++'s
    # running normaliser and its value clip bounded around that rank's values instead
    resolved, client, pools = setup
    two = Controller(resolved, client, pools)
    two.place_residents()
    scored = two.generate(70) + two.generate(71)
    wait(scored)
    resolved.recipe.trainer.groups_per_micro_batch = 1
    _, passes = submit.epochs(two.topology, two.recipe, 3, 600, scored, True, after=None, samples=4 * len(scored))
    placed = [{x["uid"]: x["trained_on"] for f in run for x in f.result().sample_log} for run in passes]
    assert len(placed[0]) == 4 * len(scored) and set(placed[0].values()) == {"train-0", "train-1"}
    assert placed[1] == placed[0] and placed[2] == placed[0]
