"""Stateful objects that live on a worker (an engine, a trainer), held by a ``WorkerPlugin``.

Ordinary Dask tasks reach them with :func:`resident`. Tasks stay visible on the dashboard,
retryable and composable with ``as_completed`` -- which Dask actors are not. The object is built
lazily by the first task that needs it, on that task's thread, so a slow model load never blocks
the worker's event loop (and workers of other pools never build it at all).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from distributed import WorkerPlugin, get_worker

# One build at a time per process: a colocated worker builds an engine and a trainer, and two
# threads importing transformers at once trip over its lazy module loading.
_BUILD_LOCK = threading.Lock()


class Resident(WorkerPlugin):
    """Holds one object built by ``build()`` on each worker that asks for it."""

    def __init__(self, name: str, build: Callable[[], Any], torch_threads: int | None = 1):
        self.name = name  # Dask keys worker plugins by this attribute
        # cloudpickle by hand: Dask pickles a plugin with plain pickle, which ships classes by
        # reference, and a plugin defined in a file next to the recipe is not importable on a
        # worker. cloudpickle honours register_pickle_by_value (see plugins.load_local_module).
        import cloudpickle

        self.build_blob = cloudpickle.dumps(build)
        self.torch_threads = torch_threads

    def setup(self, worker) -> None:
        self.obj = None

    def get(self) -> Any:
        """The object, built on first use."""
        if self.obj is not None:
            return self.obj
        with _BUILD_LOCK:
            if self.obj is None:
                if self.torch_threads:  # None: the object needs no torch (simulation), skip the import
                    import torch

                    torch.set_num_threads(self.torch_threads)  # Nanny workers start with OMP_NUM_THREADS=1
                import cloudpickle

                self.obj = cloudpickle.loads(self.build_blob)()
            return self.obj

    def teardown(self, worker) -> None:
        if getattr(self, "obj", None) is not None and hasattr(self.obj, "close"):
            self.obj.close()


def resident(name: str) -> Any:
    """The object held under ``name`` on the worker running the current task."""
    try:
        plugin = get_worker().plugins[name]
    except KeyError:
        raise RuntimeError(f"no {name!r} on this worker; was the task sent to the right pool?") from None
    return plugin.get()
