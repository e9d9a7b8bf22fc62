"""The controller's logic: every mode over a few steps of the simulated engine and trainer on an
in-process Dask cluster (real scheduler and workers, as threads of this process). Each test
starts or uses a cluster, so all are marked slow."""

from __future__ import annotations

import re
import time

import pytest
from distributed import Client, Scheduler, SpecCluster, Worker

from streamrl.checkpoints import saving
from streamrl.run.controller import Controller
from streamrl.plugins.resolve import resolve
from streamrl.recipe.recipe import load_recipe
from tests.helpers import ROOT, close_cluster

pytestmark = pytest.mark.slow

W3 = str(ROOT / "recipes" / "paper-7b-20k.toml")
SMALL = ["pools.generate.workers=2", "pools.generate.threads=8", "trainer.prompts_per_step=6",
         "trainer.samples_per_prompt=2", "engine.time_scale=0.0002", "trainer.micro_batch_tokens=0",
         "trainer.groups_per_micro_batch=2"]


@pytest.fixture(scope="module")
def client():
    yield from four_workers()


def four_workers():
    """A client of an in-process cluster of two generate workers, a train and a reward worker."""
    import torch

    threads = torch.get_num_threads()  # residents set torch threads, here in this very process
    spec = {}
    for pool, n in [("generate", 2), ("train", 1), ("reward", 1)]:
        for i in range(n):
            slots = 8 if pool == "generate" else 1
            spec[f"{pool}-{i}"] = {"cls": Worker, "options": {"name": f"{pool}-{i}", "nthreads": slots,
                                                              "resources": {pool: slots}, "host": "127.0.0.1"}}
    cluster = SpecCluster(workers=spec, scheduler={"cls": Scheduler, "options": {"host": "127.0.0.1",
                                                                                 "dashboard_address": ":0"}})
    c = Client(cluster)
    try:
        c.wait_for_workers(4, timeout=120)
        yield c
    finally:
        close_cluster(c, cluster)
        torch.set_num_threads(threads)


def run_steps(client, overrides, steps=3, controller=None, feed=False):
    from streamrl.cluster import lifecycle

    resolved = resolve(load_recipe(W3, SMALL + overrides + [f"run.steps={steps}"]))
    ctl = Controller(resolved, client, lifecycle.pool_workers(client))
    ctl.place_residents()
    if controller is not None:
        controller.append(ctl)
    return [ctl.step(s, start_next_training=feed) for s in range(steps)]


def test_each_steps_tasks_run_in_a_dask_span_of_that_step_and_phase(client):
    """The dashboard's span views break time down by step and phase: a step's generate, reward,
    train and publish tasks (async: submitted during the step before) sit in its own spans."""
    run_steps(client, ["run.mode=async", "run.max_staleness=1"], steps=3)

    def spans_of_tasks(dask_scheduler):
        ext = dask_scheduler.extensions["spans"]
        return {str(tg.name): ext.spans[tg.span_id].name for tg in dask_scheduler.task_groups.values()
                if tg.span_id and tg.name.split("-")[0] in ("generate", "reward", "train", "optimizer", "export",
                                                             "load")}

    def all_span_names(dask_scheduler):
        return sorted({s.name for s in dask_scheduler.extensions["spans"].spans.values()})

    live = client.run_on_scheduler(spans_of_tasks)
    for group, name in live.items():  # those still held (e.g. the last step's)
        step = int(group.rsplit("-", 1)[1]) - (1 if group.startswith(("export", "load")) else 0)
        phase = {"optimizer": "train", "export": "publish", "load": "publish"}.get(group.split("-")[0],
                                                                                    group.split("-")[0])
        assert name == (f"step {step}", phase), (group, name)
    names = client.run_on_scheduler(all_span_names)
    for step in range(3):
        for phase in ("generate", "reward", "train", "publish"):
            assert (f"step {step}", phase) in names, (step, phase, names)

    def spans_named(dask_scheduler):
        out = {}
        for sp in dask_scheduler.extensions["spans"].spans.values():
            out[sp.name] = out.get(sp.name, 0) + 1
        return out

    # one span per step and phase, however many calls submitted its tasks (12 groups a step here)
    counts = client.run_on_scheduler(spans_named)
    assert counts[("step 1", "generate")] == 1 and counts[("step 1", "train")] == 1, counts


