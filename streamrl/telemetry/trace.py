"""``trace.json``: the run as a Chrome trace, which Perfetto opens (``vizviewer``,
ui.perfetto.dev); ``docs/trace.md`` says what is in it.

While the run goes, :class:`TraceRecorder` only appends Dask's task stream (every task's worker
and start/stop times, kept by the scheduler in a bounded buffer) to ``trace-tasks.jsonl`` in the
run folder: a small request to the scheduler after a step every few seconds, made on the
client's event loop so the step loop does not wait for it. At the end it builds ``trace.json``
(:func:`write_trace`) from that file and ``metrics.jsonl`` (whose ``sample_log`` has each
sample's timeline), streaming both, so memory stays bounded however long the run. A resumed run
appends to ``trace-tasks.jsonl`` and rewrites ``trace.json`` over the whole run.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path

from streamrl.telemetry.metrics import strict, strict_needed
from streamrl.telemetry.trace_events import (TaskIndex, Tracks, marker, reserve_task_lanes, sample_events, step_events,
                                             task_events)

log = logging.getLogger(__name__)

TRACE = "trace.json"
TASKS = "trace-tasks.jsonl"
"""The task stream as recorded: a ``{"segment": ...}`` line where each run or resume began, then
one line per task (``key``, ``worker``, ``status``, ``startstops`` as ``[action, start, stop, from]``)."""
METRICS = "metrics.jsonl"  # (run/run_folder.py writes it)

#: seconds a request to the scheduler may take before the trace gives up on it (a dying cluster)
RPC_TIMEOUT = 10.0

#: seconds at least between two task-stream requests (made after a step): the scheduler keeps the
#: last 100,000 tasks (W1 runs about 15 a step), and each request is work for the event loop the
#: scheduler and the controller share, at the step boundary where both are busiest
REQUEST_EVERY_S = 5.0

#: per-sample slices written at most (about 200 bytes each), and their bytes at most (an agent's
#: slice carries its trajectory's text): a trace much larger than this no longer opens in a
#: browser; past either, tasks, steps and counters go on, and a marker says so
MAX_SAMPLE_EVENTS = 1_000_000
MAX_SAMPLE_BYTES = 300_000_000


class TraceRecorder:
    """Records the timeline of a run step by step and writes ``trace.json`` at the end.

    Built once the cluster is up (its first request installs the scheduler's task-stream
    plugin, so every task after it is kept). Requests run on the client's event loop, one after
    another, and :meth:`step` does not wait for them: between steps it at most schedules one. A
    failure here is logged and never stops the run."""

    def __init__(self, client, run_dir: Path):
        self.client, self.run_dir = client, Path(run_dir)
        self.costs: list[float] = []
        """Seconds each :meth:`step` took (it runs between steps)."""
        self._names: dict[str, str] = {}
        self._index = 0  # task-stream records taken so far (the scheduler numbers them in order)
        self._lock = None  # an asyncio.Lock, made on the event loop: one request at a time, in order
        self.every = REQUEST_EVERY_S
        """Seconds between requests (:data:`REQUEST_EVERY_S`)."""
        self._last = time.monotonic()
        self._file = None
        try:
            resumed = (self.run_dir / TASKS).exists()
            self._file = open(self.run_dir / TASKS, "a", encoding="utf-8")
            self._file.write(json.dumps({"segment": {"start": time.time(), "resumed": resumed}}) + "\n")
            self._file.flush()
            self.client.sync(self._collect, callback_timeout=RPC_TIMEOUT)
        except Exception as exc:  # the trace is an observer: the run goes on without it
            self._give_up(exc)

    def step(self, record: dict) -> None:
        """Called after each step's record is written: every :attr:`every` seconds, have the
        event loop take the tasks finished since the last request (the scheduler's buffer is
        bounded) and append them to ``trace-tasks.jsonl``. The record itself is read back from
        ``metrics.jsonl`` at :meth:`close`."""
        t0 = time.perf_counter()
        if self._file is not None and time.monotonic() - self._last >= self.every:
            self._last = time.monotonic()
            self.client.loop.add_callback(self._collect)
        self.costs.append(time.perf_counter() - t0)

    def close(self) -> Path | None:
        """Take the last tasks (when the cluster still answers) and write ``trace.json``; returns
        its path (None if nothing was recorded or it could not be written)."""
        if self._file is not None:
            try:
                if getattr(self.client, "status", "running") == "running":
                    # queued behind the requests steps scheduled, so those are done when it returns
                    self.client.sync(self._collect, callback_timeout=RPC_TIMEOUT)
            except Exception as exc:  # after a failure the cluster may be gone: write what there is
                log.debug("trace: last task-stream request failed: %s", exc)
            file, self._file = self._file, None
            if file is not None:
                file.close()
        cost = {}
        if self.costs:  # what recording cost the run, between its steps
            cost = {"recorder_step_ms_mean": round(1e3 * sum(self.costs) / len(self.costs), 4),
                    "recorder_step_ms_max": round(1e3 * max(self.costs), 4), "recorder_steps": len(self.costs)}
            log.info("trace: step() took %.3f ms a step on average (max %.3f ms, %d steps)",
                     cost["recorder_step_ms_mean"], cost["recorder_step_ms_max"], len(self.costs))
        try:
            return write_trace(self.run_dir, cost)
        except Exception as exc:
            log.warning("trace: could not write %s: %s: %s", self.run_dir / TRACE, type(exc).__name__, exc)
            return None

    async def _collect(self) -> None:
        """On the event loop: append the task-stream records since the last request, worker
        addresses as names."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._file is None:
                return
            try:
                records = await self.client.scheduler.get_task_stream(start_index=self._index)
                self._index += len(records)
                addresses = {r["worker"] for r in records} | {s.get("source") for r in records
                                                              for s in r.get("startstops", ())}
                if addresses - self._names.keys() - {None}:
                    workers = (await self.client.scheduler.identity(n_workers=-1)).get("workers", {})
                    self._names.update({a: str(w.get("name", a)) for a, w in workers.items()})
                lines = [self._line(r) for r in records]
                if lines:
                    self._file.write("\n".join(lines) + "\n")
                    self._file.flush()  # a killed run keeps what it had
            except Exception as exc:
                self._give_up(exc)

    def _line(self, r: dict) -> str:
        """One task-stream record as a line of ``trace-tasks.jsonl``."""
        name = lambda a: self._names.get(a, a) if a else None  # noqa: E731  (a gone worker: its address)
        stops = [[s["action"], round(s["start"], 6), round(s["stop"], 6), name(s.get("source"))]
                 for s in r.get("startstops", ())]
        key = list(r["key"]) if isinstance(r["key"], tuple) else r["key"]
        return json.dumps({"key": key, "worker": name(r["worker"]), "status": r.get("status", ""),
                           "startstops": stops}, default=str)

    def _give_up(self, exc: BaseException) -> None:
        log.warning("trace: recording stopped (%s: %s); trace.json will have the steps but fewer tasks",
                    type(exc).__name__, exc)
        file, self._file = self._file, None
        if file is not None:
            file.close()


