"""The events of ``trace.json`` (Chrome trace event format, which Perfetto opens), built from
``metrics.jsonl`` records and Dask's task stream; ``telemetry/trace.py`` records and writes them.

Tracks: a process per pool (``generate pool``: threads ``<worker> tasks``, the Dask tasks each
worker ran), a process per worker of per-sample slices (``generate-0 samples``: threads
``generate-0 samples``) and a ``controller`` process (steps, weight sync, the policy version and
idle-ratio counters).

Perfetto draws slices of one thread only when they nest; tasks on a worker with several threads
and samples batched in one engine overlap, so :class:`Tracks` lays each track's slices out in
*lanes* (threads of the same name), a lane taking a slice only once its last one ended. Times
are epoch microseconds, as Dask and ``sample_log`` give them in seconds.
"""

from __future__ import annotations

import re

#: pools in the order of their ``process_sort_index`` (Perfetto lists processes by slice count instead)
POOL_ORDER = ("generate", "reward", "train")

#: task-key prefixes whose number is the policy version they carry, not the step (``flow/weights.py``)
VERSIONED = ("export-weights", "relay-weights", "load-weights", "eval-generate", "eval-reward", "eval-summary")

#: seconds a sample's time may fall outside the task stream's span of the task that holds it:
#: Dask moves task times to the scheduler's clock (a heartbeat's estimate), samples keep the worker's
CLOCK_SLACK = 0.25


#: seconds a task may seem to start before the previous one on its thread ended: Dask's clock
#: correction (re-estimated at each heartbeat) makes back-to-back tasks overlap by a millisecond or
#: two; such a task is trimmed to start where the other ended instead of opening a lane of its own
TASK_SLACK = 0.01


def us(seconds: float) -> int:
    """Epoch seconds as the trace's integer microseconds."""
    return int(round(seconds * 1e6))


def pool_of(worker: str) -> str:
    """The pool of a worker named ``<pool>-<i>`` (streamrl's names; anything else is its own pool)."""
    head, _, tail = worker.rpartition("-")
    return head if head and tail.isdigit() else worker


def key_parts(key) -> tuple[str, int | None]:
    """A task key's prefix and number: ``("generate-3", "3-000+15")`` -> ``("generate", 3)``
    (``telemetry/spans.py``), ``"load-engine-generate-0"`` -> ``("load-engine", None)``."""
    head = str(key[0]) if isinstance(key, (list, tuple)) and key else str(key)
    if isinstance(key, (list, tuple)):
        m = re.fullmatch(r"(.+)-(\d+)", head)
        return (m.group(1), int(m.group(2))) if m else (head, None)
    from dask.utils import key_split

    return key_split(head), None


def key_text(key) -> str:
    """A key as users read it: ``generate-3/3-000+15`` for a tuple key."""
    return "/".join(map(str, key)) if isinstance(key, (list, tuple)) else str(key)