@pytest.mark.parametrize("mode", ["batch", "stream", "async"])
def test_every_mode_trains_every_sample_once_in_order(client, mode):
    records = run_steps(client, [f"run.mode={mode}", "run.max_staleness=1"])
    assert [r["policy_version"] for r in records] == [1, 2, 3]
    uids = [x["uid"] for r in records for x in r["sample_log"]]
    assert len(uids) == len(set(uids)) == 3 * 12  # none lost, none twice
    for r in records:
        assert r["samples"] == 12 and {x["uid"].split("-")[0] for x in r["sample_log"]} == {str(r["step"])}
        assert r["staleness_max"] <= (1 if mode == "async" else 0)
        assert set(r["pools"]) >= {"generate", "train", "reward"}
        assert r["clip_frac"] == 0.0 and r["behaviour_weight"] == 1.0  # defaults of a trainer without them
    if mode != "async":
        assert all(r["generated_policy_version_min"] == r["step"] for r in records)


def scheduler_keys(client, prefix: str | tuple[str, ...]) -> list[str]:
    """Keys on the scheduler whose text (a tuple key's parts joined by ``-``) starts with ``prefix``."""
    def text(k):
        return "-".join(map(str, k)) if isinstance(k, tuple) else str(k)

    return client.run_on_scheduler(lambda dask_scheduler: [text(k) for k in dask_scheduler.tasks
                                                            if text(k).startswith(prefix)])


@pytest.mark.parametrize("epochs", [1, 2])
def test_a_fed_async_run_hands_the_next_step_over_early_trains_every_sample_once_and_keeps_no_lineage(client, epochs):
    made = []
    overrides = ["run.mode=async", "run.max_staleness=1", f'algorithm={{name="grpo", epochs={epochs}}}']
    records = run_steps(client, overrides, steps=5, controller=made, feed=True)
    ctl = made[0]
    assert [r["policy_version"] for r in records] == [1, 2, 3, 4, 5]
    uids = [x["uid"] for r in records for x in r["sample_log"]]
    assert len(uids) == len(set(uids)) == 5 * 12  # none lost, none twice
    for r in records:
        assert {x["uid"].split("-")[0] for x in r["sample_log"]} == {str(r["step"])}
        assert r["staleness_max"] <= 1
    # each step ran boundary to boundary: the step times add up to the wall time of steps 2-5
    assert sum(r["step_s"] for r in records[1:]) == pytest.approx(records[-1]["time"] - records[0]["time"], abs=1e-3)
    # no step waits for the one before through a Dask dependency: the scheduler keeps nothing of
    # the first steps (a chain of dependencies would keep the whole run's lineage)
    assert ctl.next_training is None and not scheduler_keys(client, ("train-0-", "optimizer-step-0", "generate-0-"))
    # the feed itself: run one step more by hand and catch the next step's training submitted
    # before the controller is asked for that step
    ctl.recipe.run.steps = 7
    ctl.mode.last_step = 6
    ctl.step(5, start_next_training=True)
    assert ctl.next_training is not None and ctl.next_training.step == 6
    ctl.next_training.result()  # its train tasks are submitted
    # (the submission travels on the client's batched stream and this question on its own
    # connection, so the scheduler may hear the question first: ask until it knows, bounded)
    deadline = time.monotonic() + 30
    while not scheduler_keys(client, "train-6-") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert scheduler_keys(client, "train-6-")
    assert ctl.step(6)["samples"] == 12


@pytest.mark.parametrize("mode", ["batch", "async"])
def test_epochs_step_the_optimizer_once_per_pass_and_publish_once_per_step(client, mode):
    from streamrl.on_worker.resident import TRAINER, resident

    made = []
    records = run_steps(client, [f"run.mode={mode}", 'algorithm={name="grpo", epochs=3}'], controller=made)
    assert [r["policy_version"] for r in records] == [1, 2, 3]  # versions count batches
    assert all(r["epochs"] == 3 and r["samples"] == 12 for r in records)  # the first pass's samples only
    ctl = made[0]
    steps = ctl.client.submit(lambda: resident(TRAINER).version, workers=[ctl.topology.trainer], pure=False).result()
    assert steps == 9  # three optimizer steps per batch


@pytest.mark.parametrize("scheduler", ["", 'scheduler={name="skew"}'])
def test_groups_per_task_bundles_groups_and_still_trains_every_sample_once(client, scheduler):
    made = []
    overrides = ["run.mode=stream", "pools.generate.groups_per_task=4", "trainer.groups_per_micro_batch=4"]
    records = run_steps(client, overrides + ([scheduler, 'ranker={name="oracle"}'] if scheduler else []),
                        steps=2, controller=made)
    for r in records:
        uids = [x["uid"] for x in r["sample_log"]]
        assert len(uids) == len(set(uids)) == 12
    # 6 prompts in bundles of at most 4 (a scheduler bundles only groups it sent to one worker)
    keys = [k[1] for k in made[0].client.who_has() if isinstance(k, tuple) and k[0] == "generate-1"]
    sizes = sorted(1 + int(k.split("+")[1]) if "+" in k else 1 for k in keys)
    assert sum(sizes) == 6 and max(sizes) <= 4 and len(keys) < 6, keys


