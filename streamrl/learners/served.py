"""Variants served side by side: each side learner's policy behind the run's endpoint (``[serve]``
with ``[[learners]]``; ``serve.variants``), as a step extension after the side learners'.

Once the learners are placed (and whenever one is added or removed between steps) each learner
still training is served under a model ``<model_name>/<learner>``; the served learner's name is an
alias of the served policy. The traffic of every variant joins the one stream: every learner
trains on all of it. A variant is answered in one of two ways:

- **a LoRA learner, when the engine holds adapters** (``engine.adapters``, with ``slots``
  batching): by the served policy's own engines on the generate pool, with the learner's adapter
  (``serve/adapter_routes.py``). After each step a learner is handed, its adapter -- a few MB --
  goes from its worker to every generate worker's engine, right after that step's optimizer step;
  its requests decode in the same steps as everyone's, so every variant has the served policy's
  latency;
- **otherwise**: by an engine beside the learner's trainer, behind a token server on its worker
  (``serve/remote_engines.py``), which takes the trainer's weights in that process after each of
  its steps.
"""

from __future__ import annotations

import time
import warnings
from functools import partial
from pathlib import Path

from streamrl.errors import RunWarning
from streamrl.contracts.step_extension import StepExtension
from streamrl.flow.placement import build_engine
from streamrl.learners.evaluate import engine_resident
from streamrl.learners.extension import SideLearners
from streamrl.on_worker import task_functions, weight_tasks
from streamrl.on_worker.resident import ENGINE, Resident, resident
from streamrl.serve import endpoint, remote_engines
from streamrl.telemetry.text import error_line


def trained_through(lr) -> int:
    """The version a side learner's policy is served as: the stream's steps it has trained
    through (its last step plus one; before its first, the step it joined at)."""
    return lr.joined_at if lr.last_step is None else lr.last_step + 1


def load_adapter(learner: str, payload: bytes, version: int) -> int:
    """Generate worker: the engine holds learner ``learner``'s adapter (``payload``: its
    publication's safetensors bytes) as of ``version``; returns the version."""
    from streamrl.training.weights_bytes import weights_from_bytes

    resident(ENGINE).load_adapter(learner, weights_from_bytes(payload), version)
    return version


def unload_adapter(learner: str) -> None:
    """Generate worker: the engine forgets learner ``learner``'s adapter."""
    unload = getattr(resident(ENGINE), "unload_adapter", None)  # (an engine plugin may hold none)
    if unload is not None:
        unload(learner)