class Tracks:
    """Processes and threads of the trace, and the lanes of each track (see the module docstring).

    Perfetto lists a process's threads by tid (a thread whose tid is the pid first), so tids
    count up in the order threads are made, skipping the pid: a pool's task lanes come before
    its sample lanes. All lanes of a track share its name (``generate-0 tasks``); Perfetto adds
    the tid. ``meta`` collects the metadata (``M``) events of every process and thread made."""

    def __init__(self):
        self.pids: dict[str, int] = {}
        self.tids: dict[tuple[int, str, int], int] = {}
        self.next_tid: dict[int, int] = {}
        self.lane_ends: dict[tuple[int, str], list[float]] = {}
        self.meta: list[dict] = []

    def process(self, name: str, sort: int) -> int:
        """The pid of process ``name`` (``sort``: its place for viewers that honour it), made on first use."""
        if name not in self.pids:
            pid = self.pids[name] = len(self.pids) + 1
            self.meta += [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}},
                          {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": sort}}]
        return self.pids[name]

    def pool(self, pool: str) -> int:
        """The pid of a pool's task process, ``<pool> pool``."""
        rank = POOL_ORDER.index(pool) if pool in POOL_ORDER else len(POOL_ORDER)
        return self.process(f"{pool} pool", 1 + rank)

    def samples(self, worker: str) -> int:
        """The pid of a worker's sample process, ``<worker> samples``."""
        pool = pool_of(worker)
        rank = POOL_ORDER.index(pool) if pool in POOL_ORDER else len(POOL_ORDER)
        return self.process(f"{worker} samples", 20 + rank)

    def thread(self, pid: int, name: str, lane: int = 0) -> int:
        """The tid of lane ``lane`` of track ``name`` in process ``pid``, made on first use."""
        key = (pid, name, lane)
        if key not in self.tids:
            tid = self.next_tid.get(pid, 1)
            tid += tid == pid  # (not the pid: Perfetto would take it for the main thread and list it first)
            self.next_tid[pid] = tid + 1
            self.tids[key] = tid
            self.meta += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}},
                          {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}}]
        return self.tids[key]

    def place(self, pid: int, track: str, start: float, end: float) -> int:
        """The tid of the first lane of ``track`` free from ``start`` on; it is taken until ``end``."""
        ends = self.lane_ends.setdefault((pid, track), [])
        for i, last in enumerate(ends):
            if start >= last:
                ends[i] = end
                return self.thread(pid, track, i)
        ends.append(end)
        return self.thread(pid, track, len(ends) - 1)

    def place_trimmed(self, pid: int, track: str, start: float, end: float, slack: float) -> tuple[int, float]:
        """:meth:`place` for a slice that may start up to ``slack`` seconds before its lane's last
        one ended: it is trimmed to start there. Returns the tid and the (trimmed) start."""
        ends = self.lane_ends.setdefault((pid, track), [])
        for i, last in enumerate(ends):
            if start >= last - slack and end > last:
                ends[i] = end
                return self.thread(pid, track, i), max(start, last)
        ends.append(end)
        return self.thread(pid, track, len(ends) - 1), start


def worker_of(thread_name: str) -> str:
    """The worker of a lane's thread name (``generate-0 tasks``, ``generate-0 samples``)."""
    return thread_name.rsplit(" ", 1)[0]


def slice_event(name: str, cat: str, pid: int, tid: int, start: float, end: float, args: dict) -> dict:
    """A complete (``X``) event from ``start`` to ``end`` epoch seconds."""
    ts = us(start)
    return {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": max(0, us(end) - ts),
            "args": args}


class TaskIndex:
    """The compute spans of the run's reward and train tasks by step, to find which task held a
    sample: a sample's log names its generate and train worker, not its train task's start nor
    its reward worker. A few small tuples per step."""

    def __init__(self):
        self.by_step: dict[tuple[str, int], list[tuple[float, float, str]]] = {}

    def add(self, prefix: str, step: int | None, worker: str, start: float, stop: float) -> None:
        """Remember a ``reward`` or ``train`` task's compute span on ``worker``."""
        if prefix in ("reward", "train") and step is not None:
            self.by_step.setdefault((prefix, step), []).append((start, stop, worker))

    def find(self, prefix: str, step: int, at: float, worker: str | None = None) -> tuple[float, float, str] | None:
        """The ``prefix`` task of ``step`` (on ``worker`` if given) whose span holds time ``at``;
        among several (a resumed run redid the step), the one that ended closest to it."""
        spans = [t for t in self.by_step.get((prefix, step), ())
                 if (worker is None or t[2] == worker) and t[0] - CLOCK_SLACK <= at <= t[1] + CLOCK_SLACK]
        return min(spans, key=lambda t: abs(t[1] - at)) if spans else None


