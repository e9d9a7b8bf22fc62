"""The controller: the loop of a run, in the client process. Read this first.

Per step it submits one generate task per prompt group (generate pool), one reward task per
group (reward pool), train tasks on micro-batches of scored groups (train pool), one optimizer
step, and the publication of the new weights to every generate worker. It passes *futures* from
task to task, so Dask moves samples and weights worker to worker; the controller only sees
small stats dicts.

Modes (``run.mode``), one code path:

* ``batch``  -- the trainer waits until every group of the step is scored, then trains.
* ``stream`` -- each scored group goes into the next micro-batch as soon as it is ready
  (``as_completed``), so training overlaps the long tail of generation (StreamRL).
* ``async``  -- as ``stream``, and generation of the next steps is admitted while the trainer
  trains, at most ``run.max_staleness`` versions behind (``flow/admission.py``).
* ``colocated`` -- as ``batch``, but the train workers also hold an engine and take generate
  tasks (``cluster.worker_spec``): every worker generates, then trains -- the verl-like baseline.

Both accumulate gradients over the same samples with the same scaling and step once per batch,
so they produce the same update.
"""

from __future__ import annotations

import math
import time
from functools import partial
from pathlib import Path

from distributed import Client, Future, as_completed, wait

from streamrl.flow import admission, tasks
from streamrl.flow.resident import Resident
from streamrl.recipe import LoadedRecipe, validate_section
from streamrl.telemetry import bubbles


def build_engine(factory, config, model_path: str):
    """Runs on a generate worker: make the engine and load the model."""
    engine = factory(config)
    engine.load(model_path)
    return engine


def build_sim_trainer(engine_config, gpus: int):
    """Runs on the train worker when the engine is simulated: the training cost model."""
    from streamrl.sim.trainer import SimTrainer

    return SimTrainer(engine_config, gpus)


def build_trainer(model_path: str, trainer_cfg, algorithm, temperature: float):
    """Runs on the train worker: the policy, its optimizer, the algorithm."""
    from streamrl.training.trainer import Trainer

    return Trainer(model_path, lr=trainer_cfg.lr, weight_decay=trainer_cfg.weight_decay,
                   algorithm=algorithm, temperature=temperature, warmup_steps=trainer_cfg.warmup_steps)


def affine_latency(c0: float, per_token: float, context: float) -> float:
    """Seconds of one decode step at ``context`` running tokens, from a measured profile."""
    return c0 + per_token * context


