"""Served traffic as the run's source of samples: a step extension (``[serve]``).

After placement it starts the endpoint on the first generate worker, and a token server on each
other one (``serve/remote_engines.py``): the endpoint spreads requests over every generate
worker's engine. Each step's samples are then a :func:`~streamrl.serve.endpoint.take` of the
endpoint's rewarded traffic (scored by the
recipe's reward on the reward pool when ``serve.reward = "recipe"``) instead of generation of
the task's prompts. Weight publication goes on as in any run: the engine loads each new policy
between two decode steps while the endpoint keeps answering.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from distributed import Future

from streamrl.errors import UserError
from streamrl.contracts.step_extension import StepExtension
from streamrl.on_worker import task_functions
from streamrl.on_worker.resident import ENGINE
from streamrl.serve import endpoint, remote_engines

#: How long one take waits for traffic before it is asked again (the run's stop ends it sooner).
TAKE_WAIT_S = 24 * 3600.0


class ServedTraffic(StepExtension):
    """Starts the endpoint, feeds each step its rewarded traffic, records the endpoint's counts."""

    order = 10

    def __init__(self, context):
        r = context.recipe
        self.client, self.config = context.client, r.serve
        self.model_name = r.serve.model_name or r.run.name
        self.max_staleness = r.run.max_staleness
        self.topology = context.topology
        self.tool_parser = r.serve.build_tool_parser(context.resolved.registry)
        self.pin: dict | None = None
        self._last_take: Future | None = None
        self.replicas: list[dict] = []
        """The pins of the other generate workers whose engines the endpoint also serves from."""
        self.worker = ""
        self.url = ""

    def placed(self, context) -> None:
        """Start the endpoint on the first generate worker."""
        self._last_take = None
        self.worker = sorted(self.topology.generate)[0]
        self.pin = self.topology.pins[self.worker]
        try:
            # it answers 503 until started(): the variants and replicas the run adds are in by then
            self.url = self.client.submit(endpoint.start, self.config.model_dump(), self.model_name,
                                          endpoint.ship(self.tool_parser), ready=False, pure=False,
                                          key=f"serve-start-{time.time_ns()}", **self.pin).result()
        except ValueError as e:  # a setting the endpoint cannot work with: the user's to fix, in one line
            raise UserError(str(e)) from None
        self.replicas = []
        for worker in sorted(self.topology.generate)[1:]:
            pin = self.topology.pins[worker]
            url, key = self.client.submit(remote_engines.start, ENGINE, pure=False,
                                          key=f"serve-replica-{worker}-{time.time_ns()}", **pin).result()
            self.client.submit(endpoint.add_replica, url, key, worker, pure=False,
                               key=f"serve-add-replica-{time.time_ns()}", **self.pin).result()
            self.replicas.append(pin)

    def started(self, run_dir: Path) -> list[str]:
        """The endpoint opens (every extension has placed what it serves: the models it lists are
        all there); ``serve.json`` in the run folder (where clients find it), and the line that
        says it."""
        self.client.submit(endpoint.go_live, pure=False, key=f"serve-live-{time.time_ns()}", **self.pin).result(timeout=30)
        (run_dir / "serve.json").write_text(json.dumps({"url": self.url, "model": self.model_name,
                                                        "worker": self.worker}) + "\n")
        key = " (Authorization: Bearer <serve.api_key>)" if self.config.api_key else ""
        workers = f" on {1 + len(self.replicas)} generate workers" if self.replicas else ""
        return [f"serving: {self.url} model={self.model_name}{key}{workers}; rewards from "
                + ("POST /v1/feedback" if self.config.reward == "feedback" else "the recipe's [reward]")]

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
            stats = self.client.submit(endpoint.stats, pure=False, **self.pin).result(timeout=30)
        except Exception:  # noqa: BLE001 -- the counters are a report; the step goes on without them
            return
        record.extra.update({f"serve/{k}": v for k, v in stats.items()})

    def stopping(self) -> None:
        """The run is stopping: the take waiting for traffic returns what is ready."""
        if self.pin is not None:
            try:
                self.client.submit(endpoint.release, pure=False, key=f"serve-release-{time.time_ns()}",
                                   **self.pin).result(timeout=30)
            except Exception:  # noqa: BLE001 -- a worker already gone has nothing to release
                pass

    def close(self) -> None:
        """Stop the endpoint (a take still waiting returns) and the other workers' token servers."""
        for pin in self.replicas:
            try:
                self.client.submit(remote_engines.stop, ENGINE, pure=False, key=f"serve-replica-stop-{time.time_ns()}",
                                   **pin).result(timeout=30)
            except Exception:  # noqa: BLE001 -- the worker may be gone already: nothing left to stop
                pass
        self.replicas = []
        if self.pin is None:
            return
        try:
            self.client.submit(endpoint.stop, pure=False, key=f"serve-stop-{time.time_ns()}", **self.pin).result(timeout=30)
        except Exception:  # noqa: BLE001 -- the worker may be gone already: nothing left to stop
            pass