def task_events(task: dict, tracks: Tracks, index: TaskIndex) -> list[dict]:
    """The slices of one task-stream record (as ``trace.py`` stores it: ``key``, ``worker``,
    ``status``, ``startstops`` as ``[action, start, stop, source]``) on its worker's track:
    ``compute`` named by the key's prefix (``generate``, ``train``, ``export-weights``, ...),
    ``transfer`` (its inputs arriving, ``from`` which worker) and Dask's other actions by name."""
    prefix, n = key_parts(task["key"])
    worker = task["worker"]
    pid = tracks.pool(pool_of(worker))
    number = {"version": n} if prefix in VERSIONED else {"step": n} if n is not None else {}
    out = []
    for action, start, stop, source in task["startstops"]:
        args = {"key": key_text(task["key"]), **number}
        if action == "compute":
            name = prefix
            args["status"] = task.get("status", "")
            index.add(prefix, n, worker, start, stop)
        else:
            name = action
            args["for"] = prefix
            if source:
                args["from"] = source
        tid, start = tracks.place_trimmed(pid, f"{worker} tasks", start, stop, TASK_SLACK)
        out.append(slice_event(name, "task", pid, tid, start, stop, args))
    return out


def worker_order(worker: str) -> tuple:
    """Sort key of worker names: by pool (:data:`POOL_ORDER`), then by number (``generate-10``
    after ``generate-9``)."""
    pool = pool_of(worker)
    rank = POOL_ORDER.index(pool) if pool in POOL_ORDER else len(POOL_ORDER)
    tail = worker[len(pool) + 1:]
    return rank, pool, int(tail) if tail.isdigit() else -1, worker


def reserve_task_lanes(tracks: Tracks, tasks) -> None:
    """Make every task lane up front, a worker's lanes together and workers in order, so that
    Perfetto (which lists threads by tid) shows them so: lay ``tasks`` (the task-stream records
    :func:`task_events` takes) out once on scratch tracks and count each worker's lanes."""
    scratch, index = Tracks(), TaskIndex()
    for task in tasks:
        task_events(task, scratch, index)
    lanes = {track.rsplit(" ", 1)[0]: len(ends) for (_, track), ends in scratch.lane_ends.items()}
    for worker in sorted(lanes, key=worker_order):
        pid = tracks.pool(pool_of(worker))
        for lane in range(lanes[worker]):
            tracks.thread(pid, f"{worker} tasks", lane)


def sample_events(record: dict, tracks: Tracks, index: TaskIndex) -> list[dict]:
    """A slice per sample per phase: ``queued`` (submitted to the start of its generation) and
    ``generate`` on its generate worker, ``score`` on the reward worker whose task scored it (its
    task's start to ``reward_end``), ``wait`` (scored, waiting for its train task) and ``train``
    (its train task's start to ``trained``) on the train worker that trained it. An agent's
    trajectory's ``generate`` slice also carries its turns, tool calls and text."""
    step, out = record["step"], []
    log = sorted(record.get("sample_log", ()), key=lambda x: x.get("submitted") or x.get("gen_start", 0.0))
    for x in log:
        args = {"uid": x["uid"], "step": step, "version": x.get("version"), "staleness": x.get("staleness"),
                "prompt_len": x.get("prompt_len"), "response_len": x.get("response_len")}
        # (an agent's trajectory, on its generate slice alone: copied onto each of its five
        # slices, a trajectory's text, escaped as JSON, made a trace of gigabytes)
        trajectory = {**args, **{k: x[k] for k in ("turns", "tool_calls", "text") if k in x}}
        gen_start, gen_end = x.get("gen_start"), x.get("gen_end")
        worker = x.get("worker") or "generate"
        if gen_start is not None and gen_end is not None:
            shift = x.get("clock_shift", 0.0)  # (into the frame of Dask's task slices)
            gen_start, gen_end = gen_start + shift, gen_end + shift
            pid = tracks.samples(worker)
            queued = x.get("submitted") or gen_start  # (0: a task that was not told when it was asked)
            # (from the earlier of the two: the controller's and the worker's clocks may differ)
            tid = tracks.place(pid, f"{worker} samples", min(queued, gen_start), gen_end)
            if queued < gen_start:
                out.append(slice_event("queued", "sample", pid, tid, queued, gen_start, args))
            out.append(slice_event("generate", "sample", pid, tid, gen_start, gen_end, trajectory))
        reward_end = x.get("reward_end")
        if reward_end is not None and gen_end is not None:
            # (into the frame of Dask's task slices, where the reward task is found by this time:
            # on a loaded machine the reward worker's estimate drifts past CLOCK_SLACK)
            scored = reward_end + x.get("reward_clock_shift", 0.0)
            task = index.find("reward", step, scored)
            rworker = task[2] if task else "reward"
            start = min(max(task[0], gen_end), scored) if task else min(gen_end, scored)
            pid = tracks.samples(rworker)
            tid = tracks.place(pid, f"{rworker} samples", start, scored)
            out.append(slice_event("score", "sample", pid, tid, start, scored, args))
        trained, tworker = x.get("trained"), x.get("trained_on")
        if trained is not None and tworker:
            task = index.find("train", step, trained, tworker)
            ready = reward_end if reward_end is not None else gen_end if gen_end is not None else trained
            start = min(max(task[0], ready), trained) if task else ready
            pid = tracks.samples(tworker)
            tid = tracks.place(pid, f"{tworker} samples", min(ready, start), trained)
            if ready < start:
                out.append(slice_event("wait", "sample", pid, tid, ready, start, args))
            out.append(slice_event("train", "sample", pid, tid, start, trained, args))
    return out


