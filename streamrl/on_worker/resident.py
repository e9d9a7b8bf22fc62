"""Stateful objects that live on a worker (an engine, a trainer), held by a ``WorkerPlugin``.

Ordinary Dask tasks reach them with :func:`resident`. Tasks stay visible on the dashboard,
retryable and composable with ``as_completed`` -- which Dask actors are not. The object is built
lazily by the first task that needs it, on that task's thread, so a slow model load never blocks
the worker's event loop (and workers of other pools never build it at all).
"""

from __future__ import annotations

import sys
import threading
import uuid
import zlib
from typing import Any, Callable

from distributed import WorkerPlugin, get_worker

from streamrl.api import close_component

# One build at a time per process: a colocated worker builds an engine and a trainer, and two
# threads importing transformers at once trip over its lazy module loading.
_BUILD_LOCK = threading.Lock()

ENGINE = "streamrl-engine"
TRAINER = "streamrl-trainer"
REWARD = "streamrl-reward"
RANKER = "streamrl-ranker"
TRANSFER = "streamrl-transfer"


class ComponentError(RuntimeError):
    """A component could not be built or loaded on a worker (e.g. a plugin missing there)."""


class ResidentLost(RuntimeError):
    """The worker holding a stateful resident (the trainer) was restarted: its state is gone."""


class Resident(WorkerPlugin):
    """Holds one object built by ``build()`` on each worker that asks for it.

    ``torch_threads`` is applied to torch on the worker when torch is (or becomes) imported;
    ``seed`` seeds torch's generators before the build, mixed with the worker's name so two
    engines do not draw the same samples.
    """

    def __init__(self, name: str, build: Callable[[], Any], torch_threads: int = 1, seed: int = 0, what: str = "",
                 settings: dict[str, Any] | None = None):
        self.name = name  # Dask keys worker plugins by this attribute
        #: What the tasks that use the object need besides it (the reward's ``score_timeout_s``),
        #: read on the worker with :func:`resident_settings`: whichever task runs there, and
        #: whoever submitted it, uses the run's values.
        self.settings = dict(settings or {})
        # cloudpickle by hand: Dask pickles a plugin with plain pickle, which ships classes by
        # reference, and a plugin defined in a file next to the recipe is not importable on a
        # worker. cloudpickle honours register_pickle_by_value (see plugins.load_local_module).
        import cloudpickle

        self.build_blob = cloudpickle.dumps(build)
        self.torch_threads = torch_threads
        self.seed = seed
        self.what = what or name

    def setup(self, worker) -> None:
        self.obj = None
        self.worker_name = str(worker.name)
        # New on every worker process (and every registration): a task that expects the
        # trainer it trained yesterday can tell it is talking to a fresh one.
        self.incarnation = uuid.uuid4().hex

    def _torch(self) -> None:
        # Nanny workers start with OMP_NUM_THREADS=1; components without torch never import it.
        # Under OpenMP the count is each thread's own: set it in every task thread that asks
        # for the object (measured: set only in the thread that built the trainer, a train pool
        # with torch_threads = 2 trained on one thread).
        if "torch" in sys.modules and getattr(_THREAD, "torch_threads", None) != self.torch_threads:
            import torch

            torch.set_num_threads(self.torch_threads)
            _THREAD.torch_threads = self.torch_threads

    def get(self) -> Any:
        """The object, built on first use."""
        if self.obj is not None:
            self._torch()
            return self.obj
        with _BUILD_LOCK:
            if self.obj is None:
                import cloudpickle

                try:
                    build = cloudpickle.loads(self.build_blob)  # imports the component's modules
                    self._torch()
                    if "torch" in sys.modules:
                        import torch

                        torch.manual_seed(self.seed * 1_000_003 + zlib.crc32(self.worker_name.encode()))
                    self.obj = build()
                except Exception as exc:
                    raise ComponentError(f"{self.what} could not be built on worker {self.worker_name}: "
                                         f"{type(exc).__name__}: {exc}") from exc
                self._torch()
            return self.obj

    def teardown(self, worker) -> None:
        if self.obj is not None:
            close_component(self.obj)


#: Per thread: the torch thread count last set in it (``Resident._torch``).
_THREAD = threading.local()


def incarnation(name: str) -> str:
    """The id of the resident ``name`` on this worker (changes when the worker restarts)."""
    return get_worker().plugins[name].incarnation


def expect(name: str, incarnation_id: str | dict[str, str] | None) -> None:
    """Raise :class:`ResidentLost` if ``name`` on this worker is not the incarnation the
    controller built (None: no check; a dict: ``{worker name: id}``, for a task Dask may place
    on any worker of a pool)."""
    if isinstance(incarnation_id, dict):
        incarnation_id = incarnation_id.get(str(get_worker().name), "")
    if incarnation_id is not None and get_worker().plugins[name].incarnation != incarnation_id:
        raise ResidentLost(f"worker {get_worker().name} was restarted and its {name.removeprefix('streamrl-')} "
                           "lost its state")


def resident_settings(name: str) -> dict[str, Any]:
    """The ``settings`` the resident ``name`` on this worker was registered with."""
    return get_worker().plugins[name].settings


def resident(name: str) -> Any:
    """The object held under ``name`` on the worker running the current task."""
    try:
        plugin = get_worker().plugins[name]
    except KeyError:
        raise RuntimeError(f"no {name!r} on this worker; was the task sent to the right pool?") from None
    return plugin.get()