class ServedVariants(StepExtension):
    """Serves every side learner's policy from its worker, beside the run's."""

    order = 60

    def __init__(self, context, traffic):
        self.context = context
        self.traffic = traffic
        """The run's :class:`~streamrl.serve.extension.ServedTraffic` (its endpoint's worker)."""
        self.served: dict[str, str] = {}
        """Learner name -> the model its policy answers."""
        self.serving: dict[str, object] = {}
        """Learner name -> the learner it was served for (one removed and added again under its
        name is another, served anew)."""
        self._registered: set[str] = set()
        self._refreshing: dict[str, list] = {}  # learner name -> its weight loads not seen finished
        self._failed: set[str] = set()  # learners whose engine could not take their weights (said once)
        self.on_adapters: set[str] = set()
        """Learners served as an adapter in the generate pool's engines (not by an engine of their own)."""

    def _fanout(self):
        learners = self.context.extension(SideLearners)
        return learners.fanout if learners is not None else None

    def placed(self, context) -> None:
        """The served learner's alias, and a variant for each side learner."""
        self.served, self.serving, self._registered = {}, {}, set()
        main = context.resolved.learners[0]
        if len(context.resolved.learners) > 1 and main.served:
            self._endpoint(endpoint.alias, remote_engines.variant_model(self.traffic.model_name, main.name))
        self._sync()

    def started(self, run_dir: Path) -> list[str]:
        """A line naming the variants served."""
        if not self.served:
            return []
        return ["variants: " + ", ".join(f"{model} ({name}'s policy)" for name, model in self.served.items())]

    def trained(self, step: int, scored) -> None:
        """Each variant's engine takes its learner's weights once it has trained step ``step``."""
        fanout = self._fanout()
        for name in self.served:
            lr = fanout.learners.get(name) if fanout else None
            if lr is None or lr.state != "training" or not lr.inflight or lr.inflight[-1].step != step:
                continue  # (it skipped the step: nothing new to load)
            # priority 1: right after the optimizer step, before the learner's next train tasks
            self._check(name)
            # (held: a future no client holds is forgotten, and its task may never run)
            if name in self.on_adapters:
                self._refreshing.setdefault(name, []).extend(self._push_adapter(lr, step + 1, lr.inflight[-1].last))
                continue
            self._refreshing.setdefault(name, []).append(self.context.client.submit(
                remote_engines.refresh, engine_resident(name), lr.plan.resident, step + 1, after=lr.inflight[-1].last,
                key=f"variant-refresh-{name}-{step}-{time.time_ns()}", priority=1, pure=False, **lr.view.train_pin))

    def between_steps(self, done: int, run_dir: Path) -> list[str]:
        """Learners added or removed since the last step: served, or no longer."""
        return self._sync()

    def resume(self, checkpoint: Path) -> None:
        """Learners the checkpoint placed again are served again, and every variant's engine
        takes its learner's restored weights."""
        self._sync()
        fanout = self._fanout()
        for name in self.served:
            lr = fanout.learners[name]
            try:
                if name in self.on_adapters:
                    for load in self._push_adapter(lr, trained_through(lr)):
                        load.result(timeout=self.context.recipe.cluster.startup_timeout)
                    continue
                self.context.client.submit(remote_engines.refresh, engine_resident(name), lr.plan.resident,
                                           trained_through(lr), pure=False,
                                           key=f"variant-refresh-{name}-resume-{time.time_ns()}",
                                           **lr.view.train_pin).result(timeout=self.context.recipe.cluster.startup_timeout)
            except Exception as exc:  # noqa: BLE001 -- a variant that cannot take its weights is said; the run goes on
                warnings.warn(RunWarning(f"variant {self.served[name]!r} could not take learner {name!r}'s restored "
                                         f"weights ({error_line(exc, 300)}); it serves the weights it has"),
                              stacklevel=2)

    def close(self) -> None:
        """Stop the learners' token servers (the endpoint stops with the run)."""
        fanout = self._fanout()
        for name in list(self.served):
            lr = fanout.learners.get(name) if fanout else None
            if lr is not None and name not in self.on_adapters:
                self._stop_server(lr)
        self.served, self._refreshing, self.on_adapters = {}, {}, set()

    # -- what it does ---------------------------------------------------------------------------
    def _check(self, name: str) -> None:
        # the loads that finished: one that failed is said once (the variant goes on serving the
        # weights it has; the learner's own training is not touched)
        pending = []
        for f in self._refreshing.get(name, []):
            if not f.done():
                pending.append(f)
            elif f.status == "error" and name not in self._failed:
                self._failed.add(name)
                exc = f.exception()
                warnings.warn(RunWarning(f"variant {self.served.get(name, name)!r} could not take learner {name!r}'s "
                                         f"new weights ({type(exc).__name__}: {exc}); it serves the weights it has"),
                              stacklevel=2)
        self._refreshing[name] = pending

    def _sync(self) -> list[str]:
        fanout = self._fanout()
        if fanout is None:
            return []
        lines = []
        for name, lr in fanout.learners.items():
            # (a failed learner learns no more, and its worker may be gone with its token server:
            # its variant goes as a removed one's does, rather than answer 500s or stale weights;
            # so does one removed and added again between two looks, whose server is the old one's)
            old = self.serving.get(name, lr)
            if name in self.served and (lr.state in ("removed", "failed") or old is not lr):
                self.serving.pop(name, None)
                self._failed.discard(name)  # (one added again under its name has its own failures said)
                model = self.served.pop(name)
                try:
                    self._endpoint(endpoint.remove_variant, model)
                except Exception as exc:  # noqa: BLE001 -- the endpoint's worker busy or gone: said, the run goes on
                    warnings.warn(RunWarning(f"variant {model!r} could not be taken off the endpoint "
                                             f"({error_line(exc, 300)})"), stacklevel=2)
                if name in self.on_adapters:
                    self.on_adapters.discard(name)
                    # its loads still on their way land first: one landing after the unload
                    # would take an index again, for a learner that has left
                    for f in self._refreshing.pop(name, []):
                        try:
                            f.result(timeout=30)
                        except Exception:  # noqa: BLE001 -- a failed or lost load holds nothing
                            pass
                    for f in self._on_generate(unload_adapter, name, key=f"variant-unload-{name}"):
                        try:
                            f.result(timeout=30)
                        except Exception:  # noqa: BLE001 -- that worker is gone: its engine with it
                            pass
                else:
                    self._stop_server(old)
                    # (its engine's plugin went with it: one added again under its name registers anew)
                    self._registered.discard(engine_resident(name))
                lines.append(f"variant {name!r}: no longer served (the learner "
                             f"{'failed' if old.state == 'failed' else 'left'})")
            if lr.state == "training" and name not in self.served:
                model = self._start(lr)
                if model:
                    lines.append(f"variant {model!r}: served ({name}'s policy)")
        return lines

    def _adapter_room(self, lr) -> bool:
        """Whether learner ``lr``'s variant can be an adapter in the generate pool's engines: it
        trains a LoRA adapter, the engine holds adapters and streams (slot batching), and one of
        the engine's adapters is free (the served policy's takes one when it is LoRA too)."""
        r = self.context.resolved
        engine = r.engine.capabilities()
        if not (lr.plan.trainer.capabilities().adapter and engine.adapters and engine.streams):
            return False
        if lr.plan.added:  # (added while running: its base may be a policy saved then, not the engines')
            return False
        if not r.learners[0].trainer.capabilities().adapter:  # (a full policy reloads the engines' base each step)
            return False
        taken = len(self.on_adapters) + (1 if r.learners[0].trainer.capabilities().adapter else 0)
        return taken < engine.adapters

    def _on_generate(self, fn, *args, key: str) -> list:
        """``fn(*args)`` on every live generate worker; the futures."""
        pins = self.context.topology.live_generate_pins()
        return [self.context.client.submit(fn, *args, key=f"{key}-{worker}-{time.time_ns()}", pure=False,
                                           priority=weight_tasks.LOAD_PRIORITY, **pin)
                for worker, pin in pins.items()]

    def _push_adapter(self, lr, version: int, after=None) -> list:
        """Learner ``lr``'s adapter, from its worker (after ``after``: its optimizer step) into
        every generate worker's engine, as ``version``; the loads' futures."""
        payload = self.context.client.submit(task_functions.trainer_weights, after=after, trainer=lr.plan.resident,
                                             key=f"variant-adapter-{lr.name}-v{version}-{time.time_ns()}", priority=1,
                                             pure=False, **lr.view.train_pin)
        return self._on_generate(load_adapter, lr.name, payload, version, key=f"variant-load-{lr.name}-v{version}")

    def _start_on_adapters(self, lr) -> str | None:
        # Not waited for: the learner's worker may be busy for a while (its evaluation of the
        # starting policy), and until the adapter lands a request decodes on the base weights,
        # which is what an adapter not trained yet computes (its B is zero: version 0). A resume,
        # whose adapters have trained, waits for them (:meth:`resume`).
        name = lr.name
        model = remote_engines.variant_model(self.traffic.model_name, name)
        try:
            self._refreshing.setdefault(name, []).extend(self._push_adapter(lr, trained_through(lr)))
            self._endpoint(endpoint.add_adapter_variant, model, name)
        except Exception as exc:  # noqa: BLE001 -- a variant not served is reported; the run and the others go on
            warnings.warn(RunWarning(f"variant {model!r} is not served: {type(exc).__name__}: {exc}"), stacklevel=2)
            return None
        self.on_adapters.add(name)
        self.served[name], self.serving[name] = model, lr
        return model

    def _start(self, lr) -> str | None:
        if self._adapter_room(lr):
            return self._start_on_adapters(lr)
        context, name = self.context, lr.name
        engine = engine_resident(name)
        if lr.evaluator is None and engine not in self._registered:
            # (with [eval] the learner's evaluation engine is this one, registered already)
            r = context.resolved
            context.client.register_plugin(Resident(engine, partial(build_engine, r.engine, r.model_path),
                                                seed=r.recipe.run.seed, what=f"learner {name!r}'s engine"))
        self._registered.add(engine)
        model = remote_engines.variant_model(self.traffic.model_name, name)
        try:
            url, key = context.client.submit(remote_engines.start, engine, lr.plan.resident, trained_through(lr), pure=False,
                                         key=f"variant-start-{name}-{time.time_ns()}",
                                         **lr.view.train_pin).result(timeout=context.recipe.cluster.startup_timeout)
            self._endpoint(endpoint.add_variant, model, url, key, name, lr.plan.worker)
        except Exception as exc:  # noqa: BLE001 -- a variant not served is reported; the run and the others go on
            warnings.warn(RunWarning(f"variant {model!r} is not served: {type(exc).__name__}: {exc}"), stacklevel=2)
            return None
        self.served[name], self.serving[name] = model, lr
        return model

    def _stop_server(self, lr) -> None:
        try:
            self.context.client.submit(remote_engines.stop, engine_resident(lr.name), pure=False,
                                   key=f"variant-stop-{lr.name}-{time.time_ns()}", **lr.view.train_pin).result(timeout=30)
        except Exception:  # noqa: BLE001 -- its worker is gone: nothing left to stop
            pass

    def _endpoint(self, fn, *args):
        return self.context.client.submit(fn, *args, pure=False, key=f"serve-variants-{time.time_ns()}",
                                      **self.traffic.pin).result(timeout=30)
