"""Served traffic as the run's source of samples: a step extension (``[serve]``).

After placement it starts the endpoint on the first generate worker, and a token server on each
other one (``serve/remote_engines.py``): the endpoint spreads requests over every generate
worker's engine. A watcher keeps that true while the run goes on: a generate worker its nanny
restarted catches up to the newest policy and is served again through a new token server, one
the pool grows by is served from when it joins, and one that leaves is no longer asked. Each step's samples are then a :func:`~streamrl.serve.endpoint.take` of the
endpoint's rewarded traffic (scored by the
recipe's reward on the reward pool when ``serve.reward = "recipe"``) instead of generation of
the task's prompts. Weight publication goes on as in any run: the engine loads each new policy
between two decode steps while the endpoint keeps answering.

A checkpoint keeps the rewarded traffic no step trained yet (``serve_traffic.json``), which a
resumed run trains first; at a stop the step in progress is the last one (no step is fed ahead
to train on nothing).
"""

from __future__ import annotations

import json
import os
import threading
import time
import warnings
from pathlib import Path

from distributed import Future

from streamrl.cluster import lifecycle
from streamrl.errors import RunWarning, UserError
from streamrl.contracts.step_extension import StepExtension
from streamrl.on_worker import task_functions
from streamrl.on_worker.resident import ENGINE
from streamrl.telemetry import bubbles
from streamrl.serve import endpoint, remote_engines

#: How long one take waits for traffic before it is asked again (the run's stop ends it sooner).
TAKE_WAIT_S = 24 * 3600.0

#: The file of a checkpoint that holds the rewarded traffic no step trained yet.
TRAFFIC_FILE = "serve_traffic.json"

#: How often the watcher compares the generate pool with the engines the endpoint serves from:
#: a restarted worker's requests fail (500) until it is served again, once per
#: ``openai_api.UNHEALTHY_S`` while the endpoint passes it over.
REPLICA_WATCH_S = 2.0

#: How long a restarted worker may take to catch up and start its token server (the catch-up's
#: own waits, and some) before the watcher gives up on it for this round.
REPLICA_START_S = 300.0