def step_events(record: dict, tracks: Tracks, first: bool = False) -> list[dict]:
    """The controller's view of one step: its slice (the step's boundaries, ``step_s``), the
    ``controller work`` (``controller_s``) and ``weight sync`` (``weight_sync_s``) slices, the ``policy``
    counter (``version`` after the step; ``first``: also the version before it, at its start)
    and the ``idle ratio`` counter of each pool over the step's accounting window."""
    pid = tracks.process("controller", 0)
    end, step = record["time"], record["step"]
    start = end - record.get("step_s", 0.0)
    summary = {k: record[k] for k in ("samples", "reward_mean", "policy_version", "staleness_max", "step_s",
                                      "generate_s", "train_s", "train_tail_s", "weight_sync_s", "controller_s")
               if k in record}
    out = [slice_event(f"step {step}", "step", pid, tracks.place(pid, "steps", start, end), start, end,
                       {"step": step, **summary})]
    if record.get("controller_s"):
        admitted = start + record["controller_s"]
        out.append(slice_event("controller work", "step", pid, tracks.place(pid, "controller", start, admitted), start,
                               admitted, {"step": step, "controller_s": record["controller_s"]}))
    if record.get("weight_sync_s"):
        synced = end - record["weight_sync_s"]
        out.append(slice_event("weight sync", "step", pid, tracks.place(pid, "controller", synced, end), synced,
                               end, {"step": step, "policy_version": record["policy_version"]}))
    if first:
        out.append({"name": "policy", "ph": "C", "pid": pid, "tid": 0, "ts": us(start),
                    "args": {"version": record["policy_version"] - 1}})
    out.append({"name": "policy", "ph": "C", "pid": pid, "tid": 0, "ts": us(end),
                "args": {"version": record["policy_version"]}})
    pools = {p: a["idle_ratio"] for p, a in record.get("pools", {}).items() if "idle_ratio" in a}
    if pools:
        window = record.get("accounting_window_s") or record.get("step_s", 0.0)
        out.append({"name": "idle ratio", "ph": "C", "pid": pid, "tid": 0, "ts": us(end - window), "args": pools})
    return out


def marker(name: str, at: float, tracks: Tracks, args: dict | None = None) -> dict:
    """A global instant event (a line across every track), e.g. where a resumed run began."""
    return {"name": name, "ph": "i", "s": "g", "pid": tracks.process("controller", 0), "tid": 0, "ts": us(at),
            "args": args or {}}