class Controller:
    """Owns the run loop; see the module docstring."""

    def __init__(self, loaded: LoadedRecipe, registry, client: Client, pools: dict[str, dict[str, str]]):
        r = self.recipe = loaded.recipe
        self.client = client
        self.model_path = str(loaded.model_path()) if loaded.model_path() else None
        self.task = registry.get("task", r.task.name, "task.name").build(r.task.options(), "task")
        reward = registry.get("reward", r.reward.name, "reward.name")
        validate_section(reward.config, r.reward.options(), "reward")  # fail here if misconfigured
        # Each reward worker builds its own (a reward model loads once per worker, not per task).
        self.build_reward = partial(reward.build, r.reward.options(), "reward")
        self.algorithm = registry.get("algorithm", r.algorithm.name, "algorithm.name").build(
            r.algorithm.options(), "algorithm")
        self.transport = registry.get("transport", r.transfer.name, "transfer.name").build(
            r.transfer.options(), "transfer")
        engine = registry.get("engine", r.engine.name, "engine.name")
        self.engine_config = validate_section(engine.config, r.engine.options(), "engine")
        self.engine_factory = engine.factory
        # a simulated engine (``sim``) brings its own cost-model trainer and needs no model
        self.simulated = getattr(engine.factory, "simulates_training", False)
        self.pools = pools
        self.generate_workers = dict(sorted(pools["generate"].items()))
        # One trainer holds the policy; every train task is pinned to its worker.
        self.train_worker = sorted(pools["train"].items())[0][1]
        # Length ranker (a resident on the rank pool, else the first reward worker) and scheduler
        # (on the client): skewness-aware dispatching, issue #5.
        self.build_ranker = None
        if r.ranker is not None:
            ranker = registry.get("ranker", r.ranker.name, "ranker.name")
            validate_section(ranker.config, r.ranker.options(), "ranker")
            self.build_ranker = partial(ranker.build, r.ranker.options(), "ranker")
        self.scheduler = None
        if r.scheduler is not None:
            self.scheduler = registry.get("scheduler", r.scheduler.name, "scheduler.name").build(
                r.scheduler.options(), "scheduler")
        self.rank_worker = sorted((pools.get("rank") or pools["reward"]).items())[0][1]
        latency_model = getattr(engine.factory, "latency_model", None)
        self.step_latency = latency_model(self.engine_config) if latency_model else None
        self.version = 0
        self.last_step: Future | None = None

    # -- set-up ---------------------------------------------------------------------------
    def place_residents(self) -> None:
        """Register the engine and trainer plugins and build them before the clock starts."""
        r = self.recipe
        gen_threads = r.pools.generate.torch_threads if r.pools.generate else 1
        train_threads = r.pools.train.torch_threads if r.pools.train else 1
        temperature = getattr(self.engine_config, "temperature", 1.0)
        self.client.register_plugin(Resident(
            tasks.ENGINE, partial(build_engine, self.engine_factory, self.engine_config, self.model_path),
            torch_threads=None if self.simulated else gen_threads))
        if self.simulated:
            build = partial(build_sim_trainer, self.engine_config, self.engine_config.train_gpus)
        else:
            build = partial(build_trainer, self.model_path, r.trainer, self.algorithm, temperature)
        self.client.register_plugin(Resident(tasks.TRAINER, build,
                                             torch_threads=None if self.simulated else train_threads))
        self.client.register_plugin(Resident(tasks.REWARD, self.build_reward))
        self.client.register_plugin(bubbles.BusyClock())
        if self.build_ranker is not None:
            self.client.register_plugin(Resident(tasks.RANKER, self.build_ranker))
        futs = [self.client.submit(tasks.warm_up, tasks.ENGINE, key=f"load-engine-{name}", workers=[addr],
                                   allow_other_workers=False) for name, addr in self.generate_workers.items()]
        futs.append(self.client.submit(tasks.warm_up, tasks.TRAINER, key="load-trainer",
                                       workers=[self.train_worker], allow_other_workers=False))
        for f in futs:
            f.result()
        if self.step_latency is None and self.scheduler is not None:
            # a real engine's profile, measured on one instance at start (the instances are alike)
            fit = self.client.submit(tasks.engine_latency, key="engine-latency", pure=False,
                                     workers=[next(iter(self.generate_workers.values()))]).result()
            if fit is not None:
                self.step_latency = partial(affine_latency, *fit)
        self.version = 0
        self.last_step = None
        # async bookkeeping: scored futures of admitted steps, weight loads not yet awaited
        self.in_flight: dict[int, list[Future]] = {}
        self.loads: dict[int, list[Future]] = {}
        self.loaded_version = 0
        self.next_to_admit = 0
        self.clock = bubbles.snapshot(self.client)  # busy clocks at the last step boundary
        # ranking/scheduling state: what was predicted and dispatched per step, what was seen
        self.step_prompts: dict[int, list] = {}
        self.predicted: dict[int, list[float]] = {}
        self.splits: dict[int, int] = {}
        self.observed_lengths: list[int] = []
        self.prompt_tokens = 0.0
        self.last_observe: Future | None = None

    # -- one step -------------------------------------------------------------------------
    def submit_generation(self, step: int) -> list[Future]:
        """Generate + reward tasks for every prompt of ``step``; returns the scored-group futures."""
        t = self.recipe.trainer
        prompts = self.task.prompts(step, t.prompts_per_step)
        self.step_prompts[step] = prompts
        placement = self.dispatch(step, prompts)
        scored = []
        for i, p in enumerate(prompts):
            where = {}
            if i in placement:  # pinned by the scheduler; Dask priority follows the engine's
                addr, prio = placement[i]
                where = {"workers": [addr], "allow_other_workers": False, "priority": int(prio),
                         "engine_priority": prio}
            gen = self.client.submit(tasks.generate_group, p, t.samples_per_prompt, submitted=time.time(),
                                     key=f"generate-{p.uid}", resources={"generate": 1}, retries=1, **where)
            scored.append(self.client.submit(tasks.score_group, gen, key=f"reward-{p.uid}",
                                             resources={"reward": 1}, retries=1))
        return scored

    def dispatch(self, step: int, prompts: list) -> dict[int, tuple[str, float]]:
        """Ranker scores + scheduler placement: ``{prompt index: (worker address, priority)}``
        (empty without a scheduler: Dask places the tasks)."""
        scores = [0.0] * len(prompts)
        if self.build_ranker is not None:
            scores = self.client.submit(
                tasks.rank_prompts, prompts, after=self.last_observe, key=f"rank-{step}",
                workers=[self.rank_worker], allow_other_workers=False).result()
            self.predicted[step] = scores
        if self.scheduler is None:
            return {}
        from streamrl.scheduling.schedulers import DispatchContext

        ctx = DispatchContext(self.recipe.trainer.samples_per_prompt, self.observed_lengths,
                              self.prompt_tokens, self.step_latency)
        placement = {a.index: (self.generate_workers[a.worker], a.priority)
                     for a in self.scheduler.dispatch(prompts, scores, list(self.generate_workers), ctx)}
        self.splits[step] = getattr(self.scheduler, "last_split", 0)
        return placement

    def learn_lengths(self, step: int, record: dict) -> None:
        """After a step: feed the observed lengths to the ranker, log its recall and the dispatch."""
        from streamrl.ranking.recall import top_recall

        log = record["sample_log"]
        by_prompt: dict[str, list[int]] = {}
        for x in log:
            by_prompt.setdefault(x["uid"].rsplit("-", 1)[0], []).append(x["response_len"])
        prompts = self.step_prompts.pop(step)
        lengths = [by_prompt.get(p.uid, []) for p in prompts]
        self.observed_lengths = (self.observed_lengths + [x["response_len"] for x in log])[-8192:]
        self.prompt_tokens = sum(x["prompt_len"] for x in log) / max(len(log), 1)
        record["generate_makespan_s"] = max(x["gen_end"] for x in log) - min(x["submitted"] for x in log)
        if step in self.splits:
            record["long_tail_instances"] = self.splits.pop(step)
        if self.build_ranker is not None:
            actual = [sum(math.log(max(n, 1)) for n in ls) / max(len(ls), 1) for ls in lengths]
            record["ranker_recall"] = top_recall(self.predicted.pop(step), actual, 0.2)
            self.last_observe = self.client.submit(
                tasks.observe_lengths, prompts, lengths, after=self.last_observe, key=f"observe-{step}",
                workers=[self.rank_worker], allow_other_workers=False)

    def submit_training(self, step: int, scored: list[Future], total_samples: int,
                        stream: bool) -> tuple[Future, list[Future]]:
        """Train tasks over the step's scored groups, then one optimizer step.

        ``stream=False`` (batch, colocated): the groups in submission order, once all are scored.
        ``stream=True``: in completion order. Without a token budget, one train task per
        ``groups_per_micro_batch`` ready groups. With ``trainer.micro_batch_tokens``, whatever is
        ready each time fewer than two train tasks are outstanding (one running, one queued), cut
        to the budget on the train worker (``flow/microbatch.py``).
        """
        t = self.recipe.trainer
        dynamic = t.micro_batch_tokens > 0
        trains: list[Future] = []

        def submit(chunk):
            trains.append(self.client.submit(
                tasks.train_groups, *chunk, scale=1.0 / total_samples, micro_batch_tokens=t.micro_batch_tokens,
                groups_per_micro_batch=0 if dynamic else t.groups_per_micro_batch, after=self.last_step,
                key=f"train-{step}-{len(trains):03d}", workers=[self.train_worker], resources={"train": 1}))

        if not stream:
            size = len(scored) if dynamic else t.groups_per_micro_batch
            for i in range(0, len(scored), size):
                submit(scored[i:i + size])
        else:
            ac = as_completed(scored)
            expected, seen, buf = {f.key for f in scored}, 0, []
            for fut in ac:
                if fut.key in expected:
                    buf.append(fut)
                    seen += 1
                if not buf:
                    continue
                if dynamic:
                    # hand over what is ready only when the trainer is about to run dry
                    if sum(not f.done() for f in trains) < 2 or seen == len(scored):
                        submit(buf)
                        buf = []
                        if seen < len(scored):
                            ac.add(trains[-1])  # wake up when it finishes
                elif len(buf) == t.groups_per_micro_batch or seen == len(scored):
                    submit(buf)
                    buf = []
                if seen == len(scored):
                    break
        self.last_step = self.client.submit(
            tasks.optimizer_step, *trains, max_grad_norm=t.max_grad_norm, key=f"optimizer-step-{step}",
            workers=[self.train_worker], resources={"train": 1})
        return self.last_step, trains

    def step(self, step: int) -> dict:
        """Run one full step in the recipe's mode and return its metrics record."""
        mode = self.recipe.run.mode
        t0 = time.time()
        if mode == "async":
            self.admit(step)
            scored = self.in_flight.pop(step)
        else:
            scored = self.submit_generation(step)
        stream = mode in ("stream", "async")
        if not stream:  # batch, colocated: the trainer sees nothing until the whole batch is scored
            wait(scored)
        t = self.recipe.trainer
        step_fut, micro = self.submit_training(step, scored, t.prompts_per_step * t.samples_per_prompt, stream)
        step_stats = step_fut.result()
        t_trained = time.time()
        self.version = step_stats["version"]
        loads = self.transport.publish(self.client, step_fut, self.version, self.train_worker,
                                       self.generate_workers)
        if mode == "async":
            # Weight loading overlaps the next step's training; admit() waits for it only when
            # the staleness bound requires.
            self.loads[self.version] = loads
        else:
            self.wait_loaded(loads)
        before, self.clock = self.clock, bubbles.snapshot(self.client)
        t_end = self.clock[0]
        record = summarize(step, self.version, [f.result() for f in micro], step_stats, t0, t_trained, t_end)
        record["pools"] = bubbles.pool_bubbles(before, self.clock, self.pools)
        # the accounting window runs boundary to boundary, so it includes the controller's own
        # time between steps (writing metrics), which is idle time for every pool too
        record["accounting_window_s"] = round(self.clock[0] - before[0], 4)
        self.learn_lengths(step, record)
        return record

    def wait_loaded(self, loads: list[Future]) -> None:
        """Block until every generate worker has loaded the published weights."""
        wait(loads)
        for f in loads:
            f.result()  # raise if a worker failed to load

    def admit(self, step: int) -> None:
        """Async admission control (``flow/admission.py``): submit generation for the steps
        ``step .. step + max_staleness`` not yet submitted, after waiting for the weight loads
        the staleness bound requires. Generation is paced, never dropped."""
        p = admission.plan(step, self.recipe.run.max_staleness, self.recipe.run.steps - 1,
                           self.next_to_admit, self.loaded_version)
        for v in range(self.loaded_version + 1, p.wait_for_version + 1):
            self.wait_loaded(self.loads.pop(v))
        self.loaded_version = max(self.loaded_version, p.wait_for_version)
        for g in p.admit:
            self.in_flight[g] = self.submit_generation(g)
            self.next_to_admit = g + 1

    def save_policy(self, out: Path) -> str:
        """Write the trained policy as a transformers model folder (after the ranker's last lesson)."""
        if self.last_observe is not None:
            self.last_observe.result()
        return self.client.submit(tasks.save_policy, str(out), after=self.last_step, key="save-policy",
                                  workers=[self.train_worker], allow_other_workers=False).result()


