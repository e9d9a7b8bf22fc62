"""The shape of a run's cluster: which worker does what, how a task reaches a worker by name,
and which trainer incarnation each train worker holds.

A :class:`Topology` is the one owner of that shape. Submission (``flow/submit.py``) only reads
it; the elastic pool asks it to add and remove generate workers (``add_generate``,
``remove_generate``), and nothing else changes it. Work is addressed to workers by *name*: a
worker its nanny restarts comes back on a new address with the same name, and tasks pinned to
it wait for it instead of for ever (``cluster/lifecycle.worker_pins``).
"""

from __future__ import annotations

import time

from distributed import Client, SpecCluster

from streamrl.cluster import lifecycle
from streamrl.contracts.learning import TrainerCapabilities
from streamrl.errors import UserError
from streamrl.on_worker import task_functions
from streamrl.on_worker.resident import TRAINER


class Topology:
    """Who generates, who trains, who ranks; pins by name; the train group's incarnations."""

    train_resource = "train"
    """The resource train tasks ask for (a learner's own worker offers ``learn``)."""
    trainer_resident = TRAINER
    """The name the trained trainer is held under on its workers."""
    key_tag = ""
    """Appended to the phase of train task keys (``train-<learner>``)."""

    def __init__(self, client: Client, pools: dict[str, dict[str, str]], *, sharded: bool = False,
                 ranker: bool = False, spec_cluster: SpecCluster | None = None):
        """``pools``: ``{pool: {worker name: address}}`` (``cluster/lifecycle.check_pools``); ``sharded``:
        the train pool holds shards of one trainer (fsdp); ``ranker``: the run has a length
        ranker, which lives on the rank pool, else on the first reward worker;
        ``spec_cluster``: the embedded cluster, whose worker processes streamrl may start and
        stop (:meth:`start_worker`; None: a cluster the user runs, which cannot grow)."""
        self.client = client
        self.spec_cluster = spec_cluster
        self.pools = {pool: dict(members) for pool, members in pools.items()}
        """``{pool: {name: address}}`` as the busy-clock accounting sees it (a worker added
        counts from the step after it joined: :meth:`account`)."""
        self.generate: list[str] = sorted(pools["generate"])
        """Names of the generate workers that take part in dispatch and publication."""
        # Rank 0 of the train pool exports, checkpoints and saves the policy. With one train
        # worker every train task is pinned to it; with several, Dask gives each ready micro-batch
        # to whichever rank is free and every rank takes part in the optimizer step.
        self.train: list[str] = sorted(pools["train"])
        """Names of the train workers, rank order."""
        self.rank: str | None = sorted(pools.get("rank") or pools["reward"])[0] if ranker else None
        """Name of the worker holding the length ranker (None: no ranker)."""
        self.sharded = sharded and len(self.train) > 1
        """The ranks hold shards: every forward/backward is a collective (``training/fsdp.py``)."""
        self.pins: dict[str, dict] = lifecycle.worker_pins(client)
        """``{worker name: submit() keywords that run a task there}``."""
        self.incarnations: dict[str, str] = {}
        """``{train worker name: trainer incarnation}``: a train task landing on a restarted
        rank (a fresh trainer at the base weights) fails instead of training the wrong policy."""

    @classmethod
    def of(cls, client: Client, pools: dict[str, dict[str, str]], trainer: str, strategy: str,
           can: TrainerCapabilities, ranker: bool, spec_cluster: SpecCluster | None = None) -> "Topology":
        """The topology of a recipe's cluster, checked against what its trainer (``trainer``,
        ``trainer.strategy``) declares it can do (``can``): one line naming the field when it cannot."""
        world = len(pools["train"])
        refused = can.refuses(trainer, world, strategy)
        if refused:
            raise UserError(refused)
        sharded = world > 1 and strategy == "fsdp"
        return cls(client, pools, sharded=sharded, ranker=ranker, spec_cluster=spec_cluster)

    # -- reading ----------------------------------------------------------------------------
    @property
    def trainer(self) -> str:
        """Rank 0 of the train pool: it exports, checkpoints and saves the policy."""
        return self.train[0]

    @property
    def train_pin(self) -> dict:
        """Where rank 0's tasks run."""
        return self.pins[self.trainer]

    @property
    def sender(self) -> tuple[str, str]:
        """Rank 0's name and its address when the run started (a restarted worker has another)."""
        return self.trainer, self.pools["train"].get(self.trainer, "")

    def generate_pins(self) -> dict[str, dict]:
        """``{name: pin}`` of the generate workers, in order (a fresh dict: a caller may keep it)."""
        return {name: self.pins[name] for name in self.generate}

    def live_generate_pins(self) -> dict[str, dict]:
        """:meth:`generate_pins` without the workers not up now (killed, their nanny not done
        restarting them): a publication's collective must not count on a member that is not
        coming. A worker left out catches up when it is back (``weight_tasks.catch_up``)."""
        up = lifecycle.addresses(self.client)
        return {name: pin for name, pin in self.generate_pins().items() if name in up}

    def writers(self) -> list[dict]:
        """The ranks that write checkpoints and the policy: rank 0, or every rank if sharded."""
        return [self.pins[name] for name in self.train] if self.sharded else [self.train_pin]

    def train_pins(self) -> list[dict]:
        """Every rank's pin, rank order."""
        return [self.pins[name] for name in self.train]

    # -- the train group ----------------------------------------------------------------------
    def form_train_group(self, strategy: str, timeout: float) -> None:
        """Join the train workers in one ``torch.distributed`` group (rendezvous at rank 0; one
        worker: leave any group an earlier run on this cluster left), then read each rank's
        trainer incarnation."""
        client, world = self.client, len(self.train)
        if world == 1:  # a group left from an earlier run on this cluster would wait for peers
            client.submit(task_functions.join_train_group, 0, 1, "", 0.0, pure=False, **self.train_pin).result()
        else:
            address = client.submit(task_functions.rendezvous_address, key=f"rendezvous-{time.time_ns()}",
                                    **self.train_pin).result()
            joins = [client.submit(task_functions.join_train_group, rank, world, address, timeout, strategy,
                                   pure=False, key=f"join-train-group-{name}", **self.pins[name])
                     for rank, name in enumerate(self.train)]
            for f in joins:
                f.result()
        self.incarnations = {
            name: client.submit(task_functions.trainer_incarnation, key=f"trainer-id-{name}-{time.time_ns()}",
                                **self.pins[name]).result()
            for name in self.train}

    # -- growing and shrinking (the elastic pool asks) ------------------------------------------
    @property
    def can_grow(self) -> bool:
        """Whether streamrl can start and stop worker processes (the embedded cluster)."""
        return self.spec_cluster is not None

    def start_worker(self, name: str, spec: dict) -> None:
        """Start a worker process ``name`` from ``spec`` (``pool_workers.pool_worker_spec``): the
        ``SpecCluster`` starts what its spec lacks. It takes no work until it is added."""
        self.spec_cluster.worker_spec[name] = spec
        self.spec_cluster.scale(len(self.spec_cluster.worker_spec))

    def keep_resources(self, name: str, **resources: float) -> None:
        """Worker ``name`` offers ``resources`` through a restart too: its nanny starts the new
        process from what it was given at its start, which a change made on the worker alone
        (``set_resources``) is not -- an added generate worker came back with 0 slots."""
        spec = self.spec_cluster.worker_spec.get(name)
        if spec is not None:
            options = spec.setdefault("options", {})
            options["resources"] = {**(options.get("resources") or {}), **resources}
        nanny = self.spec_cluster.workers.get(name)
        if nanny is not None and isinstance(getattr(nanny, "resources", None), dict):
            nanny.resources = {**nanny.resources, **resources}
            # (the nanny keeps its process's arguments from the first start, and restarts with them)
            kwargs = getattr(getattr(nanny, "process", None), "worker_kwargs", None)
            if isinstance(kwargs, dict):
                kwargs["resources"] = nanny.resources

    def stop_worker(self, name: str) -> None:
        """Retire worker ``name`` now (results only it holds are copied elsewhere first) and
        :meth:`drop` it."""
        self.client.retire_workers(names=[name], close_workers=True)
        self.drop(name)

    def drop(self, name: str) -> None:
        """``name`` leaves the cluster's spec (the ``SpecCluster`` closes its nanny, if it is
        still up) and the generate pool's accounting."""
        self.spec_cluster.worker_spec.pop(name, None)
        self.spec_cluster.scale(len(self.spec_cluster.worker_spec))
        self.forget(name)

    def next_generate_index(self) -> int:
        """The index a new generate worker gets (``generate-<i>``, never reused in a run)."""
        known = [*self.generate, *self.pools.get("generate", {})]
        return 1 + max(int(n.rsplit("-", 1)[1]) for n in known)

    def refresh_pins(self) -> None:
        """Read the pins again (a worker started since)."""
        self.pins.update(lifecycle.worker_pins(self.client))

    def add_generate(self, name: str) -> None:
        """``name`` (up, loaded with the newest weights) joins dispatch and publication."""
        if name not in self.generate:
            self.generate.append(name)

    def remove_generate(self, name: str) -> None:
        """``name`` leaves dispatch and publication (it may still run what it holds)."""
        self.generate.remove(name)

    def account(self, name: str, address: str) -> None:
        """Count ``name`` in the generate pool's busy-clock accounting from now on."""
        self.pools.setdefault("generate", {})[name] = address

    def forget(self, name: str) -> None:
        """``name`` is gone: no longer counted in the generate pool's accounting."""
        self.pools.get("generate", {}).pop(name, None)

    def replaced(self, pool: str) -> list[str]:
        """Workers of ``pool`` that are gone or were restarted (at another address) since the
        run placed its work on them, as the scheduler sees them now."""
        now = lifecycle.addresses(self.client)
        return sorted(name for name, addr in self.pools.get(pool, {}).items() if now.get(name) != addr)

    def address(self, name: str) -> str | None:
        """The current address of worker ``name`` (None: not up)."""
        return lifecycle.addresses(self.client).get(name)
