"""The dataflow on a real embedded cluster (Nanny worker processes, one per pool)."""

from __future__ import annotations

import operator
import time

import dask
import pytest
import torch
from distributed import wait

from streamrl.cluster import lifecycle
from streamrl.flow import submit
from streamrl.on_worker import task_functions, weight_tasks
from streamrl.on_worker.resident import ENGINE, resident
from streamrl.run.controller import Controller
from streamrl.run.runner import resolve
from streamrl.training.trainer import weights_from_bytes
from tests.helpers import close_cluster, parity_recipe

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def controller(tiny_model, tmp_path_factory):
    loaded = parity_recipe(tmp_path_factory.mktemp("flow"), tiny_model)
    dask_cluster, client = lifecycle.start(loaded.recipe)
    ctl = Controller(resolve(loaded), client, lifecycle.check_pools(client))
    ctl.place_residents()
    yield ctl
    close_cluster(client, dask_cluster)


@pytest.fixture
def fresh(controller):
    """The controller with new engines and trainer at the initial weights, version 0: tests do
    not depend on which ran before."""
    controller.place_residents()
    return controller


def on_generate_worker(ctl, fn):
    name = ctl.topology.generate[0]
    return ctl.client.submit(fn, workers=[name], allow_other_workers=False, pure=False).result()


def engine_logprobs_match_trainer(ctl, key):
    prompt = ctl.task.prompts(step=99, n=1)[0]
    bundle = ctl.client.submit(task_functions.generate_groups, [prompt], 4, key=f"{key}-gen", resources={"generate": 1})
    group = ctl.client.submit(operator.getitem, bundle, 0, key=f"{key}-group")
    recomputed = ctl.client.submit(task_functions.trainer_logprobs, group, key=f"{key}-lp",
                                   workers=[ctl.topology.trainer]).result()
    samples = group.result()
    assert all(len(s.response_ids) > 0 for s in samples)
    for s, lp in zip(samples, recomputed):
        assert len(lp) == len(s.logprobs)
        assert torch.allclose(torch.tensor(s.logprobs), torch.tensor(lp), atol=1e-4), (s.logprobs, lp)
    return samples


def test_pools_are_labelled_workers(controller):
    pools = lifecycle.pool_workers(controller.client)
    assert set(pools["generate"]) == {"generate-0"}
    assert set(pools["train"]) == {"train-0"}
    assert set(pools["reward"]) == {"reward-0"}
    for info in lifecycle.workers(controller.client).values():
        assert info["host"] == "127.0.0.1"
    # set before each worker process started, where glibc reads it (not after, like Nanny env=)
    import os
    threshold = controller.client.run(os.environ.get, "MALLOC_MMAP_THRESHOLD_")
    assert set(threshold.values()) == {lifecycle.PRE_SPAWN_ENV["MALLOC_MMAP_THRESHOLD_"]}


def test_engine_logprobs_match_trainer_logprobs(fresh):
    samples = engine_logprobs_match_trainer(fresh, "check-v0")
    assert {s.policy_version for s in samples} == {0}


def test_step_publishes_weights_to_the_engine_and_the_train_worker_keeps_them(fresh):
    from distributed import Variable

    controller = fresh
    client = fresh.client
    # Dask's Active Memory Manager would drop the train worker's copy of the published weights
    # (the busiest worker's copy) once the engines hold theirs; a generate worker killed then
    # took the last copy with it, and its restart's catch-up waited on a recomputation of the
    # whole step. The train worker is made the busiest here, as on a GPU machine (optimizer
    # state): a result Dask holds counts at once.
    assert not client.amm.running()
    ballast = client.submit(bytes, 200 << 20, workers=[fresh.topology.trainer], pure=False)
    try:
        ballast.result()
        m = controller.step(0)
        assert m["policy_version"] == 1 and m["samples"] == 16
        payload = Variable(weight_tasks.LATEST, client=client).get(timeout=5)
        amm_interval = dask.config.get("distributed.scheduler.active-memory-manager.interval")
        time.sleep(2.5 * dask.utils.parse_timedelta(amm_interval))  # (cycles it would have run)
        holders = {lifecycle.workers(client)[a]["name"] for a in client.who_has([payload])[payload.key]}
        assert fresh.topology.trainer in holders, holders
    finally:  # (the module's cluster goes on to other tests)
        client.cancel(ballast)
    assert on_generate_worker(controller, lambda: resident(ENGINE).version) == 1
    trained = weights_from_bytes(controller.client.submit(task_functions.trainer_weights, key="check-export",
                                                          workers=[controller.topology.trainer]).result())

    def engine_weights():
        return {n: p.detach().clone() for n, p in resident(ENGINE).model.named_parameters()}

    loaded = on_generate_worker(controller, engine_weights)
    assert set(loaded) == set(trained)
    for name in trained:
        assert torch.equal(loaded[name], trained[name]), name
    # and generation now runs the new policy: the trainer's logprobs agree again
    samples = engine_logprobs_match_trainer(controller, "check-v1")
    assert {s.policy_version for s in samples} == {1}


