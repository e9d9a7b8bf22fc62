"""Clusters from a factory: ``[cluster] factory = "dask_jobqueue.SLURMCluster"``.

A factory is any callable that returns a Dask cluster (``distributed.deploy.Cluster``), called
with ``cluster.factory_options`` as keyword arguments. What streamrl does with the cluster
depends on how its workers are described:

- **A** ``SpecCluster`` **whose workers are** ``Nanny``/``Worker`` **objects or dask-jobqueue
  jobs** (``distributed.LocalCluster``, ``dask_cuda.LocalCUDACluster``, ``dask_jobqueue.*Cluster``):
  streamrl *labels* them. The factory is asked for no workers (``n_workers=0`` when the class
  takes it); then, per worker the recipe's ``[pools.<name>] workers`` ask for (and per side
  learner of ``[[learners]]``: ``learner-<name>``, with the train pool's settings), the cluster's own
  next worker spec (``new_worker_spec()``: it keeps what the library sets per worker, e.g. the GPU
  dask-cuda gives each) gets the worker's name ``<pool>-<i>``, its threads, the pool's resources
  and environment, and ``cluster.pool_options.<pool>`` on top. A job-queue job carries them in
  its script: ``--name``, ``--nthreads`` and ``--resources`` on the ``dask worker`` line (after
  the library's own, so they win), ``export`` lines in the prologue, one worker per job.
- **Any other cluster** (``dask_kubernetes.operator.KubeCluster``, a cloud provider's, a
  ``SpecCluster`` of unknown worker classes): streamrl cannot know how to label its workers, so
  the factory must start them labelled (e.g. one Kubernetes worker group per pool, each worker
  offering the pool's resource). streamrl never calls ``scale`` on it -- that would add workers
  of no pool -- and waits until every pool has its ``workers``.

Either way streamrl waits up to ``cluster.startup_timeout`` for the pools and closes the cluster
when the run ends. Optional libraries are imported only here, when a recipe names them.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import shlex
import sys
from typing import Any, Callable

import dask
from distributed import LocalCluster, Nanny, SpecCluster, Worker
from distributed.deploy import Cluster

from streamrl.cluster import pool_workers as pools
from streamrl.errors import UserError
from streamrl.recipe.recipe import Recipe
from streamrl.telemetry.text import message_line

#: pip's name for the packages recipes name most, for the message when one is missing
PIP_NAMES = {"dask_jobqueue": "dask-jobqueue", "dask_kubernetes": "dask-kubernetes", "dask_cuda": "dask-cuda",
             "dask_cloudprovider": "dask-cloudprovider", "dask_gateway": "dask-gateway"}


def load(path: str) -> Callable[..., Any]:
    """The callable ``path`` names (``package.module.Name`` or ``package.module:name``); a missing
    package is one line naming it and how to install it."""
    target, _, attr = path.rpartition(":" if ":" in path else ".")
    try:
        module = importlib.import_module(target)
    except ModuleNotFoundError as exc:
        # (exc.name: the module really missing, which may be a dependency of the one named)
        missing = (exc.name or target).split(".")[0]
        pip = PIP_NAMES.get(missing, missing)
        raise UserError(f"cluster.factory: {path!r} needs the Python package {missing!r}, which is not "
                        f"installed here (pip install {pip})") from None
    except (Exception, SystemExit) as exc:  # (a module that exits on import: its message, not the command's end)
        raise UserError(f"cluster.factory: importing {target} failed: {type(exc).__name__}: {exc}") from None
    try:
        fn = getattr(module, attr)
    except AttributeError:
        raise UserError(f"cluster.factory: module {target!r} has no {attr!r}") from None
    if not callable(fn):
        raise UserError(f"cluster.factory: {path!r} is a {type(fn).__name__}, not a callable")
    return fn


def create(recipe: Recipe) -> Cluster:
    """Call the recipe's factory with ``factory_options`` and check that a cluster came back.

    A ``SpecCluster`` class that takes ``n_workers`` is asked for none unless the options say
    otherwise: its workers would be of no pool (streamrl starts the pools' own, :func:`label`).
    """
    c = recipe.cluster
    fn = load(c.factory)
    options = dict(c.factory_options)
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read: call it as the user wrote it
        parameters = {}
    if isinstance(fn, type) and issubclass(fn, SpecCluster) and "n_workers" not in options and "n_workers" in parameters:
        options["n_workers"] = 0
    if isinstance(fn, type) and issubclass(fn, LocalCluster) and "dashboard_address" not in options:
        # (a cluster on this machine: Dask's default, ":8787", is every interface, and the
        # dashboard shows the run to anyone who can reach the machine; the user's options say
        # otherwise if they mean it. A batch system's scheduler is reached from elsewhere: its
        # own defaults stand)
        options["dashboard_address"] = "127.0.0.1:0"
    try:
        try:
            made = fn(**options)
        except ValueError:
            if options.get("n_workers") != 0 or "n_workers" in c.factory_options:
                raise
            # a class that refuses no workers (dask-cuda: "Number of workers cannot be less than
            # 1") starts its own, which label() then replaces by the pools'
            made = fn(**{k: v for k, v in options.items() if k != "n_workers"})
    except UserError:
        raise
    except (Exception, SystemExit) as exc:
        text = message_line(exc, 500)  # some libraries' messages span lines: keep it one
        raise UserError(f"cluster.factory: {c.factory}(**factory_options) failed: "
                        f"{type(exc).__name__}: {text}") from None
    if not isinstance(made, Cluster):
        close = getattr(made, "close", None)
        if callable(close):
            try:
                close()
            except Exception:
                pass
        raise UserError(f"cluster.factory: {c.factory} returned a value of type {type(made).__name__}, not a Dask "
                        "cluster (distributed.deploy.Cluster)")
    return made


def labellable(cluster: Cluster) -> bool:
    """Whether streamrl can give this cluster's workers their pools (see the module docstring)."""
    if not isinstance(cluster, SpecCluster) or not cluster.new_spec:
        return False
    cls = cluster.new_spec.get("cls")
    return isinstance(cls, type) and (issubclass(cls, (Nanny, Worker)) or _is_job(cls))


def _is_job(cls: type) -> bool:
    """A dask-jobqueue job class (looked up only if dask-jobqueue is already imported)."""
    core = sys.modules.get("dask_jobqueue.core")
    return core is not None and issubclass(cls, core.Job)


def pool_specs(cluster: SpecCluster, recipe: Recipe) -> dict[str, dict]:
    """``{worker name: spec}`` for every worker the recipe asks for (its pools', and each side
    learner's: ``pool_workers.planned_workers``), each from the cluster's own next worker spec
    (see the module docstring). Changes nothing in ``cluster``."""
    planned = pools.planned_workers(recipe)
    saved = dict(cluster.worker_spec)
    bases = []
    try:
        # the pools' workers replace any the library started itself (label), so they take its
        # GPUs and names from the first
        cluster.worker_spec.clear()
        # new_worker_spec() looks at worker_spec to pick the next name (and, in dask-cuda, the
        # next GPU): let it see the ones already handed out
        for _, w in planned:
            if "CUDA_VISIBLE_DEVICES" in w["env"]:
                # the pool names its own GPUs: the library's template, without taking the next GPU
                # (dask-cuda hands out one worker per GPU; pools that share a GPU list it)
                bases.append(copy.deepcopy(cluster.new_spec))
                continue
            try:
                ((key, spec),) = cluster.new_worker_spec().items()
            except Exception as exc:
                name = planned[len(bases)][1]["name"]
                raise UserError(f"cluster.factory: {type(cluster).__name__} has no worker spec for worker "
                                f"{len(bases) + 1} of {len(planned)}, {name} ({type(exc).__name__}: {exc})") from None
            cluster.worker_spec[key] = spec
            bases.append(copy.deepcopy(spec))
    finally:
        cluster.worker_spec.clear()
        cluster.worker_spec.update(saved)
    out = {}
    for (pool, w), base in zip(planned, bases):
        extra = recipe.cluster.pool_options.get(pool, {})
        cls = base["cls"]
        if _is_job(cls):
            opts = _job_options(cls, base["options"], w, extra)
        else:
            opts = _worker_options(cls, base["options"], w, extra, recipe, pool)
        out[w["name"]] = {"cls": cls, "options": opts}  # (no "group": one worker per spec)
    return out


def _worker_options(cls: type, base: dict, w: dict, extra: dict, recipe: Recipe, pool: str) -> dict:
    """A ``Nanny``/``Worker`` spec's options for worker ``w`` (:func:`streamrl.cluster.pool_workers.pool_worker`)."""
    opts = {**base, **extra, "name": w["name"], "nthreads": w["nthreads"]}
    opts["resources"] = {**(opts.get("resources") or {}), **w["resources"]}
    limit = getattr(recipe.pools, pool).memory_limit
    if limit != "auto" and "memory_limit" not in extra:  # else the library's share of the machine
        opts["memory_limit"] = limit
    if issubclass(cls, Nanny):
        # the library's per-worker variables (dask-cuda's CUDA_VISIBLE_DEVICES) stay unless the
        # pool gives its own GPUs
        opts["env"] = {**(opts.get("env") or {}), **w["env"]}
    return opts


def _job_options(cls: type, base: dict, w: dict, extra: dict) -> dict:
    """A dask-jobqueue job's options for worker ``w``: one worker per job, named, with the pool's
    threads and resources on its ``dask worker`` line and its environment exported first."""
    opts = {**base, **extra, "processes": 1}
    config = f"jobqueue.{opts.get('config_name') or cls.default_config_name()}"
    args = opts.get("worker_extra_args")
    args = list(args if args is not None else dask.config.get(f"{config}.worker-extra-args", []) or [])
    # the job's own --nthreads (cores / processes) comes first on the line; click keeps the last
    resources = ",".join(f"{k}={v}" for k, v in w["resources"].items())
    opts["worker_extra_args"] = [*args, "--nthreads", str(w["nthreads"]), "--resources", resources]
    prologue = opts.get("job_script_prologue")
    prologue = list(prologue if prologue is not None else dask.config.get(f"{config}.job-script-prologue", []) or [])
    env = {**pools.PRE_SPAWN_ENV, **w["env"]}
    opts["job_script_prologue"] = [*prologue, *(f"export {k}={shlex.quote(str(v))}" for k, v in env.items())]
    if "job_name" not in extra:  # e.g. "streamrl-generate-0" in squeue
        opts["job_name"] = f"{base.get('job_name') or 'streamrl'}-{w['name']}"
    opts.pop("name", None)  # SpecCluster passes the spec's key as the name
    return opts


def label(cluster: SpecCluster, recipe: Recipe) -> None:
    """Replace the cluster's workers by the pools' (:func:`pool_specs`) and start them; a worker
    that cannot start (a job the batch system refuses) is one line."""
    specs = pool_specs(cluster, recipe)
    cluster.worker_spec.clear()
    cluster.worker_spec.update(specs)
    try:
        # what scale() schedules on the cluster's loop, awaited here so that a failure is raised
        # in this thread instead of logged on the loop
        cluster.sync(cluster._correct_state)
    except Exception as exc:
        from distributed.core import Status

        for w in getattr(cluster, "_created", ()):
            if w.status == Status.created:
                # its start failed, so nothing of it runs; SpecCluster.close() insists that
                # every worker it created be closed or failed, and would raise over this error
                w.status = Status.failed
        text = message_line(exc, 500)
        raise UserError(f"cluster.factory: {type(cluster).__name__} could not start the pools' workers: "
                        f"{type(exc).__name__}: {text}") from None


def job_scripts(cluster: SpecCluster, specs: dict[str, dict] | None = None) -> dict[str, str]:
    """``{worker name: job script}`` for a dask-jobqueue cluster's ``specs`` (default: its
    workers as they are now): what ``sbatch`` (or ``qsub``...) would run for each. Builds the
    job objects without submitting them."""
    out = {}
    for name, spec in (cluster.worker_spec if specs is None else specs).items():
        if not _is_job(spec["cls"]):
            raise UserError(f"cluster.factory: worker {name} is a {spec['cls'].__name__}, not a job-queue job")
        job = spec["cls"](cluster.scheduler_address, name=name, **spec["options"])
        out[name] = job.job_script()
    return out


def preview(recipe: Recipe) -> dict[str, str]:
    """The job script of every pool worker of the recipe's job-queue factory, without submitting
    anything (``python -m streamrl.cluster.factories R.toml``): the factory's cluster is made (its
    scheduler starts where ``scheduler_options`` say) and closed again."""
    made = create(recipe)
    try:
        if not (labellable(made) and _is_job(made.new_spec["cls"])):
            raise UserError(f"cluster.factory: {recipe.cluster.factory} is not a dask-jobqueue cluster "
                            "(no job scripts)")
        return job_scripts(made, pool_specs(made, recipe))
    finally:
        made.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m streamrl.cluster.factories R.toml [--set k=v ...]``: print each worker's job script."""
    import argparse

    from streamrl.recipe.recipe import load_recipe

    ap = argparse.ArgumentParser(prog="python -m streamrl.cluster.factories", description=main.__doc__)
    ap.add_argument("recipe")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    try:
        scripts = preview(load_recipe(args.recipe, args.sets).recipe)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for name, script in scripts.items():
        print(f"# ---- {name} ----\n{script}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
