"""``trace.json``: a real run's trace holds every trained sample once, on the workers its
``metrics.jsonl`` names, at the times it logged; Dask's tasks (training, publication, loading) on
the workers that ran them; the policy version as a counter. A resumed run's trace covers the whole
run. And every slice is one Perfetto can draw: no two overlap on one thread."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import pytest

from streamrl.telemetry.trace import TASKS, TraceRecorder, write_trace
from streamrl.telemetry.trace_events import us, worker_of
from tests.helpers import read_records, sets, streamrl, write_tiny_recipe

#: what each kind of event must carry (Chrome trace event format)
REQUIRED = {"X": {"name", "ph", "pid", "tid", "ts", "dur"}, "C": {"name", "ph", "pid", "ts", "args"},
            "M": {"name", "ph", "pid", "args"}, "i": {"name", "ph", "pid", "ts", "s"}}


class Trace:
    """A loaded ``trace.json``: its events, and each thread's name and process's name."""

    def __init__(self, path: Path):
        data = json.loads(path.read_text())
        assert data["displayTimeUnit"] == "ms"
        self.events = data["traceEvents"]
        self.process = {e["pid"]: e["args"]["name"] for e in self.events if e["name"] == "process_name"}
        self.thread = {(e["pid"], e["tid"]): e["args"]["name"] for e in self.events if e["name"] == "thread_name"}

    def slices(self, cat: str, name: str | None = None) -> list[dict]:
        """The complete events of category ``cat`` (named ``name``)."""
        return [e for e in self.events if e["ph"] == "X" and e.get("cat") == cat and name in (None, e["name"])]

    def worker(self, e: dict) -> str:
        """The worker whose track holds slice ``e``."""
        return worker_of(self.thread[(e["pid"], e["tid"])])


def check_well_formed(trace: Trace) -> None:
    """Every event has its kind's fields; every slice is on a named thread of a named process;
    slices on one thread never overlap (Perfetto only draws slices that nest)."""
    lanes = defaultdict(list)
    for e in trace.events:
        assert REQUIRED[e["ph"]] <= e.keys(), e
        if e["ph"] == "X":
            assert isinstance(e["ts"], int) and e["dur"] >= 0, e
            assert (e["pid"], e["tid"]) in trace.thread and e["pid"] in trace.process, e
            lanes[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for lane, spans in lanes.items():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), (trace.thread[lane], spans)


def check_samples(trace: Trace, records: list[dict]) -> None:
    """Every trained sample: one generate and one train slice, on the workers its log names, at
    its logged times; a queued and a score slice that end where its log says."""
    by_phase = {p: defaultdict(list) for p in ("queued", "generate", "score", "wait", "train")}
    for e in trace.slices("sample"):
        by_phase[e["name"]][e["args"]["uid"]].append(e)
    logged = [(r, x) for r in records for x in r["sample_log"]]
    assert logged and len(by_phase["generate"]) == len(by_phase["train"]) == len(logged)
    for r, x in logged:
        (gen,), (train,) = by_phase["generate"][x["uid"]], by_phase["train"][x["uid"]]
        assert trace.worker(gen) == x["worker"] and trace.process[gen["pid"]] == f"{x['worker']} samples"
        assert trace.worker(train) == x["trained_on"]
        shift = x.get("clock_shift", 0.0)  # (the generate stamps are drawn in the task stream's frame)
        assert abs(gen["ts"] - us(x["gen_start"] + shift)) <= 1
        assert abs(gen["ts"] + gen["dur"] - us(x["gen_end"] + shift)) <= 1
        assert abs(train["ts"] + train["dur"] - us(x["trained"])) <= 1 and train["ts"] >= us(x["reward_end"]) - 1
        assert gen["args"] == train["args"] == {
            "uid": x["uid"], "step": r["step"], "version": x["version"], "staleness": x["staleness"],
            "prompt_len": x["prompt_len"], "response_len": x["response_len"]}
        (score,) = by_phase["score"][x["uid"]]
        shift = x.get("reward_clock_shift", 0.0)  # (the reward worker's, likewise)
        assert abs(score["ts"] + score["dur"] - us(x["reward_end"] + shift)) <= 1
        assert trace.worker(score).startswith("reward-")
        for queued in by_phase["queued"][x["uid"]]:  # (none when it started the moment it was asked)
            assert abs(queued["ts"] - us(x["submitted"])) <= 1 and trace.worker(queued) == x["worker"]


def check_steps(trace: Trace, records: list[dict]) -> None:
    """The policy counter takes each step's ``policy_version`` at its end; one slice per step."""
    version = {e["ts"]: e["args"]["version"] for e in trace.events if e["ph"] == "C" and e["name"] == "policy"}
    for r in records:
        assert version[us(r["time"])] == r["policy_version"]
        (step,) = trace.slices("step", f"step {r['step']}")
        assert step["ts"] + step["dur"] == us(r["time"]) and step["args"]["policy_version"] == r["policy_version"]
    idle = [e for e in trace.events if e["ph"] == "C" and e["name"] == "idle ratio"]
    assert len(idle) == len(records) and all(0 <= v <= 1 for e in idle for v in e["args"].values())


