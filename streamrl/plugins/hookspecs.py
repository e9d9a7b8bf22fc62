"""Hook specifications: the contract between streamrl and its plugins.

Every replaceable piece of streamrl is a *component* (see :mod:`streamrl.api` for the ten kinds
and their base classes) handed over by a plugin through one of the ``register_*`` hooks below.
The built-ins are registered exactly the same way (``streamrl/plugins/builtins.py``), so nothing you
write is a second-class citizen.

A plugin is a module (or an installed package with a ``streamrl`` entry point, or a file named
in a recipe's ``[plugins] modules``) that implements some of these hooks with
``@streamrl.hookimpl``::

    from streamrl.api import Component, Reward, hookimpl

    @hookimpl
    def register_rewards():
        return [Component("reward", "length_penalty", LengthPenaltyConfig, LengthPenalty)]

Every ``register_*`` hook is called once, when the plugin manager is built (each command of
``streamrl``), takes no arguments, and returns a list of :class:`streamrl.api.Component` of
its kind. If a ``register_*`` hook raises (or returns something else), that hook of that plugin
is reported by name on one line and skipped; everything else still loads. Two components of one kind and name are both listed by
``streamrl plugins list``; only a recipe that names that component fails (naming both plugins).

Components are resolved in the ``streamrl`` process; objects that run on Dask workers are built
there from their config, so an installed plugin must be installed on every worker machine too.
"""

from __future__ import annotations

import pluggy

from streamrl.api import Component

hookspec = pluggy.HookspecMarker("streamrl")


@hookspec
def register_algorithms() -> list[Component]:
    """Register RL algorithms: advantages and a policy-gradient loss, used by the trainer
    (``[algorithm] name = ...``).

    :returns: ``Component("algorithm", name, ConfigModel, factory)`` entries; ``factory`` builds a
        :class:`streamrl.api.Algorithm`.

    Example::

        @hookimpl
        def register_algorithms():
            return [Component("algorithm", "grpo", GRPOConfig, GRPO)]
    """


@hookspec
def register_engines() -> list[Component]:
    """Register inference engines, built on every generate worker (``[engine] name = ...``).

    :returns: ``Component("engine", name, ConfigModel, factory)`` entries; ``factory`` builds a
        :class:`streamrl.api.Engine`.

    Example::

        @hookimpl
        def register_engines():
            return [Component("engine", "hf", HFEngineConfig, HFEngine)]
    """


@hookspec
def register_rewards() -> list[Component]:
    """Register rewards, built on every reward worker (``[reward] name = ...``).

    :returns: ``Component("reward", name, ConfigModel, factory)`` entries; ``factory`` builds a
        :class:`streamrl.api.Reward`.

    Example::

        @hookimpl
        def register_rewards():
            return [Component("reward", "exact_match", ExactMatchConfig, ExactMatch)]
    """


@hookspec
def register_tasks() -> list[Component]:
    """Register tasks: the prompt source of a run (``[task] name = ...``).

    :returns: ``Component("task", name, ConfigModel, factory)`` entries; ``factory`` builds a
        :class:`streamrl.api.Task`.

    Example::

        @hookimpl
        def register_tasks():
            return [Component("task", "addition", AdditionConfig, AdditionTask)]
    """


@hookspec
def register_trainers() -> list[Component]:
    """Register trainers: the policy, its optimizer and where it runs, built on the train worker
    (``[trainer] name = ...``). The factory is called as ``factory(config, context)`` with a
    :class:`streamrl.api.TrainerContext`.

    :returns: ``Component("trainer", name, ConfigModel, factory)`` entries; ``factory`` builds a
        :class:`streamrl.api.Trainer`.

    Example::

        @hookimpl
        def register_trainers():
            return [Component("trainer", "hf", HFTrainerConfig, HFTrainer)]
    """


@hookspec
def register_transfers() -> list[Component]:
    """Register weight transfers from the trainer to the engines (``[transfer] name = ...``).

    :returns: ``Component("transfer", name, ConfigModel, factory)`` entries; ``factory`` builds a
        :class:`streamrl.api.Transfer`.

    Example::

        @hookimpl
        def register_transfers():
            return [Component("transfer", "dask", DaskTransferConfig, DaskTransfer)]
    """