def summarize(step: int, version: int, micro: list[dict], step_stats: dict, t0: float, t_trained: float,
              t_end: float) -> dict:
    """The ``metrics.jsonl`` record of one step from the train tasks' stats and the wall clock."""
    samples = sum(m["samples"] for m in micro)
    # per sample: id, generating version, staleness, timeline (submitted, gen_start, gen_end,
    # reward_end, trained; epoch seconds)
    sample_log = [dict(x, staleness=step - x["version"]) for m in micro for x in m.pop("sample_log", [])]
    tokens = sum(m["tokens"] for m in micro)
    step_s = t_end - t0
    return {
        "step": step,
        "policy_version": version,
        "samples": samples,
        "train_tasks": len(micro),
        "micro_batches": sum(m["micro_batches"] for m in micro),
        "reward_mean": sum(m["reward_sum"] for m in micro) / samples,
        "loss": sum(m["loss_sum"] for m in micro) / samples,
        "clip_frac": sum(m["clip_frac_sum"] for m in micro) / samples,
        "kl": sum(m["kl_sum"] for m in micro) / samples,
        # mean importance weight of the behaviour policy (1 when on-policy or without a cap)
        "behaviour_weight": sum(m.get("behaviour_weight_sum", m["samples"]) for m in micro) / samples,
        "response_len_mean": tokens / samples,
        "reward_errors": sum(m["reward_errors"] for m in micro),
        "generated_policy_version_min": min(m["policy_version_min"] for m in micro),
        # versions between the policy being trained (``step``) and its oldest sample
        "staleness_max": step - min(m["policy_version_min"] for m in micro),
        "grad_norm": step_stats["grad_norm"],
        "samples_per_s": samples / step_s,
        "tokens_per_s": tokens / step_s,
        # generate: from submission to the last sample's end; train: trainer busy seconds;
        # train_tail: from the last sample generated to the optimizer step done (what streaming shrinks)
        "generate_s": max(0.0, max(m["gen_end_max"] for m in micro) - t0),  # async: may end before t0
        "train_s": sum(m["seconds"] for m in micro) + step_stats["seconds"],
        "train_tail_s": t_trained - max(m["gen_end_max"] for m in micro),
        "weight_sync_s": t_end - t_trained,
        "step_s": step_s,
        "time": t_end,
        "sample_log": sample_log,
    }