# ---- the event builder, on a hand-made run folder ------------------------------------------

def hand_made(folder: Path) -> list[dict]:
    """A run folder with one step of two samples from two generate workers, trained in one
    train task, and the task stream that goes with it (two back-to-back tasks on train-0 whose
    times overlap by a millisecond, as Dask's clock correction makes them; generate-1's tasks
    shifted 80 ms by it, which its sample's ``clock_shift`` says, and reward-0's 300 ms back,
    beyond the slack that finds a sample's task, which ``reward_clock_shift`` says)."""
    t = 1_800_000_000.0
    log = [{"uid": f"0-000-{k}", "version": 0, "worker": f"generate-{k}", "submitted": t, "gen_start": t + 0.1 + k,
            "gen_end": t + 1.2 + k, "clock_shift": 0.08 * k, "reward_end": t + 2.5 + k, "reward_clock_shift": -0.3, "trained": t + 4.5,
            "trained_on": "train-0", "response_len": 4 + k, "prompt_len": 7, "staleness": 0} for k in range(2)]
    record = {"step": 0, "policy_version": 1, "samples": 2, "time": t + 5.0, "step_s": 5.0, "weight_sync_s": 0.4,
              "controller_s": 0.05, "accounting_window_s": 5.0, "pools": {"generate": {"idle_ratio": 0.5}},
              "sample_log": log}
    tasks = [{"segment": {"start": t - 1, "resumed": False}},
             *[{"key": ["generate-0", f"0-000+{k}"], "worker": f"generate-{k}", "status": "OK",
                "startstops": [["compute", t + 0.1 + 1.08 * k, t + 1.2 + 1.08 * k, None]]} for k in range(2)],
             *[{"key": ["reward-0", f"0-000+{k}"], "worker": "reward-0", "status": "OK",
                "startstops": [["transfer", t + 1.0 + k, t + 1.1 + k, f"generate-{k}"],
                               ["compute", t + 1.7 + k, t + 2.2 + k, None]]} for k in range(2)],
             {"key": ["train-0", "000"], "worker": "train-0", "status": "OK",
              "startstops": [["compute", t + 4.0, t + 4.5, None]]},
             {"key": ["optimizer-step-0", "rank0"], "worker": "train-0", "status": "OK",
              "startstops": [["compute", t + 4.499, t + 4.6, None]]},
             {"key": ["export-weights-1", "v1"], "worker": "train-0", "status": "OK",
              "startstops": [["compute", t + 4.6, t + 4.7, None]]}]
    (folder / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    (folder / TASKS).write_text("".join(json.dumps(x) + "\n" for x in tasks))
    return [record]


def test_the_builder_places_samples_and_tasks_on_their_workers(tmp_path):
    records = hand_made(tmp_path)
    trace = Trace(write_trace(tmp_path))
    check_well_formed(trace)
    check_samples(trace, records)
    check_steps(trace, records)
    # the train slice starts with its train task, after waiting since it was scored
    t = 1_800_000_000.0
    train = {e["args"]["uid"]: e for e in trace.slices("sample", "train")}
    assert all(e["ts"] == us(t + 4.0) for e in train.values())
    wait = {e["args"]["uid"]: e for e in trace.slices("sample", "wait")}
    assert wait["0-000-1"]["ts"] == us(t + 3.5) and wait["0-000-1"]["dur"] == us(t + 4.0) - us(t + 3.5)
    # the score slice starts with the reward task that held the sample
    score = {e["args"]["uid"]: e for e in trace.slices("sample", "score")}
    assert score["0-000-1"]["ts"] == us(t + 2.7) and {trace.worker(e) for e in score.values()} == {"reward-0"}
    # the optimizer step shares train-0's lane, trimmed by the millisecond it overlapped
    (opt,) = trace.slices("task", "optimizer-step")
    (task,) = trace.slices("task", "train")
    assert (opt["pid"], opt["tid"]) == (task["pid"], task["tid"]) and opt["ts"] == us(t + 4.5)
    assert opt["args"]["step"] == 0 and trace.slices("task", "export-weights")[0]["args"]["version"] == 1
    (transfer, _) = trace.slices("task", "transfer")
    assert transfer["args"]["from"] == "generate-0" and trace.worker(transfer) == "reward-0"
    # a pool's processes and threads are named for Perfetto
    assert {"controller", "generate pool", "reward pool", "train pool", "generate-0 samples",
            "train-0 samples"} <= set(trace.process.values())


def test_the_recorder_takes_tasks_between_steps_and_writes_after_its_cluster_is_gone(tmp_path):
    # a real (in-process) cluster: step() only schedules the request; close() after the client
    # closed (a run that failed) still writes what was recorded, at once
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, protocol="tcp://", host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster) as client:
        recorder = TraceRecorder(client, tmp_path)
        recorder.every = 0  # (a request after every step, not every few seconds)
        client.submit(sum, [1, 2], key=("train-0", "000")).result()
        def no_waiting(*args, **kwargs):
            raise AssertionError("step() waited on the cluster")

        client.sync = no_waiting  # (the instance's: every blocking call of the client goes through it)
        try:
            recorder.step({"step": 0})  # only schedules its request on the event loop
        finally:
            del client.sync
        assert len(recorder.costs) == 1
        deadline = time.time() + 30
        while "train-0" not in (tmp_path / TASKS).read_text():
            assert time.time() < deadline
            time.sleep(0.05)
        client.submit(sum, [3, 4], key=("optimizer-step-0", "rank0")).result()
    t0 = time.time()
    path = recorder.close()
    assert time.time() - t0 < 5
    trace = Trace(path)
    check_well_formed(trace)
    assert [e["args"]["step"] for e in trace.slices("task", "train")] == [0]
    assert [json.loads(line).get("key") for line in (tmp_path / TASKS).read_text().splitlines()][1:] == [["train-0", "000"]]


