"""Many learners on one stream: ``[[learners]]``, the fan-out, isolation, and adding/removing
learners while a run goes on -- with real Dask workers, real kills and the real CLI."""

from __future__ import annotations

import json
import os
import fcntl
import signal
import socket
import time
import zlib
from pathlib import Path

import pytest

from streamrl.errors import UserError
from streamrl.plugins.resolve import resolve
from streamrl.cluster.pool_workers import worker_spec
from streamrl.recipe.recipe import load_recipe
from tests.helpers import read_records, start, streamrl, until, with_learners


# -- validation (no cluster) ------------------------------------------------------------------
@pytest.mark.parametrize("extra, message", [
    ('[[learners]]\nname = "a"\n[[learners]]\nname = "a"\n', "learners: name 'a' is used twice"),
    ('[[learners]]\nname = "a"\ntrainer = { prompts_per_step = 2 }\n', "learners[0].trainer.prompts_per_step: the batch shape"),
    ('[[learners]]\nname = "a"\nalgorithm = { clip = 0.1 }\n', "learners[0].algorithm.name: required key missing"),
    ('[[learners]]\nname = "Bad-Name"\n', "learners.0.name: String should match pattern"),
    # the engine's name for the served policy's adapter: a learner named so took its slot
    ('[[learners]]\nname = "policy"\n', "learners.0.name: 'policy' is a name streamrl gives to something else"),
])
def test_a_bad_learners_table_is_one_line_naming_it(tiny_recipe, extra, message):
    path = tiny_recipe.with_name("bad.toml")
    path.write_text(tiny_recipe.read_text() + extra)
    with pytest.raises(UserError) as caught:
        load_recipe(path)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_serve_must_name_a_learner(tiny_recipe):
    path = with_learners(tiny_recipe)
    with pytest.raises(UserError, match="run.serve: 'ppo' is not a learner; expected one of grpo, rloo or 'initial'"):
        load_recipe(path, ["run.serve=ppo"])
    with pytest.raises(UserError, match=r"run.serve = 'grpo' needs \[\[learners\]\]"):
        load_recipe(tiny_recipe, ["run.serve=grpo"])
    with pytest.raises(UserError, match=r"^learners\[1\].algorithm.name: .*'nope'"):
        resolve(_with_algo(path, "nope"))


def _with_algo(path: Path, name: str):
    text = path.read_text().replace('algorithm = { name = "rloo" }', f'algorithm = {{ name = "{name}" }}')
    path.write_text(text)
    return load_recipe(path)


def test_the_served_learner_is_the_main_one_and_each_other_gets_its_own_worker(tiny_recipe):
    loaded = load_recipe(with_learners(tiny_recipe), ["run.serve=rloo"])
    resolved = resolve(loaded)
    assert [p.name for p in resolved.learners] == ["rloo", "grpo"]  # the served one trains on the train pool
    assert resolved.learners[0].served and not resolved.learners[1].served
    assert resolved.algorithm.component.name == "rloo" and resolved.trainer.config.lr == 2e-3
    assert resolved.learners[1].trainer.config.lr == 1e-3  # [trainer]'s
    spec = worker_spec(loaded.recipe)
    assert "learner-grpo" in spec and "learner-rloo" not in spec
    assert "train" not in spec["learner-grpo"]["options"]["resources"]  # no train-pool task lands there
    # serving the initial model: the first learner drives the steps, nothing is published
    initial = resolve(load_recipe(with_learners(tiny_recipe), ["run.serve=initial"]))
    assert initial.serves_initial and [p.name for p in initial.learners] == ["grpo", "rloo"]
    assert not any(p.served for p in initial.learners)


# -- a run: fan-out, a failing learner and a killed one --------------------------------------------
FAULTY = '''
"""Algorithms that fail on their learner's worker (tests/test_learners.py)."""
import os

from streamrl.api import hookimpl
from streamrl.algorithms.grpo import GRPO, GRPOConfig
from streamrl.api import Component


class Raises(GRPO):
    calls = 0

    def __init__(self, config):
        super().__init__(config)
        self.zero_advantage_no_gradient = False  # (an untrained model's groups all score 0)

    def loss(self, *args):
        Raises.calls += 1
        if Raises.calls > 1:  # its second micro-batch
            raise RuntimeError("this learner's bug")
        return super().loss(*args)


class Dies(GRPO):
    calls = 0

    def __init__(self, config):
        super().__init__(config)
        self.zero_advantage_no_gradient = False  # (an untrained model's groups all score 0)

    def loss(self, *args):
        Dies.calls += 1
        if Dies.calls > 1:
            os._exit(17)  # the worker process dies (its nanny starts a fresh one)
        return super().loss(*args)


class Explodes(GRPO):
    def __init__(self, config):
        super().__init__(config)
        self.zero_advantage_no_gradient = False

    def loss(self, new, old, ref, adv, mask):
        per_sample, stats = super().loss(new, old, ref, adv, mask)
        return per_sample + (new * mask).sum(-1), stats  # (a gradient whatever the rewards)


@hookimpl
def register_algorithms():
    return [Component("algorithm", "raises", GRPOConfig, Raises), Component("algorithm", "dies", GRPOConfig, Dies),
            Component("algorithm", "explodes", GRPOConfig, Explodes)]
'''


def uid_crcs(records) -> dict[int, int]:
    return {r["step"]: zlib.crc32("\n".join(sorted(x["uid"] for x in r["sample_log"])).encode()) for r in records}


