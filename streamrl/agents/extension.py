"""Agent rollouts as the run's source of samples: a step extension (``[task] name = "agent"``).

After placement it starts an OpenAI-compatible endpoint on every generate worker (any free
loopback port; ``[serve]``'s key and tool parser when the recipe has that table). Each step's
samples are then, per row the task hands out, one task on the agent pool (``pools.agent``, else
the reward pool) that runs the row's ``trainer.samples_per_prompt`` rollouts against those
endpoints and returns their trajectories with their rewards. Weight publication goes on as in
any run: in ``async`` mode a rollout in flight when new weights load goes on with them, its
tokens marked with their versions.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path

from distributed import Future

from streamrl.agents.rollout import EVENT_TOPIC, first_error, run_group
from streamrl.cluster import lifecycle
from streamrl.errors import UserError
from streamrl.contracts.step_extension import StepExtension
from streamrl.flow import submit
from streamrl.recipe.serve import ServeConfig
from streamrl.serve import endpoint


#: Seconds a step's record waits for its groups' counts (``record``).
EVENT_WAIT_S = 2.0

#: Seconds an endpoint may take to start on a generate worker (a restarted one first loads the
#: newest weights: the catch-up's own waits -- two of 120 s at most -- and the load).
ENDPOINT_START_S = 600


class AgentRollouts(StepExtension):
    """Starts the endpoints, submits each step's rollouts, records how they went."""

    order = 10

    def __init__(self, context):
        r = context.recipe
        self.client, self.task, self.recipe = context.client, context.task, r
        serve = r.serve or ServeConfig()
        self.config = serve.model_copy(update={"port": 0})  # one endpoint per generate worker
        self.model_name = serve.model_name or r.run.name
        self.tool_parser = serve.build_tool_parser(context.resolved.registry)
        self.spec = {**context.task.config.spec(), "reward_limit": r.reward.limit}
        self.pool = "agent" if r.pools.agent is not None else "reward"
        self.topology = context.topology
        self.urls: list[str] = []
        """The endpoints this step's rollouts go to, one per generate worker that is up."""
        self.served: dict[str, tuple[str, str]] = {}
        """``worker: (address, url)``: where each generate worker's endpoint was started (a
        worker back at another address was restarted, its endpoint gone with its process)."""
        self._failing: set[str] = set()  # workers whose endpoint could not be started (said once)
        # the run's own rollouts prove themselves with it: the endpoints take no agent call without
        self.rollout_key = secrets.token_urlsafe(24)
        self.seen: set[str] = set()
        self._events_after = 0.0  # the time of the last event counted
        self._by_step: dict[int, list[dict]] = {}  # groups' counts read, by step, not recorded yet
        self._named: set[str] = set()  # the kinds of failure already named on the console
        self._lines: list[str] = []

    def placed(self, context) -> None:
        """Start an endpoint on every generate worker."""
        self.served = {}
        up = lifecycle.addresses(self.client)
        for name in sorted(self.topology.generate):
            try:
                self.served[name] = (up.get(name, ""), self._start(name, 0))
            except ValueError as e:  # a setting the endpoint cannot work with: the user's to fix
                raise UserError(str(e)) from None
        self.urls = [url for _, url in self.served.values()]

    def _start(self, name: str, min_version: int) -> str:
        started = self.client.submit(endpoint.start, self.config.model_dump(), self.model_name,
                                     endpoint.ship(self.tool_parser), self.rollout_key,
                                     reward_limit=self.recipe.reward.limit, min_version=min_version, pure=False,
                                     key=f"agent-endpoint-{name}-{time.time_ns()}", **self.topology.pins[name])
        try:
            return started.result(timeout=ENDPOINT_START_S)
        except BaseException:
            self.client.cancel([started])  # (not left to start later, beside the next try's endpoint)
            raise

    def _reconcile(self, min_version: int) -> None:
        """Before a step's rollouts: an endpoint on each generate worker that is up. A worker its
        nanny restarted (back at another address) lost its endpoint with its process: a new one
        starts there once its engine holds ``min_version``; a worker not up, or whose endpoint
        cannot start, gets no rollouts this step (said once); one that left the pool is
        forgotten."""
        try:
            up = lifecycle.addresses(self.client)
        except Exception:  # noqa: BLE001 -- the scheduler did not answer: the endpoints as they were
            return
        pool = sorted(self.topology.generate)
        for name in set(self.served) - set(pool):
            del self.served[name]
        for name in pool:
            address = up.get(name)
            if address is None or self.served.get(name, ("",))[0] == address:
                continue  # down (its nanny is bringing it back), or served as it is
            try:
                url = self._start(name, min_version)
            except Exception as e:  # noqa: BLE001 -- no rollouts there for now; the next step tries again
                if name not in self._failing:
                    self._failing.add(name)
                    self._lines.append(f"agent rollouts: the endpoint on generate worker {name} could not start "
                                       f"({type(e).__name__}: {str(e)[:200]}); trying again each step")
                continue
            self._failing.discard(name)
            restarted = name in self.served
            self.served[name] = (address, url)
            if restarted:
                self._lines.append(f"agent rollouts: generate worker {name} was restarted; its endpoint is {url}, "
                                   f"with policy v{min_version} or newer")
        urls = [url for name, (address, url) in sorted(self.served.items()) if up.get(name) == address]
        # (none up: the endpoints as they were; the rollouts fail, counted, until one is back)
        self.urls = urls or self.urls

    def started(self, run_dir: Path) -> list[str]:
        """The endpoints' addresses, for the console (an outside client may use them too: answered, not trained on)."""
        return [f"agent rollouts on the {self.pool} pool against {len(self.urls)} endpoint(s): {', '.join(self.urls)}"]

    def samples(self, step: int, min_version: int) -> list[Future]:
        """The step's rows, each rolled out ``trainer.samples_per_prompt`` times on the agent pool."""
        t = self.recipe.trainer
        prompts = self.task.prompts(step, t.prompts_per_step)
        submit.check_prompts("agent", step, prompts, t.prompts_per_step, self.seen)
        self._reconcile(min_version)
        n, out = t.samples_per_prompt, []
        for i, prompt in enumerate(prompts):
            out.append(self.client.submit(run_group, prompt, n, self.urls, self.spec, self.config.api_key, step,
                                          first=i * n, rollout_key=self.rollout_key, key=f"agent-{step}-{prompt.uid}-{time.time_ns()}", pure=False,
                                          resources={self.pool: 1}, retries=1))
        return out

    def record(self, step: int, record) -> None:
        """``turns_mean`` (model calls per rollout), ``tool_calls_mean`` and the rollouts'
        failures (``agent/errors``, ``agent/timeouts``, ``agent/no_calls``, ``agent/splits``)
        and ``agent/crossed_updates`` (rollouts that went on across a weight update), over the
        step's groups (and any of earlier steps not recorded yet); ``agent/stuck``: the rollouts
        abandoned at their timeout still running on a worker (``agents/rollout.py``)."""
        # a group's counts reach the scheduler as an event, a moment after its result: wait (a
        # little) for this step's groups. Events are kept by step, so that a group of the next
        # step (asked ahead) waits for the next record instead of landing in this one.
        deadline = time.time() + EVENT_WAIT_S
        while True:
            try:
                events = self.client.get_events(EVENT_TOPIC)
            except Exception:  # noqa: BLE001 -- the counts are a report; the step goes on without them
                return
            for at, msg in events:
                if at > self._events_after:
                    self._by_step.setdefault(msg.get("step", step), []).append(msg)
            if events:
                self._events_after = max(self._events_after, max(at for at, _ in events))
            if len(self._by_step.get(step, [])) >= self.recipe.trainer.prompts_per_step or time.time() > deadline:
                break
            time.sleep(0.05)
        new = [m for k in sorted(self._by_step) if k <= step for m in self._by_step.pop(k)]
        rollouts = sum(m["rollouts"] for m in new)
        if not rollouts:
            return
        record.extra["turns_mean"] = round(sum(m["calls"] for m in new) / rollouts, 4)
        record.extra["tool_calls_mean"] = round(sum(m["tool_calls"] for m in new) / rollouts, 4)
        for key in ("errors", "timeouts", "no_calls", "splits", "crossed_updates"):
            record.extra[f"agent/{key}"] = sum(m[key] for m in new)
        # (a worker's count, not the step's: the most any of its groups saw)
        record.extra["agent/stuck"] = max(m.get("stuck", 0) for m in new)
        first = ""
        for m in new:
            if m["first_error"]:
                first = first_error(first, m["first_error"])
        if first:
            record.extra["agent/first_error"] = first
            kind = first.split(":", 1)[0]
            if kind not in self._named:
                self._named.add(kind)
                self._lines.append(f"agent rollouts: {first[:200]} (counted per step as agent/errors, agent/timeouts, "
                                   "agent/no_calls; each kind named here once)")

    def between_steps(self, done: int, run_dir: Path) -> list[str]:
        """A kind of rollout failure not seen before, named once on the console."""
        lines, self._lines = self._lines, []
        return lines

    def close(self) -> None:
        """Stop the endpoints."""
        for name in self.served:
            try:
                self.client.submit(endpoint.stop, pure=False, key=f"agent-endpoint-stop-{time.time_ns()}",
                                   **self.topology.pins[name]).result(timeout=30)
            except Exception:  # noqa: BLE001 -- the worker may be gone already: nothing left to stop
                pass
        self.served = {}
