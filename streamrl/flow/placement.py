"""Put the run's stateful components on their workers, before the clock starts.

Each is a :class:`~streamrl.on_worker.resident.Resident` worker plugin holding a build function; the
first task that needs the object builds it on its worker: the engine on every generate worker,
the trainer on the train worker, the reward on every reward worker, the ranker on the rank
worker, the transfer on both ends. Model loads are forced here (``warm_up`` tasks) so the first
step's timings measure the run, not the loading.
"""

from __future__ import annotations

from functools import partial

from distributed import Client

from streamrl.api import TrainerContext
from streamrl.on_worker import task_functions
from streamrl.on_worker.resident import ENGINE, RANKER, REWARD, TRAINER, TRANSFER, Resident
from streamrl.plugins.resolve import Chosen, Resolved
from streamrl.telemetry import bubbles


def build_engine(engine: Chosen, model_path: str | None, reward: Chosen | None = None):
    """Runs on a generate worker: make the engine and load the model; ``reward``: built here
    too, for an engine that stops hopeless responses early (``EngineCapabilities.stops_early``)."""
    obj = engine.build()
    obj.load(model_path)
    if reward is not None:
        obj.stop_early_with(reward.build())
    return obj


def trainer_context(resolved: Resolved, sharded: bool = False, algorithm: Chosen | None = None,
                    model_path: str | None = None, learner: str = "") -> TrainerContext:
    """What the trainer's factory gets besides its config (``sharded``: it will be, over the
    train pool; ``algorithm``: a learner's, default the main learner's; ``model_path``: a model
    folder other than the recipe's, e.g. a policy saved during the run; ``learner``: a side
    learner's name)."""
    return TrainerContext(model_path=model_path or resolved.model_path, algorithm=(algorithm or resolved.algorithm).build(),
                          engine=resolved.engine.capabilities(), seed=resolved.recipe.run.seed, sharded=sharded,
                          learner=learner)


def place(client: Client, resolved: Resolved, generate_workers: dict[str, str], train_worker: str,
          rank_worker: str | None = None, sharded: bool = False) -> None:
    """Register every resident and build the engines, the trainer and the ranker now
    (``sharded``: the trainer is about to be sharded over the train pool)."""
    r = resolved.recipe
    seed = r.run.seed
    gen_threads = r.pools.generate.torch_threads if r.pools.generate else 1
    train_threads = r.pools.train.torch_threads if r.pools.train else 1
    build_trainer = partial(resolved.trainer.build, trainer_context(resolved, sharded))
    watch = resolved.reward if resolved.engine.capabilities().stops_early else None
    client.register_plugin(Resident(ENGINE, partial(build_engine, resolved.engine, resolved.model_path, watch),
                                    torch_threads=gen_threads, seed=seed, what=f"engine {r.engine.name!r}"))
    client.register_plugin(Resident(TRAINER, build_trainer, torch_threads=train_threads, seed=seed,
                                    what=f"trainer {r.trainer.name!r}"))
    client.register_plugin(Resident(REWARD, resolved.reward.build, seed=seed, what=f"reward {r.reward.name!r}",
                                    settings={"score_timeout_s": r.reward.score_timeout_s,
                                              "limit": r.reward.limit}))
    client.register_plugin(Resident(TRANSFER, resolved.transfer.build, seed=seed,
                                    what=f"transfer {r.transfer.name!r}"))
    if resolved.ranker is not None:
        client.register_plugin(Resident(RANKER, resolved.ranker.build, seed=seed, what=f"ranker {r.ranker.name!r}"))
    client.register_plugin(bubbles.BusyClock())
    futs = [client.submit(task_functions.warm_up, ENGINE, key=f"load-engine-{name}", workers=[addr],
                          allow_other_workers=False)
            for name, addr in generate_workers.items()]
    futs.append(client.submit(task_functions.warm_up, TRAINER, key="load-trainer", workers=[train_worker],
                              allow_other_workers=False))
    # both ends of the transfer, each worker once (a colocated train worker is also a generate one)
    ends = {train_worker: "train", **{addr: name for name, addr in generate_workers.items()}}
    futs += [client.submit(task_functions.warm_up, TRANSFER, key=f"load-transfer-{name}", workers=[addr],
                           allow_other_workers=False, pure=False)
             for addr, name in ends.items()]
    if resolved.ranker is not None and rank_worker is not None:
        # built on first use, the ranker (and torch, imported on a reward worker) held the
        # first step's generation back by seconds (docs/benchmarks.md)
        futs.append(client.submit(task_functions.warm_up, RANKER, key="load-ranker", workers=[rank_worker],
                                  allow_other_workers=False, pure=False))
    for f in futs:
        f.result()