@pytest.mark.slow
@pytest.mark.smoke
def test_learners_share_the_stream_and_a_failing_or_killed_one_leaves_the_others_going(tiny_recipe):
    (tiny_recipe.parent / "faulty.py").write_text(FAULTY)
    more = ('\n[[learners]]\nname = "raises"\nalgorithm = { name = "raises" }\n'
            '\n[[learners]]\nname = "dies"\nalgorithm = { name = "dies" }\n'
            # (an update that moves its weights far past trainer.max_weight_change: applied, broken)
            '\n[[learners]]\nname = "explodes"\nalgorithm = { name = "explodes" }\ntrainer = { lr = 100.0 }\n'
            '\n[plugins]\nmodules = ["faulty.py"]\n')
    path = with_learners(tiny_recipe, more)
    res = streamrl("recipe", "run", str(path), "--plain", "--no-report", "--set", "run.steps=4",
                   "--set", "trainer.groups_per_micro_batch=4")
    assert res.returncode == 0, res.stderr[-3000:]
    run_dir = Path(res.stdout.strip().splitlines()[-1])
    records = read_records(run_dir)
    final = json.loads((run_dir / "learners.json").read_text())
    # generation happened once: every step's samples are the stream's, trained by the main learner
    main = uid_crcs(records)
    # the healthy side learner trained on exactly the stream's samples, each step once, in order;
    # a step it was still two behind on (its queue of 2 full: a loaded machine) is skipped and
    # counted (when_full = "skip"), never lost. The first two steps always find room.
    trained = [t for r in records for t in r["learners"]["rloo"]["trained"]] + final["rloo"]["trained"]
    steps = [t[0] for t in trained]
    assert steps[:2] == [0, 1] and steps == sorted(set(steps)) and steps[-1] <= 3, steps
    assert len(steps) + final["rloo"]["skipped_steps"] == 4, (steps, final["rloo"])
    assert all(samples == 16 and crc == main[step] for step, samples, crc in trained)
    assert final["rloo"]["state"] == "training" and final["rloo"]["steps_trained"] == len(steps)
    # the failing ones are marked failed, each in one line naming it; generation went on
    assert final["raises"]["state"] == "failed" and "RuntimeError: this learner's bug" in final["raises"]["failure"]
    assert final["dies"]["state"] == "failed", final["dies"]
    assert "learner 'raises' failed at step" in res.stderr and "learner 'dies' failed at step" in res.stderr
    assert "Traceback" not in res.stderr
    assert len(records) == 4 and records[-1]["learners"]["grpo"]["steps_trained"] == 4
    # every learner's policy, as a transformers model folder
    for name in ("grpo", "rloo", "raises"):
        assert (run_dir / "policy" / name / "config.json").exists(), name
    # but not the killed one's: its restarted worker holds the base weights, which are not its policy
    assert not (run_dir / "policy" / "dies").exists() and "learner 'dies': policy not saved (ResidentLost" in res.stderr
    # nor the one whose failed update broke its weights: they are not a policy
    assert final["explodes"]["state"] == "failed" and "UpdateBroke" in final["explodes"]["failure"], final["explodes"]
    assert not (run_dir / "policy" / "explodes").exists()
    assert "learner 'explodes': policy not saved (its failed update broke the weights" in res.stderr


@pytest.mark.slow
def test_a_failed_learners_served_variant_is_withdrawn_and_the_others_are_still_served(tmp_path, tiny_model):
    import openai

    from tests.helpers import TINY_RECIPE, served_at, start_serving, stop_serving

    recipe = tmp_path / "serve.toml"
    (tmp_path / "faulty.py").write_text(FAULTY)
    text = TINY_RECIPE.format(out=tmp_path / "runs", model=tiny_model).replace(
        "steps = 2", 'steps = 1000\nstep_timeout_s = 0\nmode = "async"\nmax_staleness = 8')
    text = text.replace("max_new_tokens = 6", 'max_new_tokens = 6\nbatching = "slots"\nslots = 8\nmax_prompt_tokens = 48')
    recipe.write_text(text + '\n[serve]\nport = 0\nsamples_per_step = 8\nreward = "recipe"\n'
                      '\n[[learners]]\nname = "a"\n\n[[learners]]\nname = "raises"\nalgorithm = { name = "raises" }\n'
                      '\n[plugins]\nmodules = ["faulty.py"]\n')
    log = tmp_path / "serve.log"
    proc = start_serving("serve", recipe, log=log)
    try:
        info, run_dir = served_at(proc, tmp_path / "runs", log)
        c = openai.OpenAI(base_url=info["url"], api_key="none", max_retries=0)
        assert [m.id for m in c.models.list().data] == ["tiny", "tiny/a", "tiny/raises"]
        deadline = time.time() + 180
        while time.time() < deadline and "variant 'raises': no longer served (the learner failed)" not in log.read_text():
            c.completions.create(model="tiny", prompt="3+4=", n=4, max_tokens=6)  # (scored by the recipe's reward)
        assert "variant 'raises': no longer served (the learner failed)" in log.read_text(), log.read_text()[-3000:]
        assert [m.id for m in c.models.list().data] == ["tiny", "tiny/a"]
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model="tiny/raises", prompt="3+4=", max_tokens=2)
        assert c.completions.create(model="tiny/a", prompt="3+4=", max_tokens=2).choices
    finally:
        stop_serving(proc)
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


