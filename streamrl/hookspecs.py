"""Hook specifications: the contract between streamrl and its plugins.

Every replaceable piece of streamrl -- the RL algorithm, the inference engine, the reward, the
task (prompt source), the weight transport, metric sinks, length rankers, schedulers -- is a *component* handed over by a plugin through one
of the ``register_*`` hooks below. The built-ins are registered exactly the same way
(``streamrl/builtins.py``), so nothing you write is a second-class citizen.

A plugin is a module (or an installed package with a ``streamrl`` entry point) that implements
some of these hooks with ``@streamrl.hookimpl``::

    import streamrl
    from streamrl.plugins import Component

    @streamrl.hookimpl
    def register_rewards():
        return [Component(kind="reward", name="length_penalty",
                          config=LengthPenaltyConfig, factory=LengthPenalty)]

Components are resolved on the client (the ``streamrl`` process) and the built objects are
shipped to Dask workers by pickling, so a third-party plugin must be installed on every worker
machine too.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("streamrl")


@hookspec
def register_algorithms():
    """Return a list of ``Component(kind="algorithm", ...)``.

    Called once when the plugin manager is built. An algorithm turns a group of scored samples
    into advantages and a policy-gradient loss (see ``streamrl/algorithms/grpo.py``). Its factory
    receives the validated ``[algorithm]`` section of the recipe.

    Example::

        @hookimpl
        def register_algorithms():
            return [Component("algorithm", "grpo", GRPOConfig, GRPO)]
    """


@hookspec
def register_engines():
    """Return a list of ``Component(kind="engine", ...)``.

    Called once when the plugin manager is built. An engine lives on each ``generate`` worker,
    turns prompt groups into sampled responses with per-token logprobs, and loads new weights
    in place between steps (see ``streamrl/engines/hf.py``). The factory receives the validated
    ``[engine]`` section and is called *on the worker*.

    Example::

        @hookimpl
        def register_engines():
            return [Component("engine", "hf", HFEngineConfig, HFEngine)]
    """


@hookspec
def register_rewards():
    """Return a list of ``Component(kind="reward", ...)``.

    Called once when the plugin manager is built. A reward scores one response to one prompt;
    it runs in reward tasks on the ``reward`` pool. The factory receives the ``[reward]`` section.

    Example::

        @hookimpl
        def register_rewards():
            return [Component("reward", "exact_match", ExactMatchConfig, ExactMatch)]
    """


@hookspec
def register_tasks():
    """Return a list of ``Component(kind="task", ...)``.

    Called once when the plugin manager is built. A task is the prompt source of a run: it hands
    out prompts (with whatever the reward needs to check an answer) step by step, and can build a
    tiny model + tokenizer for itself (``streamrl model init``). The factory receives ``[task]``.

    Example::

        @hookimpl
        def register_tasks():
            return [Component("task", "addition", AdditionConfig, AdditionTask)]
    """


@hookspec
def register_transports():
    """Return a list of ``Component(kind="transport", ...)``.

    Called once when the plugin manager is built. A weight transport moves the trainer's new
    weights to every generate worker after each optimizer step. The factory receives
    ``[transfer]``.

    Example::

        @hookimpl
        def register_transports():
            return [Component("transport", "dask", DaskTransportConfig, DaskTransport)]
    """


@hookspec
def register_metric_sinks():
    """Return a list of ``Component(kind="metric_sink", ...)``.

    Called once when the plugin manager is built. A metric sink receives every step's metrics
    record on the client, besides ``metrics.jsonl`` (which every run writes). The recipe picks
    sinks with ``[[metrics]]`` tables; the factory receives one table. The object needs
    ``open(run_dir)``, ``write(record)`` and ``close()``.

    Example::

        @hookimpl
        def register_metric_sinks():
            return [Component("metric_sink", "csv", CSVSinkConfig, CSVSink)]
    """


@hookspec
def register_rankers():
    """Return a list of ``Component(kind="ranker", ...)``.

    Called once when the plugin manager is built. A length ranker predicts which prompts will
    have long outputs (StreamRL's output-length ranker): ``predict(prompts) -> [score]``
    (higher = longer) before a step's prompts are dispatched, and ``observe(prompts, lengths)``
    (per prompt, the output lengths of its samples) after the step is trained. It lives on one
    worker (``[pools.rank]``, else the first reward worker) for the whole run, so it may keep
    state. The recipe picks it with ``[ranker] name = ...``; its recall at the top 20% is logged
    every step (``ranker_recall``).

    Example::

        @hookimpl
        def register_rankers():
            return [Component("ranker", "history", HistoryRankerConfig, HistoryRanker)]
    """


@hookspec
def register_schedulers():
    """Return a list of ``Component(kind="scheduler", ...)``.

    Called once when the plugin manager is built. A scheduler places a step's prompt groups on
    generate workers and orders them inside each, on the client:
    ``dispatch(prompts, scores, workers, ctx) -> [Assignment(index, worker, priority)]``, with
    the ranker's scores, worker names, and a ``DispatchContext`` (observed lengths, the engine's
    latency model). See ``streamrl/scheduling/schedulers.py``. The recipe picks it with
    ``[scheduler] name = ...``.

    Example::

        @hookimpl
        def register_schedulers():
            return [Component("scheduler", "fcfs", FCFSConfig, FCFS)]
    """


@hookspec
def on_run_start(recipe, run_dir):
    """Called on the client once the cluster is up and before the first step is submitted.

    ``recipe`` is the validated :class:`streamrl.recipe.Recipe`; ``run_dir`` a ``pathlib.Path``.

    Example::

        @hookimpl
        def on_run_start(recipe, run_dir):
            print("starting", recipe.run.name, "in", run_dir)
    """


@hookspec
def on_step_end(step, metrics):
    """Called on the client after every optimizer step with that step's metrics dict
    (the same record written to ``metrics.jsonl``).

    Example::

        @hookimpl
        def on_step_end(step, metrics):
            wandb.log(metrics, step=step)
    """


@hookspec
def on_run_end(run_dir, metrics):
    """Called on the client when the run finishes (also after a failure), with the list of all
    step metrics recorded so far.

    Example::

        @hookimpl
        def on_run_end(run_dir, metrics):
            print(len(metrics), "steps done")
    """
