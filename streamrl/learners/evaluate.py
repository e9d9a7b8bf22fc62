"""Each learner's policy on the held-out prompts (``[eval]``), where its weights already live.

The served policy is evaluated on the generate pool (``extensions/evaluate.py``). A side learner's
policy is on its own worker: an engine of the recipe's kind is kept there too (a second resident,
``streamrl-engine-<name>``), loads the trainer's weights in the same process -- no transfer, no
publication -- and answers the same held-out prompts, scored on the reward pool by the run's
reward. Nothing of it touches the generate pool, so the stream is not disturbed; on the learner's
worker it runs right after the optimizer step it measures (a priority above its next step's train
tasks), which may delay that learner by the evaluation's time.
"""

from __future__ import annotations

from functools import partial

from distributed import Client

from streamrl.extensions.evaluate import Evaluator, for_run
from streamrl.flow.placement import build_engine
from streamrl.on_worker.resident import Resident, expect, resident
from streamrl.sample import Group, Prompt


def engine_resident(learner: str) -> str:
    """The name a learner's evaluation engine is held under on its worker."""
    return f"streamrl-engine-{learner}"


def learner_eval_groups(prompts: list[Prompt], n: int, greedy: bool, min_version: int = 0, after=None,
                        trainer: str = "", engine: str = "", trainer_id: dict | None = None) -> list[Group]:
    """A learner's worker: its engine takes the trainer's current weights, then answers
    ``prompts`` (as ``extensions/evaluate.eval_groups``). ``trainer_id``: the trainer's
    incarnation (a worker restarted since holds a fresh trainer at the base weights, which
    must not be evaluated as the learner's policy: :class:`ResidentLost`)."""
    expect(trainer, trainer_id)
    eng, held = resident(engine), resident(trainer)
    if getattr(eng, "trainer_version", None) != held.version:
        # (served beside the run's policy, the engine numbers versions by the stream's steps:
        # ``serve/remote_engines.refresh``)
        eng.load_weights(held.named_weights(), held.version + getattr(eng, "version_offset", 0))
        eng.trainer_version = held.version
    groups = eng.generate_greedy(prompts) if greedy else eng.generate_groups(prompts, n, [0.0] * len(prompts))
    for s in (s for g in groups for s in g):  # (in the learner's numbering, as its evaluation is labelled)
        s.policy_version = held.version
    return groups


def evaluator(client: Client, resolved, task, name: str, trainer: str, pin: dict, resource: str,
              greedy: bool, trainer_id: dict | None = None) -> Evaluator | None:
    """The evaluation of learner ``name`` (trainer resident ``trainer`` on the worker ``pin``
    names, incarnation ``trainer_id``), or None without ``[eval]``; registers its engine resident."""
    base = for_run(client, task, resolved.recipe, greedy)
    if base is None:
        return None
    r = resolved.recipe
    engine = engine_resident(name)
    client.register_plugin(Resident(engine, partial(build_engine, resolved.engine, resolved.model_path),
                                    seed=r.run.seed, what=f"learner {name!r}'s evaluation engine"))
    where = {**pin, "resources": {**pin.get("resources", {}), resource: 1}}
    # (priority 1: before the learner's next train tasks, right after the step it measures)
    return Evaluator(client, base.prompts, base.cfg, base.per_task, greedy, generate=learner_eval_groups,
                     where=where, tag=f"-{name}", priority=1, trainer=trainer, engine=engine, trainer_id=trainer_id)