SHARED = ('\n[[learners]]\nname = "x"\nworker = "lora"\ntrainer = { lr = 0.05, lora = { rank = 4, alpha = 8 } }\n'
          '\n[[learners]]\nname = "y"\nworker = "lora"\nalgorithm = { name = "rloo" }\n'
          'trainer = { lr = 0.05, lora = { rank = 8, alpha = 16 } }\n')


def test_learners_naming_one_worker_get_one_worker(tiny_recipe):
    loaded = load_recipe(with_learners(tiny_recipe, SHARED))
    spec = worker_spec(loaded.recipe)
    assert "learner-lora" in spec and "learner-x" not in spec and "learner-y" not in spec
    assert {p.name: p.worker for p in resolve(loaded).learners if not p.served} == {
        "rloo": "learner-rloo", "x": "learner-lora", "y": "learner-lora"}


@pytest.mark.slow
def test_lora_learners_on_one_worker_train_the_stream_over_one_base(tiny_model, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.helpers import parity_recipe

    parity_recipe(tmp_path, tiny_model)  # (a reward with variance: the adapters get a gradient)
    path = with_learners(tmp_path / "tiny.toml", SHARED)
    res = streamrl("recipe", "run", str(path), "--plain", "--no-report", "--set", "run.steps=3")
    assert res.returncode == 0, res.stderr[-3000:]
    run_dir = Path(res.stdout.strip().splitlines()[-1])
    records = read_records(run_dir)
    final = json.loads((run_dir / "learners.json").read_text())
    main = uid_crcs(records)
    for name in ("x", "y"):
        assert final[name]["worker"] == "learner-lora" and final[name]["state"] == "training"
        trained = [t for r in records for t in r["learners"][name]["trained"]] + final[name]["trained"]
        assert trained and all(crc == main[step] for step, _, crc in trained)  # the stream's samples
    # each left its own adapter over the one base: two different policies
    logits = {}
    for name in ("x", "y"):
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model),
                                            run_dir / "policy" / name / "adapter").eval()
        with torch.no_grad():
            logits[name] = adapted(torch.tensor([[1, 5, 6, 7, 8, 9]])).logits
    assert not torch.allclose(logits["x"], logits["y"])
    assert "Traceback" not in res.stderr


# -- add and remove while the run goes on -------------------------------------------------------------------
@pytest.mark.slow
def test_a_learner_added_trains_from_the_next_step_and_one_removed_leaves_the_others(tiny_recipe, tmp_path):
    path = with_learners(tiny_recipe)
    proc = start("recipe", "run", str(path), "--plain", "--no-report", "--set", "run.steps=400",
                 "--set", "run.checkpoint_every=0", group=False)
    try:
        runs = tmp_path / "runs"
        run_dir = until(lambda: next(iter(runs.glob("tiny-*")), None) if runs.exists() else None, 180, every=0.5)
        until(lambda: len(read_records(run_dir, partial=True)) >= 2, 180, every=0.5)
        # a request another run left on the queue (a cluster that outlives its runs) is not this run's
        from distributed import Client, Queue

        from streamrl.learners.control import REQUESTS, scheduler_of

        status = json.loads((run_dir / "status.json").read_text())  # (what tells a killed run from a live one)
        assert status["pid"] == proc.pid and status["host"] == socket.gethostname()
        with Client(scheduler_of(run_dir), timeout=10) as c:
            Queue(REQUESTS, client=c).put({"op": "add", "id": "left-over", "run": str(tmp_path / "another-run"),
                                           "name": "ghost", "table": {"name": "ghost"}})
        # what a recipe's [[learners]] table may not hold, a learner added may not either: one line each
        for bad, says in (("trainer.lr=inf", "expected a finite number"),
                          ("trainer.prompts_per_step=2", "the batch shape is the stream's")):
            refused = streamrl("learners", "add", str(run_dir), "--name", "bad", "--set", bad)
            assert refused.returncode == 2 and says in refused.stderr.strip().splitlines()[-1], refused.stderr
        added = streamrl("learners", "add", str(run_dir), "--name", "dr", "--set", "algorithm.name=dr_grpo",
                         "--from", "initial")
        assert added.returncode == 0, added.stderr
        assert "learner 'dr' (dr_grpo) added on worker learner-dr, from the initial model" in added.stdout
        joined = int(added.stdout.split("trains from step ")[1].split()[0]) - 1  # (0-based)
        until(lambda: any(r["learners"].get("dr", {}).get("steps_trained", 0) >= 2
                          for r in read_records(run_dir, partial=True)), 180, every=0.5)
        removed = streamrl("learners", "remove", str(run_dir), "rloo")
        assert removed.returncode == 0, removed.stderr
        assert "learner 'rloo' removed after" in removed.stdout
        assert (run_dir / "policy" / "rloo" / "config.json").exists()
        n = len(read_records(run_dir, partial=True))
        until(lambda: len(read_records(run_dir, partial=True)) >= n + 3, 180, every=0.5)
        listed = streamrl("learners", "list", str(run_dir))
        assert listed.returncode == 0 and "rloo" in listed.stdout and "removed" in listed.stdout
        assert "ghost" not in listed.stdout
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, err[-3000:]
    records = read_records(run_dir, partial=True)
    dr = [t for r in records for t in r["learners"].get("dr", {}).get("trained", [])]
    main = uid_crcs(records)
    steps = [t[0] for t in dr]
    assert steps and steps[0] == joined and steps == sorted(set(steps))  # from the next step, none twice
    assert all(crc == main[step] for step, _, crc in dr)
    skipped = records[-1]["learners"]["dr"]["skipped_steps"]
    # every step handed over is trained or skipped, counted: each one missing up to the last trained
    # is a skip (a step handed over after it may have been skipped too, so at most the count)
    assert steps[-1] - joined + 1 - len(steps) <= skipped
    rloo = [t for r in records for t in r["learners"]["rloo"]["trained"]]  # until it was removed
    gone = records[-1]["learners"]["rloo"]
    assert gone["state"] == "removed" and [t[0] for t in rloo] == sorted({t[0] for t in rloo})
    assert len(rloo) == gone["steps_trained"] and all(crc == main[step] for step, _, crc in rloo)
    assert rloo[-1][0] + 1 - gone["steps_trained"] <= gone["skipped_steps"]  # from step 0, none lost
    assert os.path.isdir(run_dir / "checkpoints")


