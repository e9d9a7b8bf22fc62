"""The run's step extensions (``contracts/step_extension.py``): which features plug into this run's loop.
The controller calls them; only this module knows which there are."""

from __future__ import annotations

from streamrl.agents.extension import AgentRollouts
from streamrl.contracts.step_extension import RunContext, StepExtension
from streamrl.errors import UserError
from streamrl.extensions import evaluate
from streamrl.extensions.elastic import ElasticGrowth
from streamrl.extensions.sample_moves import SampleMoves
from streamrl.learners.extension import SideLearners
from streamrl.learners.served import ServedVariants
from streamrl.serve.extension import ServedTraffic
from streamrl.tasks.agent import AgentTask
from streamrl.telemetry.text import message_line


class KeepsInitialPolicy(StepExtension):
    """``run.serve = "initial"``: the generate pool keeps the starting model while the learners
    train beside it (each learner's policy is evaluated and saved; none is published)."""

    order = 15
    publishes = False


def for_run(context: RunContext) -> list[StepExtension]:
    """The run's step extensions, sorted by their declared ``order``: the built-ins the recipe
    asks for, then those plugins add (``add_step_extensions``)."""
    r = context.recipe
    out: list[StepExtension] = []
    if isinstance(context.task, AgentTask):  # an agent's rollouts, against endpoints of their own
        out.append(AgentRollouts(context))
    elif r.serve is not None:
        out.append(ServedTraffic(context))
    if context.resolved.serves_initial:
        out.append(KeepsInitialPolicy())
    cfg = r.pools.generate.elastic if r.pools.generate else None
    if cfg is not None and context.topology.can_grow:  # (benchmarks pass no cluster)
        out.append(ElasticGrowth(cfg))
    evaluator = evaluate.for_run(context.client, context.task, r, context.resolved.engine.capabilities().greedy)
    if evaluator is not None:
        out.append(evaluate.HeldOutEvaluation(evaluator, r.run.steps))
    out.append(SideLearners(context))
    out.append(SampleMoves())  # (idle unless the scheduler moves running samples)
    served = next((e for e in out if isinstance(e, ServedTraffic)), None)
    if served is not None and r.serve.variants:
        out.append(ServedVariants(context, served))
    out += from_plugins(context)
    return sorted(out, key=lambda e: e.order)  # (a stable sort: ties keep the order above)


def from_plugins(context: RunContext) -> list[StepExtension]:
    """What each plugin's ``add_step_extensions(context)`` returns. A plugin that raises, or
    returns anything but step extensions, stops the run before its first step, in one line
    naming the plugin: an extension is part of the loop, and a loop without it is not the run
    the recipe asked for."""
    pm = context.resolved.registry.pm
    out: list[StepExtension] = []
    for impl in pm.hook.add_step_extensions.get_hookimpls():
        name = pm.get_name(impl.plugin) or repr(impl.plugin)
        if impl.hookwrapper or impl.wrapper:  # (a wrapper wraps the others' calls: it adds none itself)
            continue
        try:  # each plugin's on its own, so a failure names it; pluggy passes the arguments it declares
            got = impl.function(**{arg: context for arg in impl.argnames})
        except (Exception, SystemExit) as exc:
            raise UserError(f"plugin {name!r}: add_step_extensions failed: {type(exc).__name__}: "
                            f"{message_line(exc)}") from None
        got = [] if got is None else list(got) if isinstance(got, (list, tuple)) else [got]
        wrong = [x for x in got if not isinstance(x, StepExtension)]
        if wrong:
            raise UserError(f"plugin {name!r}: add_step_extensions returned {type(wrong[0]).__name__}, not a "
                            "StepExtension (from streamrl.api import StepExtension)")
        unordered = [x for x in got if isinstance(x.order, bool) or not isinstance(x.order, (int, float))
                     or x.order != x.order]
        if unordered:
            raise UserError(f"plugin {name!r}: step extension {type(unordered[0]).__name__} has order "
                            f"{unordered[0].order!r}; expected a number (lowest is called first)")
        out += got
    return out
