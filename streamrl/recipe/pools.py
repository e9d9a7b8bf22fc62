"""The ``[cluster]`` and ``[pools.*]`` tables of a recipe: where the run's workers come from (the
embedded cluster, a factory, or a running cluster's address) and, per pool, how many workers,
their threads, memory, devices and environment. ``recipe.py`` holds them in :class:`Recipe`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from streamrl.recipe.strict import Strict


class ClusterConfig(Strict):
    address: str = ""
    """Scheduler address (``tcp://host:8786``) of an existing Dask cluster, whose workers offer
    the pools as resources (``docs/deploy.md``); streamrl leaves it running after the run. Empty:
    start a cluster from ``factory``, or else the embedded local cluster from the ``[pools.*]``
    tables."""
    factory: str = ""
    """A callable that returns a Dask cluster for this run: ``"dask_jobqueue.SLURMCluster"`` or
    ``"package.module:make_cluster"``, importable where ``streamrl`` runs (your own module: on
    ``PYTHONPATH``). streamrl calls it with ``factory_options``, starts ``[pools.<name>] workers``
    workers per pool with their resources and names where the cluster's worker specification
    allows it (``docs/deploy.md``), and closes the cluster at the end. Empty: the embedded cluster
    (or ``address``)."""
    factory_options: dict[str, Any] = {}
    """Keyword arguments for ``factory`` (for SLURMCluster e.g. ``cores``, ``memory``,
    ``queue``, ``walltime``, ``scheduler_options``)."""
    pool_options: dict[Literal["generate", "train", "reward", "rank", "agent"], dict[str, Any]] = {}
    """Per pool, options of the factory's worker specification that differ for that pool's
    workers, over ``factory_options`` (``[cluster.pool_options.train] job_extra_directives =
    ["--gres=gpu:4"]`` for a SLURM train job)."""
    host: str = "127.0.0.1"
    """Interface the embedded cluster (scheduler, workers, dashboard) listens on. The default keeps
    everything on this machine. A ``factory`` cluster listens where its options say."""
    dashboard_port: int = Field(8787, ge=0, le=65535)
    """Port of the Dask dashboard of the embedded cluster (0 picks a free one)."""
    dashboard: bool = True
    """Serve Dask's dashboard (and the streamrl page on it) from the embedded cluster. False for
    runs nobody watches (CI, scripted sweeps): the dashboard's start is a second or two of CPU
    per run, about a tenth of a small run's (docs/benchmarks.md). A cluster streamrl connects to
    keeps its own."""
    startup_timeout: float = Field(120.0, gt=0, le=1e6)  # (bounded: a timer of 1e300 s cannot be armed)
    """Seconds to wait for the workers of every pool to come up (for a factory on a batch
    system, include the time its jobs wait in the queue)."""
    connect_timeout: float = Field(10.0, gt=0, le=1e6)  # (bounded: a timer of 1e300 s cannot be armed)
    """Seconds to wait for the scheduler at ``address`` to answer."""
    worker_start: Literal["auto", "warm", "spawn"] = "auto"
    """How the embedded cluster starts its workers. ``warm``: forked from one server process that
    has imported torch, transformers and streamrl's worker code once, so a worker starts in a
    fraction of a second instead of importing them itself (seconds of CPU each); every worker then
    has the environment the ``streamrl`` process had when the server started, plus the pools'
    usual settings. ``spawn``: each a fresh interpreter (Dask's default), which a pool's own
    ``env`` of variables read at import needs. ``auto``: ``warm`` unless a pool sets ``env`` or
    the machine has an NVIDIA GPU (CUDA must not start before a fork)."""

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        # Dask's own message for a bad address is a traceback from deep inside its comm layer
        if not value:
            return value
        from distributed.comm import parse_address, parse_host_port

        try:
            _, location = parse_address(value)
            host, port = parse_host_port(location)
        except (ValueError, TypeError):
            host, port = "", 0
        if not host or not 1 <= int(port) <= 65535:
            raise ValueError("expected a scheduler address like tcp://host:8786 (an IPv6 host in brackets: "
                             "tcp://[::1]:8786; a port from 1 to 65535)")
        return value

    @field_validator("host")
    @classmethod
    def _host(cls, value: str) -> str:
        # an empty host is every interface to Dask (the scheduler takes anyone's connection and
        # code): never by accident; an IPv6 address Dask's dashboard cannot take is one line here
        if not value.strip():
            raise ValueError('expected an interface to listen on, like "127.0.0.1" (it is never all of them '
                             'by default: name one, or "0.0.0.0" on a network you trust)')
        if ":" in value or not value.isascii() or not value.isprintable() or " " in value:
            raise ValueError("expected an IPv4 address or a host name (the embedded cluster's dashboard takes "
                             "no IPv6 address)")
        return value

    @field_validator("factory")
    @classmethod
    def _factory(cls, value: str) -> str:
        # checked for its shape here (one line from ``recipe validate``); imported only when
        # the run starts, so a recipe for a SLURM cluster validates on a laptop without dask-jobqueue
        target, _, attr = value.rpartition(":" if ":" in value else ".")
        if value and not (target and attr.isidentifier()
                          and all(part.isidentifier() for part in target.split("."))):
            raise ValueError("expected an importable callable like 'dask_jobqueue.SLURMCluster' or "
                             "'mypackage.module:make_cluster'")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> "ClusterConfig":
        if self.address and self.factory:
            raise ValueError("address and factory are both set (an existing cluster, or one to start: remove one)")
        if not self.factory and (self.factory_options or self.pool_options):
            unused = "factory_options" if self.factory_options else "pool_options"
            raise ValueError(f"{unused} is set but factory is not (options for which cluster?)")
        return self


class PoolConfig(Strict):
    workers: int = Field(1, ge=1, le=512)
    """Number of worker processes in this pool (one per GPU on a GPU machine)."""
    threads: int = Field(1, ge=1)
    """Task slots per worker. A generate worker needs several: each running generate task holds
    one prompt group inside the engine, which batches all of them together."""
    torch_threads: int = Field(1, ge=1)
    """``torch.set_num_threads`` inside the worker (Nanny workers start with OMP_NUM_THREADS=1)."""
    memory_limit: str = "auto"
    """Dask memory limit per worker (``"4GiB"``, ``"auto"``, or ``"0"`` for none). ``auto``: Dask's
    share of the machine by threads; on a GPU pool (``device = "cuda"`` or GPUs listed) of the
    embedded cluster, the machine's memory over all its workers instead."""
    @field_validator("memory_limit")
    @classmethod
    def _dask_reads_it(cls, value: str) -> str:
        # read here as Dask's Nanny reads it at the worker's start, where a mistake was a traceback
        import logging

        from distributed.worker_memory import parse_memory_limit

        try:
            limit = parse_memory_limit(value, 1, logger=logging.getLogger("streamrl.recipe")) if value.strip() else -1
        except (ValueError, TypeError, ArithmeticError):  # ("inf" overflows Dask's reading)
            limit = -1
        if limit is not None and limit < 0:
            raise ValueError("not a memory size; expected bytes with a unit (\"4GiB\", \"500MB\"), "
                             "a fraction of the machine's memory (\"0.5\"), \"auto\", or \"0\" for no limit")
        return value

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where this pool's engine / trainer / reward model compute: ``auto`` = CUDA when the worker
    sees a GPU, else CPU; ``cuda`` fails at start-up on a worker without one."""
    gpus_per_worker: int = Field(1, ge=1)
    """GPUs each worker gets from ``cuda_visible_devices`` (consecutive ids) and advertises as
    the Dask resource ``GPU``."""
    cuda_visible_devices: list[str] = []
    """GPU ids handed out to the workers in order (``gpus_per_worker`` each, wrapping around, so
    a generate and a train pool may list the same GPU and share it), exported as
    CUDA_VISIBLE_DEVICES. Empty: CPU or inherited."""
    env: dict[str, str] = {}
    """Extra environment variables for this pool's workers."""
    nice: int = Field(0, ge=0, le=19)
    """How much lower the CPU priority (Unix ``nice``) of this pool's workers is, on the embedded
    cluster (workers you start yourself keep their own). Where pools share CPUs with each other
    and with other work, a lower priority for one lets the others go first: the serving recipes
    give the train pool one, so that decoding for clients goes ahead of training."""
    cost_per_device: float = Field(1.0, ge=0)
    """Relative price of one of this pool's devices per unit time (e.g. per hour). ``streamrl
    plan`` and the benchmarks report samples per cost unit with it."""

    @field_validator("cuda_visible_devices")
    @classmethod
    def _gpu_ids(cls, ids: list[str]) -> list[str]:
        # (an id CUDA does not read hides every GPU: with device = "auto" the pool ran on the CPU)
        wrong = [i for i in ids if not (i.isdigit() or i.startswith(("GPU-", "MIG-")))]
        if wrong:
            raise ValueError(f"{wrong[0]!r} is not a GPU id; expected an index (\"0\") or a UUID (\"GPU-...\", "
                             "\"MIG-...\") as nvidia-smi -L lists them")
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice:
            raise ValueError(f"GPU {twice[0]!r} is listed twice; list each once (pools may share one by each "
                             "listing it)")
        return ids

    @model_validator(mode="after")
    def _enough_gpus(self):
        if self.cuda_visible_devices and self.gpus_per_worker > len(self.cuda_visible_devices):
            raise ValueError(f"gpus_per_worker ({self.gpus_per_worker}) is more than cuda_visible_devices lists "
                             f"({len(self.cuda_visible_devices)}): a worker would be given one GPU twice")
        return self


class ElasticConfig(Strict):
    """``[pools.generate] elastic = { min = 1, max = 3 }``: the controller grows and shrinks the
    generate pool between steps (``extensions/elastic.py``), starting from ``workers``."""

    min: int = Field(1, ge=1)
    """Fewest generate workers the pool shrinks to."""
    max: int = Field(ge=1, le=512)
    """Most generate workers the pool grows to."""
    grow_when_train_idle: float = Field(0.15, ge=0, le=1)
    """Add a worker when, in the last step, the train pool was idle more than this share of the
    step (the trainer waited) while the generate pool was idle less than
    ``grow_when_generate_idle_below`` *while generation ran* (generation was the bottleneck, not
    the controller). "While generation ran": the whole step in ``async``; in ``stream`` and
    ``batch`` from the step's start to its last sample, since after it the pool waits for the
    new weights by design."""
    grow_when_generate_idle_below: float = Field(0.1, ge=0, le=1)
    """See ``grow_when_train_idle``."""
    shrink_when_busy_below: float = Field(0.75, gt=0, le=1)
    """Retire a worker when the remaining ones would have done the last step's generation at most
    this busy, over the same span as ``grow_when_train_idle``'s."""
    min_gain: float = Field(0.05, ge=-1)
    """A worker added must raise tokens/s by this share (its first 3 steps against up to 6 before
    it was asked for), or it is retired again and the pool does not grow for ``hold_steps``: when
    the machine's cores (or the network) are already saturated, another worker only competes.
    Retired only when the steps clearly show it: the gain plus 1.5 standard errors of it (from
    the steps' own spread) below this share. -1: never retired for this."""
    hold_steps: int = Field(10, ge=0)
    """Steps without growing after a worker that did not pay (``min_gain``), or could not start
    or join (each try a process start and a model load)."""
    cooldown_steps: int = Field(1, ge=0)
    """Steps to watch after a worker joined or left before deciding again: the step in which the
    pool changed mixes two sizes."""

    @model_validator(mode="after")
    def _ordered(self):
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must be <= max ({self.max})")
        return self


class GeneratePoolConfig(PoolConfig):
    groups_per_task: int = Field(1, ge=1)
    """Prompt groups per generate task (and per reward task after it). 1: every group streams
    to the trainer on its own. More: fewer, larger Dask tasks -- worth it when groups are tiny
    (W1: 64 groups of 8 four-token answers per step) and each task's fixed cost shows; the
    trainer then sees groups in bundles of this size."""
    elastic: ElasticConfig | None = None
    """Grow and shrink this pool during the run between ``min`` and ``max`` workers, starting from
    ``workers`` (embedded cluster only). None: ``workers`` for the whole run."""

    @model_validator(mode="after")
    def _start_inside(self):
        if self.elastic and not self.elastic.min <= self.workers <= self.elastic.max:
            raise ValueError(f"workers ({self.workers}) must lie in elastic's [min, max] = "
                             f"[{self.elastic.min}, {self.elastic.max}]")
        return self


class PoolsConfig(Strict):
    generate: GeneratePoolConfig | None = None
    """Workers holding an inference engine; run generate tasks."""
    train: PoolConfig | None = None
    """Workers holding the policy being trained and its optimizer; run train tasks."""
    reward: PoolConfig | None = None
    """Workers that score responses; run reward tasks."""
    rank: PoolConfig | None = None
    """Optional worker for the length ranker (``[ranker]``); without it the ranker lives on the
    first reward worker."""
    agent: PoolConfig | None = None
    """Optional workers that run an agent task's rollouts (``[task] name = "agent"``): each
    thread runs one prompt group's rollouts at a time, concurrently. Without it they run on the
    reward pool."""


#: The pools every run needs, with what they are for (used in error messages).
REQUIRED_POOLS = {"generate": "runs generate tasks", "train": "runs train tasks", "reward": "runs reward tasks"}