@pytest.mark.parametrize("value", [0.5, 1.0])
def test_a_dual_clip_that_would_do_nothing_is_refused(value):
    from streamrl.algorithms.grpo import GRPOConfig

    with pytest.raises(ValueError, match="dual_clip"):
        GRPOConfig(dual_clip=value)
    assert GRPOConfig(dual_clip=0).dual_clip == 0 and GRPOConfig(dual_clip=1.5).dual_clip == 1.5


def test_dual_clip_bounds_what_a_token_far_likelier_than_its_behaviour_policy_pulls():
    """Off-policy, a learner's ratio to the behaviour policy can be far above 1; with a negative
    advantage the plain clipped surrogate then pulls with the whole ratio, dual-clip with c * |A|."""
    import torch

    from streamrl.algorithms.grpo import GRPO, GRPOConfig

    new = torch.tensor([[0.0, 3.0, -3.0]], requires_grad=True)  # ratios 1, e^3, e^-3 to the behaviour log-probs 0
    old, mask, adv = torch.zeros(1, 3), torch.ones(1, 3), torch.tensor([-1.0])
    plain, _ = GRPO(GRPOConfig()).loss(new, old, None, adv, mask)
    (g_plain,) = torch.autograd.grad(plain.sum(), new)
    dual, _ = GRPO(GRPOConfig(dual_clip=3.0)).loss(new, old, None, adv, mask)
    (g_dual,) = torch.autograd.grad(dual.sum(), new)
    assert plain.item() == pytest.approx((1.0 + torch.e ** 3 + 0.8) / 3, rel=1e-5)  # (e^-3 is clipped at 1 - 0.2)
    assert dual.item() == pytest.approx((1.0 + 3.0 + 0.8) / 3, rel=1e-5)
    assert g_plain[0, 1] > 6 and g_dual[0, 1] == 0  # the far-likelier token no longer pulls
    assert g_dual[0, 0] == g_plain[0, 0]  # an in-range token is untouched
    positive, _ = GRPO(GRPOConfig(dual_clip=3.0)).loss(new, old, None, -adv, mask)
    same, _ = GRPO(GRPOConfig()).loss(new, old, None, -adv, mask)
    assert torch.equal(positive, same)  # a positive advantage is already bounded by the clip


def test_behaviour_kl_anchors_the_trained_policy_to_the_behaviour_one():
    """``behaviour_kl``: the k3 estimate of KL(behaviour || trained) on the sampled tokens, ``r - 1 -
    log r``: 0 where the trained policy agrees with the behaviour one, a gradient ``beta * (r - 1)``
    toward it elsewhere -- also on a sample whose advantage is 0, which then is not skipped."""
    import torch

    from streamrl.algorithms.grpo import GRPO, GRPOConfig

    old, mask, adv = torch.zeros(1, 3), torch.ones(1, 3), torch.tensor([0.0])
    new = torch.tensor([[0.0, 1.0, -1.0]], requires_grad=True)  # ratios 1, e, 1/e to the behaviour
    algo = GRPO(GRPOConfig(behaviour_kl=0.5))
    assert not algo.zero_advantage_no_gradient and GRPO(GRPOConfig()).zero_advantage_no_gradient
    # M2PO's mask is chosen over all the micro-batch's tokens: none of them may be left out
    assert not GRPO(GRPOConfig(off_policy={"correction": "m2po"})).zero_advantage_no_gradient
    loss, stats = algo.loss(new, old, None, adv, mask)
    k3 = [0.0, torch.e - 2.0, torch.e ** -1]  # e^d - d - 1
    assert loss.item() == pytest.approx(0.5 * sum(k3) / 3, rel=1e-5)
    assert stats["behaviour_kl_sum"].item() == pytest.approx(sum(k3) / 3, rel=1e-5)
    (g,) = torch.autograd.grad(loss.sum(), new)
    expected = torch.tensor([[0.0, torch.e - 1.0, torch.e ** -1 - 1.0]]) * 0.5 / 3
    assert torch.allclose(g, expected, atol=1e-6)  # descent pulls each token's log-prob back to the behaviour's
    plain, _ = GRPO(GRPOConfig()).loss(new, old, None, adv, mask)
    assert plain.item() == 0.0