def test_scheduler_places_groups_and_reports_its_metrics(client):
    records = run_steps(client, ['scheduler={name="skew"}', 'ranker={name="oracle"}'], steps=2)
    for r in records:
        assert "long_tail_instances" in r and 0.0 <= r["ranker_recall"] <= 1.0 and r["generate_makespan_s"] > 0


def test_async_resume_regenerates_what_was_in_flight_and_trains_each_step_once(client, tmp_path):
    from streamrl.cluster import lifecycle
    from streamrl.checkpoints import folders

    def controller(steps):
        resolved = resolve(load_recipe(W3, SMALL + ["run.mode=async", "run.max_staleness=2", f"run.steps={steps}",
                                                    "run.keep_checkpoints=1"]))
        ctl = Controller(resolved, client, lifecycle.pool_workers(client))
        ctl.place_residents()
        return ctl

    first = controller(6)
    done = [first.step(s) for s in range(3)]  # steps 3 and 4 are generating ahead now
    saving.checkpoint(first, tmp_path, 3, len(done))
    saving.checkpoint(first, tmp_path, 3, len(done))  # written twice: replaced, and only the newest is kept
    assert [p.name for p in folders.folder(tmp_path).iterdir()] == ["step-000003"]

    first.close()  # its cluster would be gone after a crash; here the same one goes on
    again = controller(6)  # a new controller and fresh residents, as after a crash
    assert again.resume(folders.latest(tmp_path)) == 3 and again.version == 3
    rest = [again.step(s) for s in range(3, 6)]
    assert [r["policy_version"] for r in rest] == [4, 5, 6]
    uids = [x["uid"] for r in done + rest for x in r["sample_log"]]
    assert len(uids) == len(set(uids)) == 6 * 12
    for r in rest:
        assert {x["uid"].split("-")[0] for x in r["sample_log"]} == {str(r["step"])}
        assert min(x["version"] for x in r["sample_log"]) >= 3, [(r["step"], sorted({x["version"] for x in r["sample_log"]})) for r in rest]  # generated after the restore, never from v0


def test_a_weight_load_that_never_finishes_ends_in_one_line_not_a_hang(client):
    import time

    from streamrl.errors import RunStopped
    from streamrl.flow.weights import wait_loaded

    # (RunStopped: the run's line names the checkpoint it can go on from, and the resume command)
    stuck = client.submit(time.sleep, 3, key="load-weights-7-generate-0", resources={"generate": 1})
    with pytest.raises(RunStopped, match="weight load load-weights-7-generate-0 did not finish within 0 s"):
        wait_loaded([stuck], timeout=0.3)
    client.cancel(stuck)


def test_pools_are_read_fresh_even_while_the_client_refreshes_its_cache():
    """``client.scheduler_info()`` can return no workers when the client's own periodic refresh
    (which fetches none) lands between its fetch and its return; the pools must never be empty."""
    import dask
    from distributed import LocalCluster

    from streamrl.cluster import lifecycle

    with dask.config.set({"distributed.client.scheduler-info-interval": "1ms"}):
        with LocalCluster(n_workers=1, processes=False, protocol="tcp://", host="127.0.0.1",
                          dashboard_address=None, resources={"train": 1}) as lc, Client(lc) as c:
            assert all(list(lifecycle.pool_workers(c)["train"]) and lifecycle.worker_pins(c) for _ in range(200))


def test_the_ranker_is_built_with_the_models_before_the_first_step(client):
    from distributed import get_worker

    from streamrl.cluster import lifecycle
    from streamrl.on_worker.resident import RANKER

    resolved = resolve(load_recipe(W3, SMALL + ['scheduler={name="skew"}', 'ranker={name="learned"}']))
    ctl = Controller(resolved, client, lifecycle.pool_workers(client))
    ctl.place_residents()
    built = client.submit(lambda: get_worker().plugins[RANKER].obj is not None, workers=[ctl.topology.rank],
                          pure=False).result()
    assert built  # not left for the first step's placement to build (and import torch) on its critical path


def test_a_scheduler_whose_observe_raises_is_warned_about_once_and_the_steps_go_on(client):
    from streamrl.cluster import lifecycle
    from streamrl.errors import RunWarning
    from streamrl.scheduling.longtail import LongTail, LongTailConfig

    class Forgetful(LongTail):
        calls = 0

        def observe(self, prompts, lengths):
            Forgetful.calls += 1
            raise RuntimeError("lost its notes")

    resolved = resolve(load_recipe(W3, SMALL + ['scheduler={name="longtail"}', 'ranker={name="learned"}',
                                                "run.steps=3"]))
    ctl = Controller(resolved, client, lifecycle.pool_workers(client))
    ctl.place_residents()
    ctl.dispatcher.scheduler = Forgetful(LongTailConfig())  # a plugin's mistake, after placement
    with pytest.warns(RunWarning, match=r"scheduler: observe\(\) raised RuntimeError: lost its notes"):
        records = [ctl.step(s) for s in range(3)]
    assert Forgetful.calls == 1  # said once, then left out
    assert [r["samples"] for r in records] == [12, 12, 12]
    assert all(0.0 <= r["ranker_recall"] <= 1.0 for r in records)  # the ranker still learns and ranks