def _lines(path: Path):
    """The JSON objects of a JSON-lines file, one at a time (a torn last line is skipped)."""
    if not path.exists():
        return
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                yield json.loads(line)
            except ValueError:
                continue


def write_trace(run_dir: Path, other: dict | None = None) -> Path | None:
    """Build ``trace.json`` in ``run_dir`` from ``trace-tasks.jsonl`` and ``metrics.jsonl``
    (``other``: more fields for its ``otherData``); returns its path, or None when neither has
    anything. Written to a temporary file and renamed, so a reader never sees half a trace."""
    run_dir = Path(run_dir)
    tracks, index = Tracks(), TaskIndex()
    out_path, tmp = run_dir / TRACE, run_dir / (TRACE + ".tmp")
    written = samples = sample_bytes = 0
    with open(tmp, "w", encoding="utf-8") as out:
        other = {"run": run_dir.name, "source": "streamrl", **(other or {})}
        out.write('{"displayTimeUnit": "ms", "otherData": %s,\n"traceEvents": [\n' % json.dumps(other))

        def emit(events: list[dict]) -> int:
            nonlocal written
            size = 0
            for e in events:
                text = json.dumps(e, separators=(",", ":"))
                if strict_needed(text):  # (an agent's broken text: strict readers refuse a lone surrogate)
                    text = json.dumps(strict(e), separators=(",", ":"))
                out.write((",\n" if written else "") + text)
                written += 1
                size += len(text)
            return size

        tracks.thread(tracks.process("controller", 0), "steps")  # the controller first, as pid 1
        reserve_task_lanes(tracks, (t for t in _lines(run_dir / TASKS) if t.get("worker")))
        # tasks before samples: they index the reward and train tasks the samples are matched to
        for line in _lines(run_dir / TASKS):
            if "segment" in line:
                if line["segment"].get("resumed"):
                    emit([marker("resumed", line["segment"]["start"], tracks)])
            elif line.get("worker"):
                emit(task_events(line, tracks, index))
        capped = False
        for i, record in enumerate(_lines(run_dir / METRICS)):
            emit(step_events(record, tracks, first=i == 0))
            if capped:
                continue
            events = sample_events(record, tracks, index)
            if samples + len(events) > MAX_SAMPLE_EVENTS or sample_bytes > MAX_SAMPLE_BYTES:
                capped = True
                emit([marker("sample slices stop here", record["time"] - record.get("step_s", 0.0), tracks,
                             {"max_sample_events": MAX_SAMPLE_EVENTS, "max_sample_bytes": MAX_SAMPLE_BYTES})])
                continue
            samples += len(events)
            sample_bytes += emit(events)
        if not written:
            out.close()
            tmp.unlink()
            return None
        emit(tracks.meta)
        out.write("\n]}\n")
    os.replace(tmp, out_path)
    return out_path