@pytest.mark.slow
def test_a_learner_that_is_not_served_runs_at_a_lower_cpu_priority(tiny_recipe):
    """Its worker, and every thread in it (a task's too), is ``nice``-lowered; a stream worker is not."""
    from distributed import Client, SpecCluster

    more = 'nice = 7\n\n[[learners]]\nname = "dpo"\nalgorithm = { name = "dpo" }\n'  # (nice: the rloo table's)
    loaded = load_recipe(with_learners(tiny_recipe, more=more), ["pools.train.nice=5"])
    spec = worker_spec(loaded.recipe)
    assert "learner-grpo" not in spec  # served: on the train pool
    assert spec["train-0"]["options"]["env"]["STREAMRL_NICE"] == "5"  # a pool's own nice
    assert "STREAMRL_NICE" not in spec["reward-0"]["options"]["env"]
    assert spec["learner-dpo"]["options"]["env"]["STREAMRL_NICE"] == "10"  # the default
    assert spec["learner-rloo"]["options"]["env"]["STREAMRL_NICE"] == "7"
    base = os.getpriority(os.PRIO_PROCESS, 0)
    chosen = {name: spec[name] for name in ("learner-rloo", "reward-0")}
    with SpecCluster(workers=chosen, scheduler={"cls": __import__("distributed").Scheduler,
                                                "options": {"host": "127.0.0.1", "dashboard_address": ":0"}},
                     asynchronous=False) as cluster, Client(cluster) as client:
        client.wait_for_workers(2, timeout=60)
        by_name = {w["name"]: a for a, w in client.sync(client.scheduler.identity, n_workers=-1)["workers"].items()}

        def priority():
            return os.getpriority(os.PRIO_PROCESS, 0)  # (on Linux: the calling thread's)

        in_task = {n: client.submit(priority, workers=[a], pure=False).result() for n, a in by_name.items()}
        assert in_task == {"learner-rloo": min(19, base + 7), "reward-0": base}
        on_loop = client.run(priority)
        assert on_loop[by_name["learner-rloo"]] == min(19, base + 7) and on_loop[by_name["reward-0"]] == base