@hookspec
def register_metric_sinks() -> list[Component]:
    """Register metric sinks, given every step's record in the ``streamrl`` process
    (``[[metrics]] name = ...``).

    :returns: ``Component("metric_sink", name, ConfigModel, factory)`` entries; ``factory`` builds a
        :class:`streamrl.api.MetricSink`.

    Example::

        @hookimpl
        def register_metric_sinks():
            return [Component("metric_sink", "csv", CSVSinkConfig, CSVSink)]
    """


@hookspec
def register_rankers() -> list[Component]:
    """Register output-length rankers, built on the rank worker (``[ranker] name = ...``).

    :returns: ``Component("ranker", name, ConfigModel, factory)`` entries; ``factory`` builds a
        :class:`streamrl.api.Ranker`.

    Example::

        @hookimpl
        def register_rankers():
            return [Component("ranker", "history", HistoryRankerConfig, HistoryRanker)]
    """


@hookspec
def register_schedulers() -> list[Component]:
    """Register schedulers: where each prompt group is generated and in what order, on the
    client (``[scheduler] name = ...``).

    :returns: ``Component("scheduler", name, ConfigModel, factory)`` entries; ``factory`` builds a
        :class:`streamrl.api.Scheduler`.

    Example::

        @hookimpl
        def register_schedulers():
            return [Component("scheduler", "fcfs", FCFSConfig, FCFS)]
    """


@hookspec
def register_tool_parsers() -> list[Component]:
    """Register tool-call parsers: how a model's reply text becomes OpenAI's ``tool_calls``, on
    the generate worker that serves the endpoint (``[serve] tool_parser = ...``).

    :returns: ``Component("tool_parser", name, ConfigModel, factory)`` entries; ``factory`` builds
        a :class:`streamrl.api.ToolParser`.

    Example::

        @hookimpl
        def register_tool_parsers():
            return [Component("tool_parser", "hermes", HermesConfig, HermesToolParser)]
    """


@hookspec
def add_step_extensions(context) -> list:
    """Add features to the step loop of a run: called once per run in the ``streamrl`` process,
    after the cluster is up and before anything is placed on it.

    :param context: the run's :class:`streamrl.api.RunContext` (its client, resolved recipe,
        task and topology; the policy version and scheduler as the run goes on).
    :returns: :class:`streamrl.api.StepExtension` objects (a list, or None for none). Each is
        called at the moments of the step it overrides, in its declared ``order`` among the
        run's built-in extensions (``contracts/step_extension.py``).

    If it raises or returns something else, the run stops before its first step with one line
    naming the plugin; an extension that raises later stops the run as a failure of the loop would.

    Example::

        class CountGroups(StepExtension):
            def __init__(self):
                self.groups = 0

            def trained(self, step, scored):
                self.groups += len(scored)

            def record(self, step, record):
                record.extra["groups_so_far"] = self.groups

        @hookimpl
        def add_step_extensions(context):
            return [CountGroups()]
    """


@hookspec
def on_run_start(recipe, run_dir) -> None:
    """Called in the ``streamrl`` process once the cluster is up, before the first step.

    :param recipe: the validated :class:`streamrl.recipe.recipe.Recipe`.
    :param run_dir: the run folder (``pathlib.Path``).

    If it raises, the run stops before any step, in one line naming the plugin and the error.

    Example::

        @hookimpl
        def on_run_start(recipe, run_dir):
            print("starting", recipe.run.name, "in", run_dir)
    """


@hookspec
def on_step_end(step, metrics) -> None:
    """Called in the ``streamrl`` process after every optimizer step.

    :param step: the step number (0-based).
    :param metrics: that step's record, the same dict written to ``metrics.jsonl``.

    It is an observer (``run/observers.py``): if it raises, the error is reported once, in one
    line naming the plugin, and this plugin's ``on_step_end`` is left out for the rest of the
    run; the run goes on, and ``metrics.jsonl`` keeps every step.

    Example::

        @hookimpl
        def on_step_end(step, metrics):
            wandb.log(metrics, step=step)
    """


@hookspec
def on_run_end(run_dir, metrics) -> None:
    """Called in the ``streamrl`` process when the run finishes, also after a failure.

    :param run_dir: the run folder (``pathlib.Path``).
    :param metrics: every step record written so far (a list of dicts).

    If it raises, the error is reported on one line; the run's own outcome stands.

    Example::

        @hookimpl
        def on_run_end(run_dir, metrics):
            print(len(metrics), "steps done")
    """