def test_stream_batch_and_the_reference_loop_give_the_same_update_on_the_same_samples(controller):
    scored = controller.generate(50)  # generate + score once, keep the futures
    wait(scored)  # before place_residents() below replaces the engine these tasks run on
    total = 16

    def train(step, ready, stream, tokens=0, groups=1, epochs=1) -> dict:
        controller.place_residents()  # fresh trainer and engine from the initial weights
        controller.recipe.trainer.micro_batch_tokens = tokens
        controller.recipe.trainer.groups_per_micro_batch = groups
        last, passes = submit.epochs(controller.topology, controller.recipe, epochs, step, ready, stream,
                                     after=None, samples=total)
        step_fut = last[0]
        cuts.append(sum(f.result().micro_batches for f in passes[0]))
        step_fut.result()
        return weights_from_bytes(controller.client.submit(task_functions.trainer_weights, after=step_fut,
                                                           key=f"export-{step}",
                                                           workers=[controller.topology.trainer]).result())

    cuts = []
    # stream: completion order, dynamic micro-batches of <= 40 tokens (about one group each);
    # batch: submission order, fixed micro-batches of groups_per_micro_batch groups
    streamed = train(100, scored, stream=True, tokens=40)
    batched = train(101, scored, stream=False, groups=4)
    initial = train(102, [], stream=False)  # no samples: one step with no gradient leaves AdamW at the start
    # algorithm.epochs = 2: a streamed pass, then one more over the whole batch
    twice = train(103, scored, stream=True, tokens=40, epochs=2)
    controller.recipe.trainer.micro_batch_tokens, controller.recipe.trainer.groups_per_micro_batch = 0, 1
    assert cuts[0] > cuts[1] >= 1, cuts  # the same samples really were cut differently
    moved = max((batched[n] - initial[n]).abs().max().item() for n in batched)
    assert moved > 1e-4, "the update must move the weights for the comparison to mean anything"
    # the in-process reference loop, trained on the same samples, is the oracle for both
    from streamrl.flow.placement import trainer_context
    from streamrl.reference import train_step

    def reference(epochs):
        trainer = controller.resolved.trainer.build(trainer_context(controller.resolved))
        train_step(trainer, [g for f in scored for g in f.result()], groups_per_micro_batch=3, epochs=epochs)
        return trainer.named_weights()

    oracle, oracle_twice = reference(1), reference(2)
    assert max((twice[n] - streamed[n]).abs().max().item() for n in twice) > 1e-4, "the second epoch moved"
    # Adam's first step moves each weight by ~lr * sign(gradient). Summing the same gradients in
    # another order can flip the sign of a gradient that is ~0 anyway, so a handful of elements may
    # differ by up to 2 * lr; everything else must agree to 2% of one step. One lost sample out of
    # 16 puts ~12% of the elements off (measured), far above one in ten thousand.
    lr = controller.resolved.trainer.config.lr
    for one, other, label, steps in ((batched, streamed, "stream", 1), (batched, oracle, "reference", 1),
                                     (oracle_twice, twice, "two epochs", 2)):
        off = total_elements = 0
        for name in one:
            gap = (other[name] - one[name]).abs()
            assert gap.max().item() <= 2.2 * lr * steps, (label, name)
            off += int((gap > 0.02 * lr).sum())
            total_elements += gap.numel()
        assert off <= 1e-4 * total_elements, (label, off, total_elements)


def test_a_residents_torch_threads_hold_in_every_thread_that_uses_it_not_only_the_one_that_built_it():
    # torch's thread count is per thread (OpenMP; set once per thread on its first torch call):
    # a trainer built in one Dask thread and used from another, older one ran on one thread
    # whatever pools.train.torch_threads said
    import threading
    from types import SimpleNamespace

    from streamrl.on_worker.resident import Resident

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    plugin = Resident("streamrl-test-threads", dict, torch_threads=2)
    plugin.setup(SimpleNamespace(name="train-0"))
    ran, built, seen = threading.Event(), threading.Event(), {}

    def task_thread():  # like a Dask executor thread: it ran torch before the component existed
        seen["first"] = torch.get_num_threads()
        ran.set()
        built.wait(10)
        plugin.get()
        seen["uses"] = torch.get_num_threads()

    def builder():
        plugin.get()
        seen["builds"] = torch.get_num_threads()
        built.set()

    try:
        threads = [threading.Thread(target=task_thread), threading.Thread(target=builder)]
        threads[0].start()
        ran.wait(10)
        threads[1].start()
        for t in threads:
            t.join()
        assert seen == {"first": 1, "builds": 2, "uses": 2}
    finally:
        torch.set_num_threads(before)
