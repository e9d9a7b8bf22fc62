"""Held-out evaluation (``[eval]``): the policy's answers to the task's held-out prompts, scored
by the run's reward, while training goes on.

An evaluation of policy version ``v`` is a batch of Dask tasks like a step's generation --
generate (on the generate pool, after the loads of ``v``), reward (reward pool), and a small
summary -- submitted at a Dask priority below training's generate tasks, so queued training generation
goes first and evaluation fills the generate pool's idle time. (Once started, an evaluation
task holds its slot, and greedy decoding pauses the engine's loop while it runs; what that
costs a run is in docs/benchmarks.md.) An evaluation
that fails is reported in the record (``eval_error``) and training goes on. Its result is merged into the record
of the step during which it finished (``eval/policy_version`` says which policy it was asked of;
``eval/decoded_version_min`` and ``..._max`` the policy versions its responses began decoding
under: in ``async`` and ``stream`` runs a later version's load may come in first).
Evaluations run at the start, every ``eval.every`` steps and after the last step; the last one
is waited for. A checkpoint keeps the versions whose evaluation still ran
(:data:`EVAL_FILE`): a resumed run evaluates the one its weights are again, and records the older
ones as not evaluated (their weights are gone), not leaving them out unsaid.

Metrics: ``eval/reward_mean`` (over every response), ``eval/pass@1`` (per prompt, the share of
its ``k`` responses whose reward reaches ``eval.pass_reward``, averaged: the unbiased pass@1),
``eval/pass@k`` (the share of prompts with at least one such response), ``eval/response_len_mean``,
``eval/prompts``, and ``eval/reward/<name>/mean`` for what the reward reports beside its score.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

from distributed import Client, Future, wait

from streamrl.api import Task
from streamrl.checkpoints import folders
from streamrl.errors import UserError
from streamrl.flow import submit
from streamrl.on_worker import task_functions, weight_tasks
from streamrl.contracts.step_extension import StepExtension
from streamrl.on_worker.resident import ENGINE, resident
from streamrl.recipe.recipe import EvalConfig, Recipe
from streamrl.sample import Group, Prompt
from streamrl.telemetry import spans
from streamrl.telemetry.names import REWARD_NAMES_KEPT
from streamrl.telemetry.text import error_line

#: Dask priority of evaluation's generate tasks: below training's (0 and up), so the generate
#: pool runs them only when no training generation is waiting.
EVAL_PRIORITY = -1

#: The checkpoint's file of evaluations still running when it was written (``{"pending": [versions]}``).
EVAL_FILE = "eval.json"

def eval_groups(prompts: list[Prompt], n: int, greedy: bool, min_version: int = 0, after=None) -> list[Group]:
    """Generate pool: ``n`` responses to each prompt (``greedy``: one argmax response) from the
    engine's current policy (the loads in ``after`` are done); an engine older than
    ``min_version`` (its worker was restarted) catches up first."""
    engine = resident(ENGINE)
    if engine.version < min_version:
        weight_tasks.catch_up(engine, min_version)
    if greedy:
        return engine.generate_greedy(prompts)
    return engine.generate_groups(prompts, n, [float(EVAL_PRIORITY)] * len(prompts))


def eval_summary(groups: list[Group]) -> list[dict]:
    """Reward pool: what the controller needs of each scored group (not the samples)."""
    return [{"rewards": [float(s.reward or 0.0) for s in g], "lengths": [len(s.response_ids) for s in g],
             "info": [s.reward_info for s in g], "versions": [s.policy_version for s in g]} for g in groups]


def metrics(summaries: list[dict], k: int, pass_reward: float = 1.0) -> dict:
    """The ``eval/*`` metrics of one evaluation from its groups' summaries."""
    rewards = [r for g in summaries for r in g["rewards"]]
    lengths = [n for g in summaries for n in g["lengths"]]
    passed = [[r >= pass_reward for r in g["rewards"]] for g in summaries]
    named: dict[str, list[float]] = {}  # what the reward reported beside the score, by name
    for g in summaries:
        for info in g.get("info", []):
            for name, value in info.items():
                named.setdefault(name, []).append(value)
    return {**{f"eval/reward/{name}/mean": sum(v) / len(v) for name, v in sorted(named.items())[:REWARD_NAMES_KEPT]},
            "eval/prompts": len(summaries),
            "eval/reward_mean": sum(rewards) / len(rewards),
            "eval/pass@1": sum(sum(p) / len(p) for p in passed) / len(passed),
            f"eval/pass@{k}": sum(any(p) for p in passed) / len(passed),
            "eval/response_len_mean": sum(lengths) / len(lengths)}


class Evaluator:
    """Submits evaluations and hands back their metrics once they are done; see the module
    docstring."""

    def __init__(self, client: Client, prompts: list[Prompt], cfg: EvalConfig, groups_per_task: int, greedy: bool,
                 generate=eval_groups, where: dict | None = None, tag: str = "", priority: int = EVAL_PRIORITY,
                 **options):
        """``prompts``: the held-out set; ``greedy``: decode greedily (``eval.greedy`` with one
        sample, and an engine that can). A learner's own evaluation (``learners/evaluate.py``)
        passes its ``generate`` function (same arguments as :func:`eval_groups`, and
        ``options``), the pin of its worker (``where``), a key ``tag`` and its ``priority``."""
        self.client, self.cfg, self.per_task = client, cfg, groups_per_task
        self.prompts = prompts[:cfg.max_prompts]
        self.greedy = greedy and cfg.greedy and cfg.samples == 1
        self.pending: list[tuple[int, list[Future]]] = []  # (version, summary futures), oldest first
        self.lost: dict[int, str] = {}  # versions in ``pending`` (without futures) that cannot be evaluated: why
        self.generate, self.tag, self.priority, self.options = generate, tag, priority, options
        self.where = where or {"resources": {"generate": 1}}

    def due(self, version: int, steps: int) -> bool:
        """Whether policy ``version`` is evaluated: the initial one, every ``eval.every``-th, the last."""
        every = self.cfg.every
        return version == 0 or version == steps or bool(every and version % every == 0)

    def submit(self, version: int, after: list[Future] | None = None) -> None:
        """Evaluate policy ``version`` once ``after`` (its weight loads) are done."""
        stamp = time.time_ns()  # fresh keys: a version evaluated again (a resume) is evaluated anew
        # the engine keys requests by uid, and two evaluations may be in flight at once
        prompts = [replace(p, uid=f"v{version}-{p.uid}") for p in self.prompts]
        summaries = []
        with spans.phase(max(version - 1, 0), "eval"):  # (v0, the initial policy: with step 0)
            for i in range(0, len(prompts), self.per_task):
                rest = f"{i:04d}-{stamp}"
                gen = self.client.submit(self.generate, prompts[i:i + self.per_task], self.cfg.samples, self.greedy,
                                         version, after=after, key=spans.step_key(f"eval-generate{self.tag}", version, rest),
                                         priority=self.priority, retries=1, **self.where, **self.options)
                scored = self.client.submit(task_functions.score_groups, gen,
                                            key=spans.step_key(f"eval-reward{self.tag}", version, rest),
                                            resources={"reward": 1}, priority=EVAL_PRIORITY, retries=1)
                summaries.append(self.client.submit(eval_summary, scored,
                                                    key=spans.step_key(f"eval-summary{self.tag}", version, rest),
                                                    resources={"reward": 1}, priority=EVAL_PRIORITY))
        self.pending.append((version, summaries))

    def not_evaluated(self, version: int, why: str) -> None:
        """Policy ``version``'s evaluation cannot run (``why``): recorded in its turn as its ``eval_error``."""
        self.lost[version] = why
        self.pending.append((version, []))

    def ready(self) -> dict:
        """The metrics of the oldest finished evaluation not handed back yet ({}: none)."""
        if self.pending and all(f.done() for f in self.pending[0][1]):
            return self._take()
        return {}

    def for_record(self, last: bool) -> dict:
        """What a step's record gets: the oldest finished evaluation's metrics; after the last
        step (``last``), every evaluation is waited for and the record gets the newest, with any
        others not recorded yet under ``eval_unrecorded``."""
        if not last:
            return self.ready()
        done = self.finish()
        return {**(done[-1] if done else {}), **({"eval_unrecorded": done[:-1]} if len(done) > 1 else {})}

    def finish(self) -> list[dict]:
        """Wait for every evaluation submitted; their metrics, oldest first."""
        out = []
        while self.pending:
            wait(self.pending[0][1])
            out.append(self._take())
        return out

    def cancel(self) -> None:
        """Drop evaluations still running (a stopped run)."""
        self.client.cancel([f for _, fs in self.pending for f in fs])
        self.pending = []

    def _take(self) -> dict:
        version, futures = self.pending.pop(0)
        if not futures and version in self.lost:
            return {"eval/policy_version": version, "eval_error": self.lost.pop(version)}
        try:
            summaries = [g for f in futures for g in f.result()]
        except Exception as exc:  # an evaluation that failed is reported in the record; training goes on
            self.client.cancel(futures)
            return {"eval/policy_version": version, "eval_error": error_line(exc, 500)}
        # the policy the engines decoded with: loads go ahead of evaluation's tasks, so in async
        # and stream runs a later version may have come in first -- said, not hidden under ``version``
        decoded = [v for g in summaries for v in g.get("versions", ())]
        return {"eval/policy_version": version, **metrics(summaries, self.cfg.samples, self.cfg.pass_reward),
                **({"eval/decoded_version_min": min(decoded), "eval/decoded_version_max": max(decoded)}
                   if decoded else {})}


def for_run(client: Client, task: Task, recipe: Recipe, greedy: bool) -> Evaluator | None:
    """The run's evaluator (None without ``[eval]``): the task's held-out prompts, bundled as
    the run bundles its groups; ``greedy``: the engine can decode greedily."""
    if recipe.eval is None:
        return None
    held_out = task.eval_prompts()
    if not held_out:
        raise UserError(f"eval: task {recipe.task.name!r} has no held-out prompts (the dataset task holds some out "
                        "with eval_fraction, eval_split or eval_path)")
    counts = Counter(p.uid for p in held_out)  # (a count per uid: a list's .count for each is quadratic)
    again = sorted(u for u, n in counts.items() if n > 1)
    if again:
        raise UserError(f"task {recipe.task.name!r}: eval_prompts() repeats uid {again[0]!r}; each held-out prompt "
                        "needs its own uid")
    return Evaluator(client, held_out, recipe.eval, submit.groups_per_task(recipe), greedy)


class HeldOutEvaluation(StepExtension):
    """Held-out evaluation as a step extension (``contracts/step_extension.py``): the initial policy once
    the first step's training is submitted, each due version once its weights are loaded, the
    metrics in the records as they finish (all of them by the last step's record)."""

    order = 30

    def __init__(self, evaluator: Evaluator, steps: int):
        self.evaluator, self.steps = evaluator, steps
        self.resumed: tuple[int, list[int]] | None = None  # (policy version, versions pending) of the checkpoint

    def trained(self, step: int, scored: list[Future]) -> None:
        """Evaluate the initial policy (the ``before`` of before/after) beside the first step;
        after a resume, the evaluations its checkpoint still ran (the engines hold its weights now)."""
        if step == 0:
            self.evaluator.submit(0)
        if self.resumed is not None:
            version, pending = self.resumed
            self.resumed = None
            for v in pending:
                if v == version:
                    self.evaluator.submit(v)
                else:
                    self.evaluator.not_evaluated(v, f"not evaluated: the run resumed from a checkpoint written while "
                                                    f"it ran, which holds policy {version}, not {v}")

    def checkpoint(self, next_step: int, previous: Path | None):
        """The versions whose evaluation still runs (or waits for its record) into the checkpoint."""
        pending = [v for v, _ in self.evaluator.pending]

        def write(folder: Path) -> None:
            (folder / EVAL_FILE).write_text(json.dumps({"pending": pending}))
        return write

    def resume(self, checkpoint: Path) -> None:
        """Read the evaluations the checkpoint still ran: submitted again with the next step."""
        path = checkpoint / EVAL_FILE
        pending = json.loads(path.read_text())["pending"] if path.is_file() else []
        self.resumed = (folders.read(checkpoint)["policy_version"], pending) if pending else None

    def published(self, version: int, loads: list[Future]) -> None:
        """Evaluate ``version`` on the generate pool once it holds it, when it is due."""
        if self.evaluator.due(version, self.steps):
            self.evaluator.submit(version, after=loads)

    def record(self, step: int, record) -> None:
        """The oldest finished evaluation's metrics (every one, after the last step)."""
        record.extra.update(self.evaluator.for_record(last=step + 1 == self.steps))

    def close(self) -> None:
        """Drop evaluations still running."""
        self.evaluator.cancel()