def test_an_empty_folder_writes_no_trace(tmp_path):
    assert write_trace(tmp_path) is None and not (tmp_path / "trace.json").exists()


# ---- a real run, resumed once ---------------------------------------------------------------

@pytest.fixture(scope="module")
def run(tiny_model, tmp_path_factory) -> Path:
    """An async run of 2 steps with 2 generate workers, resumed to 3 steps."""
    folder = tmp_path_factory.mktemp("trace")
    recipe = write_tiny_recipe(folder, tiny_model)
    proc = streamrl("recipe", "run", str(recipe), *sets("run.mode=async", "run.max_staleness=1", "run.steps=2",
                                                        "pools.generate.workers=2", "run.report=false"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (out,) = (folder / "runs").iterdir()
    first = json.loads((out / "trace.json").read_text())["traceEvents"]
    assert sum(e["name"] == "step 1" for e in first) == 1
    proc = streamrl("recipe", "resume", str(out), "--set", "run.steps=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_every_trained_sample_is_in_the_trace_where_and_when_its_log_says(run):
    trace = Trace(run / "trace.json")
    records = read_records(run)
    assert [r["step"] for r in records] == [0, 1, 2]
    check_well_formed(trace)
    check_samples(trace, records)
    check_steps(trace, records)
    assert {x["worker"] for r in records for x in r["sample_log"]} == {"generate-0", "generate-1"}


@pytest.mark.slow
def test_tasks_appear_on_the_workers_that_ran_them(run):
    trace = Trace(run / "trace.json")
    tasks = trace.slices("task")
    on = defaultdict(set)
    for e in tasks:
        on[e["name"]].add(trace.worker(e))
    assert on["optimizer-step"] == on["export-weights"] == {"train-0"}
    assert on["load-weights"] == on["generate"] == {"generate-0", "generate-1"}
    assert on["reward"] == {"reward-0"} and on["train"] == {"train-0"}
    # one optimizer step per step, one publication per version (the resume publishes its own again)
    steps = sorted(e["args"]["step"] for e in tasks if e["name"] == "optimizer-step")
    assert steps[:2] == [0, 1] and steps[-1] == 2
    loads = {(e["args"]["version"], trace.worker(e)) for e in tasks if e["name"] == "load-weights"}
    assert {(v, w) for v in (1, 2, 3) for w in ("generate-0", "generate-1")} <= loads
    # the generate tasks hold the samples they made
    for r in read_records(run):
        for x in r["sample_log"]:
            shift = x["clock_shift"]  # (Dask's estimate of the scheduler's clock less the worker's)
            assert any(trace.worker(e) == x["worker"] and e["ts"] - 20_000 <= us(x["gen_start"] + shift)
                       and us(x["gen_end"] + shift) <= e["ts"] + e["dur"] + 20_000
                       for e in tasks if e["name"] == "generate" and e["args"]["step"] == r["step"]), x


@pytest.mark.slow
def test_a_resumed_run_appends_its_tasks_and_rewrites_the_whole_trace(run):
    segments = [json.loads(line)["segment"] for line in (run / TASKS).read_text().splitlines()
                if line.startswith('{"segment"')]
    assert [s["resumed"] for s in segments] == [False, True]
    trace = Trace(run / "trace.json")
    (resumed,) = [e for e in trace.events if e["name"] == "resumed"]
    assert resumed["ph"] == "i" and resumed["ts"] == us(segments[1]["start"])
    # both clusters' model loads are there, before and after the line
    loads = sorted(e["ts"] for e in trace.slices("task", "load-trainer"))
    assert len(loads) == 2 and loads[0] < resumed["ts"] < loads[1]


def test_an_agents_trajectory_text_is_on_its_generate_slice_alone_and_sample_bytes_are_bounded(tmp_path, monkeypatch):
    # copied onto each of a sample's slices, 400 characters of emoji (12 bytes each as JSON)
    # made a trace of gigabytes over a run; a byte limit stops the sample slices, marked
    from streamrl.telemetry import trace as trace_module

    records = hand_made(tmp_path)
    for x in records[0]["sample_log"]:
        x.update(text="\U0001F600" * 400, turns=3, tool_calls=1)
    (tmp_path / "metrics.jsonl").write_text(json.dumps(records[0]) + "\n")
    trace = Trace(write_trace(tmp_path))
    check_well_formed(trace)
    with_text = [e for e in trace.events if "text" in e.get("args", {})]
    assert {e["name"] for e in with_text} == {"generate"} and len(with_text) == 2
    assert all(e["args"]["turns"] == 3 for e in with_text)
    monkeypatch.setattr(trace_module, "MAX_SAMPLE_BYTES", 1)
    second = {**records[0], "step": 1, "time": records[0]["time"] + 10}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(records[0]) + "\n" + json.dumps(second) + "\n")
    capped = Trace(write_trace(tmp_path))
    assert {e["args"]["step"] for e in capped.slices("sample", "generate")} == {0}
    assert any(e.get("name") == "sample slices stop here" for e in capped.events)