def test_the_learners_commands_on_a_damaged_run_folder_are_one_line(tmp_path):
    from tests.helpers import streamrl

    run = tmp_path / "run"
    run.mkdir()
    # a run killed with -9 leaves "running" behind, and its folder's lock let go: said at once (on
    # a cluster that outlives the run, the scheduler still answers and the request waited 600 s)
    (run / "status.json").write_text(json.dumps({"state": "running", "scheduler": "tcp://127.0.0.1:9", "pid": 12}))
    (run / ".lock").write_text("")
    proc = streamrl("learners", "remove", str(run), "x")
    assert proc.returncode == 2 and "the run's process (pid '12') is gone" in proc.stderr.strip().splitlines()[-1]
    with open(run / ".lock") as held:  # (the run's own hold, from wherever it runs: the scheduler is asked)
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        proc = streamrl("learners", "remove", str(run), "x")
        assert proc.returncode == 2 and "cannot reach the run's scheduler at 'tcp://127.0.0.1:9'" in proc.stderr, proc.stderr
        # an address that is not one (a status.json edited by hand): one line naming it too
        (run / "status.json").write_text(json.dumps({"state": "running", "scheduler": "garbage", "pid": 12}))
        proc = streamrl("learners", "remove", str(run), "x")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert "cannot reach the run's scheduler at 'garbage', status.json's scheduler" in proc.stderr, proc.stderr
    (run / ".lock").unlink()
    cases = [
        ({"status.json": "[]"}, ["add", str(run), "--name", "x"], "expected a JSON object with a 'state'"),
        ({"status.json": "[" * 100_000}, ["remove", str(run), "x"], "cannot be read (RecursionError"),
        ({"status.json": '{"state": "running", "scheduler": 5}'}, ["remove", str(run), "x"], "the run is not running"),
        ({"metrics.jsonl": '{"step": 0, "learners": [1]}\n[1]\n'}, ["list", str(run)], "is not an object of learners"),
        ({"metrics.jsonl": '[1]\n{"loss": 1}\n'}, ["list", str(run)], "no step's record yet"),
        ({}, ["add", str(run), "--name", "x", "--timeout", "nan"], "expected seconds above 0"),
    ]
    # a FIFO where a file goes waits for ever if it is opened: refused without opening it
    os.mkfifo(run / "metrics.jsonl")
    (run / "status.json").unlink()
    os.mkfifo(run / "status.json")
    cases += [({}, ["list", str(run)], "metrics.jsonl: not a file"),
              ({}, ["remove", str(run), "x"], "status.json: cannot be read (ValueError: not a file of at most")]
    for files, args, says in cases[-2:]:
        proc = streamrl("learners", *args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and "Traceback" not in proc.stderr and says in lines[-1], (args, proc.stderr[-500:])
    (run / "metrics.jsonl").unlink()
    (run / "status.json").unlink()
    for files, args, says in cases[:-2]:
        for name, text in files.items():
            (run / name).write_text(text)
        proc = streamrl("learners", *args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and "Traceback" not in proc.stderr and says in lines[-1], (args, proc.stderr[-500:])
        for name in files:
            (run / name).unlink()


@pytest.mark.slow
def test_a_side_learner_whose_state_cannot_be_loaded_on_resume_fails_alone(tiny_recipe, tmp_path):
    # (a checkpoint made with another model or algorithm for it): the load's error was a traceback
    # that ended the whole resume; now that learner fails, in one line, and the rest goes on
    import shutil

    import torch

    from tests.helpers import only_run, rewrite_manifest, sets

    path = with_learners(tiny_recipe)
    proc = streamrl("recipe", "run", str(path), "--plain", "--no-report",
                    *sets("run.steps=4", "run.checkpoint_every=2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = only_run(tmp_path / "runs")
    ckpt = run / "checkpoints" / "step-000002"
    state = ckpt / "learners" / "rloo"
    assert any(state.iterdir())
    shutil.rmtree(state)
    state.mkdir()
    torch.save({"not": torch.zeros(1)}, state / "trainer.pt")  # (loads safely; not a trainer's state)
    rewrite_manifest(ckpt)
    shutil.rmtree(run / "policy")
    resumed = streamrl("recipe", "resume", str(run), "--from", "step-000002", "--plain", "--no-report")
    i = resumed.stderr.find("Traceback")
    assert resumed.returncode == 0 and i < 0, resumed.stderr[max(0, i - 1500):i + 1500]
    said = [line for line in resumed.stderr.splitlines() if "learner 'rloo' failed at step 2" in line]
    assert said and "its state in step-000002 could not be loaded" in said[0], resumed.stderr[-3000:]
    last = read_records(run)[-1]
    assert [r["step"] for r in read_records(run)] == [0, 1, 2, 3]
    assert last["learners"]["rloo"]["state"] == "failed" and last["learners"]["grpo"]["state"] == "training"
    assert (run / "policy" / "grpo" / "config.json").exists()


def test_a_learner_removed_and_added_again_under_its_name_is_served_anew():
    # (the run's calls stood in for: what is registered, started, stopped and told the endpoint)
    # its engine's plugin went with the removal, but the name stayed registered: the new one's
    # server could not start ("no 'streamrl-engine-x' on this worker"); and one removed and added
    # between two looks kept the old one's server
    from types import SimpleNamespace

    from streamrl.learners.served import ServedVariants
    from streamrl.serve import remote_engines

    did = []

    class Client:
        def register_plugin(self, plugin):
            did.append(("register", plugin.name))

        def submit(self, fn, *args, **kwargs):
            did.append((fn.__name__, args[0] if args else None))
            return SimpleNamespace(result=lambda timeout=None: ("http://127.0.0.1:1", "key"))

    resolved = SimpleNamespace(engine=None, model_path=None, recipe=SimpleNamespace(run=SimpleNamespace(seed=0)))
    context = SimpleNamespace(client=Client(), resolved=resolved, recipe=SimpleNamespace(
        cluster=SimpleNamespace(startup_timeout=5)))
    variants = ServedVariants(context, SimpleNamespace(model_name="policy"))
    variants._endpoint = lambda fn, *args: did.append((fn.__name__, args[0]))
    variants._adapter_room = lambda lr: False

    def learner():
        return SimpleNamespace(name="x", state="training", evaluator=None, joined_at=0, last_step=None,
                               view=SimpleNamespace(train_pin={}), plan=SimpleNamespace(resident="t-x", worker=""))

    first = learner()
    learners = {"x": first}
    variants._fanout = lambda: SimpleNamespace(learners=learners)
    variants._sync()
    variants._failed.add("x")  # (its engine could not take its weights once: said once)
    first.state = "removed"
    variants._sync()
    assert "x" not in variants._failed  # (one added again under its name has its own said)
    learners["x"] = second = learner()  # added again under its name
    variants._sync()
    starts = [d for d in did if d[0] == remote_engines.start.__name__]
    assert [d[0] for d in did].count("register") == 2 and len(starts) == 2
    assert variants.serving["x"] is second
    did.clear()
    learners["x"] = learner()  # removed and added again between two looks: the old server goes first
    variants._sync()
    names = [d[0] for d in did]
    assert names.index("remove_variant") < names.index(remote_engines.start.__name__) and "stop" in names


def test_a_side_learner_whose_checkpoint_save_fails_fails_alone_and_the_checkpoint_is_written(tmp_path):
    # (the run's calls stood in for) only a restarted worker was that learner's loss: a save that
    # failed otherwise (its GPU out of memory) failed the whole checkpoint, and the run. A full
    # disk is still the checkpoint's failure (said in one line, the older checkpoints kept).
    from types import SimpleNamespace

    from streamrl.learners import runtime

    failed = []

    raised = [RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")]

    submitted = []

    class Client:
        def submit(self, *args, **kwargs):
            submitted.append(kwargs)

            def result(timeout=None):
                if raised[0] is not None:
                    raise raised[0]
            return SimpleNamespace(result=result)

    def learner(name):
        # (a step still queued: a drain that timed out; the save goes after it)
        lr = SimpleNamespace(name=name, state="training", start=None,
                             plan=SimpleNamespace(resident=f"t-{name}", table={"name": name}, added=False),
                             view=SimpleNamespace(incarnations={}, train_pin={}),
                             inflight=[SimpleNamespace(last=["its-last-optimizer-step"])])
        lr.summary = lambda: {"state": lr.state, "steps_trained": 3}
        return lr

    def fail(lr, step, exc):
        lr.state = "failed"
        failed.append((lr.name, step, type(exc).__name__))

    looks, cancelled = [], []

    def look(step):  # (the fan-out's look at the learners' workers: the third finds it gone)
        looks.append(step)
        if len(looks) == 3:
            fail(fanout.learners["a"], step, RuntimeError("its worker learner-a has been gone for 120s"))

    fanout = SimpleNamespace(client=Client(), learners={"a": learner("a")}, drain=lambda: None, fail=fail, look=look)
    fanout.client.cancel = cancelled.extend
    runtime.checkpoint(fanout, 5, None)(tmp_path)
    saved = json.loads((tmp_path / runtime.STATE).read_text())
    assert failed == [("a", 4, "RuntimeError")] and saved["learners"]["a"]["has_state"] is False
    assert submitted[0]["after"] == ["its-last-optimizer-step"]
    assert not (tmp_path / "learners" / "a").exists()
    # a save that does not come back is waited for while its worker is up (a slow disk), and let
    # go once the worker is found gone for good: that learner's loss, not the checkpoint's
    raised[0], fanout.learners["a"].state = TimeoutError(), "training"
    (tmp_path / "late").mkdir()
    runtime.checkpoint(fanout, 6, None)(tmp_path / "late")
    assert looks == [5, 5, 5] and len(cancelled) == 1
    assert failed[-1] == ("a", 5, "RuntimeError") and not (tmp_path / "late" / "learners" / "a").exists()
    raised[0], fanout.learners["a"].state = OSError(28, "No space left on device"), "training"
    (tmp_path / "next").mkdir()
    with pytest.raises(OSError, match="No space left"):
        runtime.checkpoint(fanout, 7, None)(tmp_path / "next")
    # a save that came back after the step still queued: that step is in the state saved, so it is
    # read before the counts are written (a resume restores them: they must match the weights)
    raised[0] = None

    def harvest(lr):
        lr.inflight.clear()
        lr.summary = lambda: {"state": lr.state, "steps_trained": 4}
    fanout._harvest = harvest
    (tmp_path / "whole").mkdir()
    runtime.checkpoint(fanout, 8, None)(tmp_path / "whole")
    saved = json.loads((tmp_path / "whole" / runtime.STATE).read_text())["learners"]["a"]
    assert saved["has_state"] is True and saved["summary"]["steps_trained"] == 4


def test_a_variant_the_endpoint_cannot_take_off_is_said_and_the_run_goes_on():
    # (the run's calls stood in for) a busy or gone endpoint worker: its timeout ended the run
    from types import SimpleNamespace

    from streamrl.errors import RunWarning
    from streamrl.learners.served import ServedVariants

    variants = ServedVariants(SimpleNamespace(), SimpleNamespace(model_name="policy"))

    def endpoint(fn, *args):
        raise TimeoutError("no answer in 30 s")

    variants._endpoint = endpoint
    variants._stop_server = lambda lr: None
    lr = SimpleNamespace(name="x", state="removed")
    variants._fanout = lambda: SimpleNamespace(learners={"x": lr})
    variants.served, variants.serving = {"x": "policy@x"}, {"x": lr}
    with pytest.warns(RunWarning, match="variant 'policy@x' could not be taken off the endpoint"):
        lines = variants._sync()
    assert lines == ["variant 'x': no longer served (the learner left)"] and not variants.served


def test_a_resumed_side_learner_records_no_evaluation_of_the_policy_it_was_placed_with(tmp_path):
    # (the run's calls stood in for) placing it evaluated its starting policy, unordered with the
    # checkpoint's state loaded after: the base model's figures were recorded as the learner's
    from types import SimpleNamespace

    from streamrl.learners import runtime

    cancelled = []
    evaluator = SimpleNamespace(cancel=lambda: cancelled.append(True))
    lr = SimpleNamespace(name="a", state="training", evaluator=evaluator, plan=SimpleNamespace(resident="t-a"),
                         view=SimpleNamespace(train_pin={}), **{k: 0 for k in runtime.COUNTS})
    fanout = SimpleNamespace(learners={"a": lr}, task=None)
    client = SimpleNamespace(submit=lambda *args, **kwargs: SimpleNamespace(result=lambda: None))
    checkpoint = tmp_path / "step-000004"
    checkpoint.mkdir()
    (checkpoint / runtime.STATE).write_text(json.dumps({"next_step": 4, "learners": {"a": {
        "table": {"name": "a"}, "has_state": True, "summary": {"state": "training", "steps_trained": 4}}}}))
    assert runtime.resume(fanout, client, None, None, checkpoint) is fanout
    assert cancelled == [True] and lr.steps_trained == 4


def test_a_resume_places_again_the_learners_added_while_running_not_those_taken_out_of_the_recipe(
        tmp_path, monkeypatch):
    # (the run's calls stood in for) a checkpoint's learner that is not in the recipe was placed
    # again whatever it was: one the user took out of [[learners]] came back. One added with
    # `learners add` is placed again, in a fan-out that trains in the run's order and evaluates
    from types import SimpleNamespace

    from streamrl.errors import RunWarning
    from streamrl.learners import runtime

    placed = []

    def place_one(client, resolved, plan, pins, joined_at, task=None, model_path=None):
        placed.append((plan.name, task, model_path))
        return SimpleNamespace(name=plan.name, evaluator=None, state="training", **{k: 0 for k in runtime.COUNTS})

    monkeypatch.setattr(runtime, "place_one", place_one)
    monkeypatch.setattr(runtime, "ensure_worker", lambda *args: None)
    monkeypatch.setattr("streamrl.plugins.resolve.learner_plan",
                        lambda resolved, name, table, served: SimpleNamespace(name=name, worker=f"learner-{name}"))
    client = SimpleNamespace(submit=lambda *args, **kwargs: SimpleNamespace(result=lambda: None))
    checkpoint = tmp_path / "checkpoints" / "step-000004"
    checkpoint.mkdir(parents=True)
    summary = {"state": "training", "steps_trained": 4}
    # (added from the served policy: built again from the policy saved then, its reference too,
    # found in the run folder wherever it is now, and said again in the next checkpoint; one
    # whose folder is gone is not placed, said in one line)
    start = tmp_path / "learners" / "start-late-2"
    start.mkdir(parents=True)
    (start / "config.json").write_text("{}")
    (checkpoint / runtime.STATE).write_text(json.dumps({"next_step": 4, "learners": {
        "gone": {"table": {"name": "gone"}, "has_state": True, "summary": summary, "added": False},
        "late": {"table": {"name": "late"}, "has_state": False, "summary": summary, "added": True,
                 "start": "learners/start-late-2"},
        "lost": {"table": {"name": "lost"}, "has_state": False, "summary": summary, "added": True,
                 "start": "learners/nowhere"}}}))
    resolved = SimpleNamespace(recipe=SimpleNamespace())
    task = object()
    with pytest.warns(RunWarning) as said:
        fanout = runtime.resume(None, client, resolved, SimpleNamespace(pins={}), checkpoint, True, task)
    said = [str(w.message) for w in said]
    assert any("learner 'gone' of the checkpoint is no longer in the recipe" in w for w in said), said
    assert any("learner 'lost' (added during the run) cannot be placed again: UserError: it was built from" in w
               for w in said), said
    assert placed == [("late", task, str(start))] and list(fanout.learners) == ["late"]
    assert fanout.learners["late"].start == "learners/start-late-2"
    assert fanout.repeatable is True and fanout.task is task


def test_a_learner_whose_state_cannot_be_loaded_when_added_is_let_go_in_one_line(tiny_recipe, tmp_path, monkeypatch):
    # (the run's calls stood in for) `learners add --resume` with a state it cannot load raised
    # after placing it: its trainer, evaluation engine and evaluation stayed on their worker
    from types import SimpleNamespace

    from streamrl.learners import control, runtime

    resolved = resolve(load_recipe(with_learners(tiny_recipe)))
    saved = tmp_path / "checkpoints" / "step-000003"
    (saved / "learners" / "rloo").mkdir(parents=True)
    (saved / runtime.STATE).write_text(json.dumps({"next_step": 3, "learners": {"rloo": {
        "table": {"name": "rloo", "algorithm": {"name": "rloo"}}, "has_state": True, "summary": {}}}}))
    (saved / "controller.json").write_text("{}")
    monkeypatch.setattr("streamrl.checkpoints.folders.latest", lambda run_dir: saved)
    monkeypatch.setattr(runtime, "ensure_worker", lambda *args: None)
    from dataclasses import make_dataclass

    cancelled, released = [], []
    Placed = make_dataclass("Placed", ["name", "evaluator", "plan", "view", "state", ("start", object, None),
                                       ("joined_at", object, 3),
                                       *[(k, object, 0) for k in runtime.COUNTS]])
    placed = Placed("rloo", SimpleNamespace(cancel=lambda: cancelled.append(True)),
                    SimpleNamespace(resident="trainer-rloo", worker="learner-rloo", algorithm=SimpleNamespace(
                        component=SimpleNamespace(name="rloo"))), SimpleNamespace(train_pin={}), "training")
    monkeypatch.setattr(runtime, "place_one", lambda *args, **kwargs: placed)

    def refused(*args, **kwargs):
        raise RuntimeError("size mismatch for lora_A.default.weight\nmore lines")

    client = SimpleNamespace(submit=lambda *args, **kwargs: SimpleNamespace(result=refused),
                             unregister_worker_plugin=released.append)
    run = SimpleNamespace(resolved=resolved, topology=SimpleNamespace(pins={}, can_grow=False), client=client,
                          task=None)
    side = SimpleNamespace(context=run, fanout=None, add=lambda learner: pytest.fail("it was added"))
    with pytest.raises(UserError, match=r"^learner 'rloo': its state in step-000003 could not be loaded "
                                        r"\(RuntimeError: size mismatch for lora_A.default.weight\)$"):
        control.add(side, tmp_path, 3, {"table": {"name": "rloo"}, "resume": True})
    assert cancelled == [True] and released == ["trainer-rloo", "streamrl-engine-rloo"]
    # a learners.json that does not list it (a KeyError before): the table asked for, the same line
    (saved / runtime.STATE).write_text(json.dumps({"next_step": 3, "learners": {}}))
    with pytest.raises(UserError, match=r"^learner 'rloo': its state in step-000003 could not be loaded"):
        control.add(side, tmp_path, 3, {"table": {"name": "rloo"}, "resume": True})
    # a state that loads: the evaluation of the policy it was placed with is dropped, as on a resume
    cancelled.clear()
    added = []
    client.submit = lambda *args, **kwargs: SimpleNamespace(result=lambda: None)
    side.add = added.append
    assert "added on worker" in control.add(side, tmp_path, 3, {"table": {"name": "rloo"}, "resume": True})
    assert cancelled == [True] and [lr.name for lr in added] == ["rloo"]