def test_a_scheduler_plugin_that_raises_or_reports_odd_numbers_is_warned_about_and_the_steps_go_on(client):
    import numpy as np

    from streamrl.cluster import lifecycle
    from streamrl.errors import RunWarning
    from streamrl.scheduling.schedulers import FCFS, FCFSConfig

    class Wayward(FCFS):
        placements = 0

        def needs_scores(self, workers, ctx):
            raise KeyError("ctx")

        def dispatch(self, prompts, scores, workers, ctx):
            Wayward.placements += 1
            if Wayward.placements == 1:
                raise RuntimeError("no plan yet")
            return super().dispatch(prompts, scores, workers, ctx)

        def metrics(self):
            return {"spread": np.float32(0.5), "label": "wide", "step": 99}

    resolved = resolve(load_recipe(W3, SMALL + ['scheduler={name="fcfs"}', 'ranker={name="oracle"}', "run.steps=3"]))
    ctl = Controller(resolved, client, lifecycle.pool_workers(client))
    ctl.place_residents()
    ctl.dispatcher.scheduler = Wayward(FCFSConfig())  # a plugin's mistakes, after placement
    with pytest.warns(RunWarning) as said:
        records = [ctl.step(s) for s in range(3)]
    lines = [str(w.message) for w in said if issubclass(w.category, RunWarning)]
    for expected in [r"scheduler Wayward: needs_scores\(\) raised KeyError: 'ctx'; the ranker scores every step",
                     r"scheduler Wayward: dispatch\(\) raised RuntimeError: no plan yet; this step's groups are "
                     r"placed by Dask",
                     r"scheduler Wayward: metrics\(\) gave 'label' as a str, not a number; that field is left out",
                     r"the step record's field 'step' is streamrl's own"]:
        assert sum(bool(re.match(expected, line)) for line in lines) == 1, (expected, lines)  # each said once
    assert [r["samples"] for r in records] == [12, 12, 12] and Wayward.placements == 3
    assert [r["step"] for r in records] == [0, 1, 2]  # a plugin's "step" does not renumber the run
    assert "spread" not in records[0] and [r["spread"] for r in records[1:]] == [0.5, 0.5]
    assert all("label" not in r for r in records)
    assert all(0.0 <= r["ranker_recall"] <= 1.0 for r in records)  # ranked every step


def test_a_plugins_step_extension_that_raises_stops_the_run_in_one_line_naming_it(client, tmp_path):
    import json

    import numpy as np
    import torch

    from streamrl.api import StepExtension
    from streamrl.cluster import lifecycle
    from streamrl.errors import RunFailed

    class Odd(StepExtension):
        def record(self, step, record):  # numbers of numpy's and torch's, and an object: made plain
            record.extra.update({"seen": np.int64(step), "ones": torch.ones(2), "scalar": torch.tensor(0.25)})

        def between_steps(self, done, run_dir):
            return None  # (no lines)

    class Broken(StepExtension):
        def trained(self, step, scored):
            if step == 1:
                raise ZeroDivisionError("no groups to divide")

    resolved = resolve(load_recipe(W3, SMALL + ["run.steps=3"]))
    ctl = Controller(resolved, client, lifecycle.pool_workers(client))
    ctl.extensions += [Odd(), Broken()]  # (as a plugin's add_step_extensions adds them)
    ctl.place_residents()
    first = ctl.step(0)
    json.dumps(first, allow_nan=False)
    assert (first["seen"], first["ones"], first["scalar"]) == (0, "tensor([1., 1.])", 0.25)
    assert ctl.between_steps(1, tmp_path) == []
    with pytest.raises(RunFailed, match=r"^step extension test_a_plugins_step_extension_that_raises_stops_the_run_in_"
                                        r"one_line_naming_it.<locals>.Broken \(module tests.test_controller\): "
                                        r"trained\(\) raised ZeroDivisionError: no groups to divide; the run stopped"):
        ctl.step(1)
    ctl.close()

    class Empty(Exception):
        pass

    def prompts(step, n):
        raise Empty("the source ran dry")

    again = Controller(resolved, client, lifecycle.pool_workers(client))
    again.place_residents()
    again.task.prompts = prompts  # a task's code that fails at run time, not at validation
    with pytest.raises(RunFailed, match=r"^task '[^']+': prompts\(\) for step 1 raised Empty: the source ran dry$"):
        again.step(0)
    again.close()
