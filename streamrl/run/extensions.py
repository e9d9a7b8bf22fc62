"""The run's step extensions (``extensions/step_extension.py``): which features plug into this run's loop.
The controller calls them; only this module knows which there are."""

from __future__ import annotations

from streamrl.agents.extension import AgentRollouts
from streamrl.tasks.agent import AgentTask
from streamrl.extensions import evaluate
from streamrl.extensions.elastic import ElasticGrowth
from streamrl.extensions.sample_moves import SampleMoves
from streamrl.extensions.step_extension import StepExtension
from streamrl.learners.extension import SideLearners
from streamrl.serve.extension import ServedTraffic
from streamrl.learners.served import ServedVariants


def for_run(ctl) -> list[StepExtension]:
    """The run's step extensions, in the order they are called: the elastic pool (when the
    recipe asks for one and the cluster can grow), held-out evaluation (``[eval]``), the side
    learners (always: they can be added while the run goes on). Evaluation comes before the
    learners: their record repeats the main learner's evaluation. The mover of running samples
    comes after them, idle unless the scheduler moves samples. Agent rollouts (``[task] name =
    "agent"``), or else served traffic (``[serve]``), come first: they supply the steps' samples;
    the side learners' policies served beside the run's (``serve.variants``) come last."""
    r = ctl.recipe
    out: list[StepExtension] = []
    if isinstance(ctl.task, AgentTask):  # an agent's rollouts, against endpoints of their own
        out.append(AgentRollouts(ctl))
    elif r.serve is not None:
        out.append(ServedTraffic(ctl))
    cfg = r.pools.generate.elastic if r.pools.generate else None
    if cfg is not None and ctl.topology.can_grow:  # (benchmarks pass no cluster)
        out.append(ElasticGrowth(cfg))
    evaluator = evaluate.for_run(ctl.client, ctl.task, r, ctl.resolved.engine.capabilities().greedy)
    if evaluator is not None:
        out.append(evaluate.HeldOutEvaluation(evaluator, r.run.steps))
    out.append(SideLearners(ctl))
    out.append(SampleMoves())  # (idle unless the scheduler moves running samples)
    served = next((e for e in out if isinstance(e, ServedTraffic)), None)
    if served is not None and r.serve.variants:  # after the learners: it serves the policies they train
        out.append(ServedVariants(ctl, served))
    return out