class ServedTraffic(StepExtension):
    """Starts the endpoint, feeds each step its rewarded traffic, records the endpoint's counts."""

    order = 10

    def __init__(self, context):
        r = context.recipe
        self.client, self.config = context.client, r.serve
        self.model_name = r.serve.model_name or r.run.name
        self.max_staleness = r.run.max_staleness
        self.reward_limit = r.reward.limit
        self.steps = r.run.steps
        self.topology = context.topology
        self.tool_parser = r.serve.build_tool_parser(context.resolved.registry)
        self.pin: dict | None = None
        self._last_take: Future | None = None
        self.context = context
        self.replicas: dict[str, str] = {}
        """``{worker name: its address when its token server started}``: the other generate
        workers whose engines the endpoint also serves from."""
        self.replicas_restarted = 0
        """How many times a generate worker was served again (restarted, or its token server
        gone), this run."""
        self._replicas_lock = threading.Lock()
        self._watching = threading.Event()
        self._watcher: threading.Thread | None = None
        self._failing: set[str] = set()  # workers the watcher could not serve at its last look
        self._unchecked = False  # the watcher's last look failed
        self.worker = ""
        self.url = ""
        self.stop_requested = False
        self.restored = 0
        """Samples a resumed run took back from its checkpoint (trained before new traffic)."""

    def placed(self, context) -> None:
        """Start the endpoint on the first generate worker."""
        self._last_take = None
        self.worker = sorted(self.topology.generate)[0]
        self.pin = self.topology.pins[self.worker]
        try:
            # it answers 503 until started(): the variants and replicas the run adds are in by then
            self.url = self.client.submit(endpoint.start, self.config.model_dump(), self.model_name,
                                          endpoint.ship(self.tool_parser), ready=False,
                                          reward_limit=self.reward_limit, pure=False,
                                          key=f"serve-start-{time.time_ns()}", **self.pin).result()
        except ValueError as e:  # a setting the endpoint cannot work with: the user's to fix, in one line
            raise UserError(str(e)) from None
        with self._replicas_lock:
            self.replicas = {}
            for worker in sorted(self.topology.generate)[1:]:
                self._serve_replica(worker, None)

    def _serve_replica(self, worker: str, min_version: int | None) -> None:
        """Start a token server on generate worker ``worker`` and serve from it (``min_version``:
        a restarted worker's engine first catches up to the newest policy; None: at placement,
        where every engine holds the run's starting weights). Its address is noted first: a
        restart while it starts is seen at the next look."""
        address = self.topology.address(worker) or ""
        pin = self.topology.pins[worker]
        if min_version is None:
            started = self.client.submit(remote_engines.start, ENGINE, pure=False,
                                         key=f"serve-replica-{worker}-{time.time_ns()}", **pin)
        else:
            started = self.client.submit(remote_engines.restart, ENGINE, min_version, pure=False,
                                         key=f"serve-replica-restart-{worker}-{time.time_ns()}", **pin)
        url, key = started.result(timeout=REPLICA_START_S)
        if self._watching.is_set():  # the run closed while it started: nobody else would stop it
            self.client.submit(remote_engines.stop, ENGINE, pure=False, key=f"serve-replica-stop-{time.time_ns()}",
                               **pin).result(timeout=30)
            return
        self.client.submit(endpoint.add_replica, url, key, worker, pure=False,
                           key=f"serve-add-replica-{time.time_ns()}", **self.pin).result(timeout=30)
        self.replicas[worker] = address

    def _watch_replicas(self) -> None:
        """Watcher thread: every :data:`REPLICA_WATCH_S`, serve again each generate worker that
        came back at another address (its nanny restarted it), serve one that joined the pool,
        and stop asking one that left it. A worker not up yet is looked at again next time; a
        failure to serve one is a warning, and the next look tries again."""
        while not self._watching.wait(REPLICA_WATCH_S):
            with self._replicas_lock:
                try:
                    self._reconcile_replicas()
                    self._unchecked = False
                except Exception as e:  # noqa: BLE001 -- the run goes on with the engines it has
                    if not self._unchecked and not self._watching.is_set():  # (once, not every look)
                        warnings.warn(f"serve: the generate workers could not be checked ({type(e).__name__}: {e}); "
                                      "looking again while the run goes on", RunWarning, stacklevel=1)
                    self._unchecked = True

    def _reconcile_replicas(self) -> None:
        up = lifecycle.addresses(self.client)
        pool = set(self.topology.generate) - {self.worker}  # (a copy: the controller changes it between steps)
        for worker in sorted(set(self.replicas) - pool):  # left the pool (an elastic pool retires it)
            self.client.submit(endpoint.remove_replica, worker, pure=False,
                               key=f"serve-remove-replica-{time.time_ns()}", **self.pin).result(timeout=30)
            del self.replicas[worker]
            if worker in up:  # sent no more requests: the pool may retire it once those it runs have ended
                self.client.run(bubbles.takes_requests, False, workers=[up[worker]], on_error="ignore")
        # a request failed to reach one at the address it was served at: restarted at the same
        # address (a worker started with a fixed port), or its token server is gone
        # (client.run: asked in the workers' event loops, not as tasks -- nothing in the task
        # stream every 2 s, and no wait behind a busy worker's threads)
        gone = set()
        if self.replicas and self.worker in up:
            failing = self.client.run(endpoint.failing_replicas, 2 * REPLICA_WATCH_S, workers=[up[self.worker]])
            for worker in next(iter(failing.values()), []):
                if worker in pool and worker in up and self.replicas.get(worker) == up[worker]:
                    serving = self.client.run(remote_engines.serving, ENGINE, workers=[up[worker]])
                    if not next(iter(serving.values()), True):
                        gone.add(worker)
        for worker in sorted(pool):
            address = up.get(worker)
            if address is None or (self.replicas.get(worker) == address and worker not in gone):
                continue  # down (its nanny is bringing it back), or served as it is
            restarted = worker in self.replicas  # (else it joined the pool, up to date already)
            version = self.context.version if self.context.publishes else 0
            try:
                self._serve_replica(worker, version)
            except Exception as e:  # noqa: BLE001 -- that worker is not served for now; the next look tries again
                if worker not in self._failing and not self._watching.is_set():  # (once, not every look)
                    warnings.warn(f"serve: generate worker {worker} could not be served ({type(e).__name__}: {e}); "
                                  "trying again while the run goes on", RunWarning, stacklevel=1)
                self._failing.add(worker)
                continue
            self._failing.discard(worker)
            if restarted:
                self.replicas_restarted += 1
                warnings.warn(f"serve: generate worker {worker} is served again (it was restarted, or its token "
                              f"server was gone), with policy v{version} or newer", RunWarning, stacklevel=1)

    def started(self, run_dir: Path) -> list[str]:
        """The endpoint opens (every extension has placed what it serves: the models it lists are
        all there); ``serve.json`` in the run folder (where clients find it), and the line that
        says it."""
        self.client.submit(endpoint.go_live, pure=False, key=f"serve-live-{time.time_ns()}", **self.pin).result(timeout=30)
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch_replicas, name="streamrl-serve-replicas", daemon=True)
            self._watcher.start()
        # written whole, then renamed: a client polling for the file never reads half of it
        tmp = run_dir / "serve.json.tmp"
        tmp.write_text(json.dumps({"url": self.url, "model": self.model_name, "worker": self.worker}) + "\n")
        os.replace(tmp, run_dir / "serve.json")
        key = " (Authorization: Bearer <serve.api_key>)" if self.config.api_key else ""
        workers = f" on {1 + len(self.replicas)} generate workers" if self.replicas else ""
        kept = f"; {self.restored} rewarded samples from the checkpoint are trained first" if self.restored else ""
        return [f"serving: {self.url} model={self.model_name}{key}{workers}; rewards from "
                + ("POST /v1/feedback" if self.config.reward == "feedback" else "the recipe's [reward]") + kept]

    def samples(self, step: int, min_version: int) -> list[Future]:
        """The step's samples: ``serve.samples_per_step`` rewarded served samples, none generated
        before policy ``step - run.max_staleness`` (a token older than that is too stale)."""
        # each take after the last: the steps asked ahead (async) get the traffic in step order
        taken = self.client.submit(endpoint.take, step, self.config.samples_per_step, max(0, step - self.max_staleness),
                                   TAKE_WAIT_S, after=self._last_take, pure=False,
                                   key=f"serve-take-{step}-{time.time_ns()}", **self.pin)
        self._last_take = taken
        if self.config.reward == "feedback":
            return [taken]
        return [self.client.submit(task_functions.score_groups, taken, key=f"serve-reward-{step}-{time.time_ns()}",
                                   resources={"reward": 1}, retries=1)]

    def record(self, step: int, record) -> None:
        """The endpoint's counters as ``serve/<name>`` (totals since it started)."""
        try:
            stats = self.client.submit(endpoint.stats, step, pure=False, **self.pin).result(timeout=30)
        except Exception:  # noqa: BLE001 -- the counters are a report; the step goes on without them
            return
        record.extra.update({f"serve/{k}": v for k, v in stats.items()})
        record.extra["serve/replicas_restarted"] = self.replicas_restarted

    def checkpoint(self, next_step: int, previous: Path | None):
        """The rewarded traffic no step before ``next_step`` trained into the checkpoint
        (:data:`TRAFFIC_FILE`): clients were told their rewards were accepted, and a resumed run
        trains them. At the run's last checkpoint (a stop, or its last step) one line counts what
        is kept and what cannot be (requests not wholly rewarded), and feedback is refused from
        then on."""
        if self.pin is None:
            return None
        final = self.stop_requested or next_step >= self.steps

        def write(folder: Path) -> None:
            try:
                groups, lost = self.client.submit(endpoint.untrained, next_step, final, pure=False,
                                                  key=f"serve-untrained-{time.time_ns()}", **self.pin).result(timeout=30)
            except Exception as e:  # noqa: BLE001 -- the endpoint's worker is gone, and its traffic with it
                warnings.warn(f"serve: the endpoint's traffic could not be read for the checkpoint ({type(e).__name__}: "
                              f"{e}); it holds none", RunWarning, stacklevel=1)
                return
            (folder / TRAFFIC_FILE).write_text(json.dumps({"next_step": next_step, "groups": groups, "not_kept": lost}))
            kept = sum(len(g) for g in groups)
            if final and (kept or lost["waiting"] or lost["accepted"]):
                warnings.warn(f"serve: {kept} rewarded samples no step trained are kept in the checkpoint (a resume "
                              f"trains them first); not kept: {lost['waiting']} samples waiting for a reward, and "
                              f"{lost['accepted']} accepted rewards of requests not wholly rewarded; feedback is "
                              "refused from now on", RunWarning, stacklevel=1)
        return write

    def resume(self, checkpoint: Path) -> None:
        """Take back the rewarded traffic ``checkpoint`` kept: the first steps train it."""
        saved = checkpoint / TRAFFIC_FILE
        if self.pin is None or not saved.exists():
            return
        groups = json.loads(saved.read_text())["groups"]
        if groups:
            self.restored = self.client.submit(endpoint.restore, groups, pure=False,
                                               key=f"serve-restore-{time.time_ns()}", **self.pin).result(timeout=30)

    def stopping(self) -> None:
        """The run is stopping: the take waiting for traffic returns what is ready, and the step
        in progress is the last -- none is fed ahead of the checkpoint, where it would train on
        nothing (the rewarded traffic left is kept in the checkpoint instead)."""
        self.stop_requested = True
        self.holds_boundary = True  # (read by the controller after each publication)
        if self.pin is not None:
            try:
                self.client.submit(endpoint.release, pure=False, key=f"serve-release-{time.time_ns()}",
                                   **self.pin).result(timeout=30)
            except Exception:  # noqa: BLE001 -- a worker already gone has nothing to release
                pass

    def close(self) -> None:
        """Stop the endpoint (a take still waiting returns) and the other workers' token servers."""
        self._watching.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)  # (a restart in progress is left to end on its own)
        for worker in list(self.replicas):
            try:
                self.client.submit(remote_engines.stop, ENGINE, pure=False, key=f"serve-replica-stop-{time.time_ns()}",
                                   **self.topology.pins[worker]).result(timeout=30)
            except Exception:  # noqa: BLE001 -- the worker may be gone already: nothing left to stop
                pass
        self.replicas = {}
        if self.pin is None:
            return
        try:
            self.client.submit(endpoint.stop, pure=False, key=f"serve-stop-{time.time_ns()}", **self.pin).result(timeout=30)
        except Exception:  # noqa: BLE001 -- the worker may be gone already: nothing left to stop
            pass
