"""The streamrl page on the Dask dashboard: served by the scheduler's own Bokeh server (real HTTP
from 127.0.0.1, the Bokeh document pulled over its websocket as a browser does), fed by the step
summaries ``publish`` logs as scheduler events, on a scheduler started by hand with the preload,
on a running one it is attached to, and during a real run on the embedded cluster."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import msgpack
import pytest
from distributed import Client, Scheduler, SpecCluster

from streamrl.telemetry import dashboard
from streamrl.telemetry.dashboard_app import TOPIC, StreamrlPage
from tests.helpers import read_records


def record(step: int, reward: float = 0.5, **extra) -> dict:
    """A step record as the runner hands it over (metrics.jsonl fields, a per-sample log)."""
    return {"step": step, "policy_version": step + 1, "samples": 16, "reward_mean": reward,
            "samples_per_s": 100.0 + step, "tokens_per_s": 400.0, "staleness_max": step % 2, "step_s": 0.2,
            "time": 1.0e9 + step, "pools": {"generate": {"busy_s": 0.3, "idle_s": 0.1, "idle_ratio": 0.25},
                                            "train": {"busy_s": 0.1, "idle_s": 0.3, "idle_ratio": 0.75}},
            "sample_log": [{"uid": f"{step}-{i}", "version": step} for i in range(512)], **extra}


def get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.status, r.read().decode()


def events(client, n: int, timeout: float = 20) -> list[dict]:
    """The summaries on the scheduler, once ``n`` have arrived (publish does not wait for them)."""
    deadline = time.monotonic() + timeout
    while len(got := client.get_events(TOPIC)) < n:
        assert time.monotonic() < deadline, f"{len(got)} of {n} summaries reached the scheduler"
        time.sleep(0.05)
    return [msg for _, msg in got]


def pulled(url: str) -> dict:
    """The page's document as a browser gets it (a Bokeh session over the page's websocket):
    the header's text and the figures' columns."""
    from bokeh.client import pull_session
    from bokeh.models import ColumnDataSource, Div

    with pull_session(url=url) as session:
        models = list(session.document.roots[0].references())
        header = next(m for m in models if isinstance(m, Div)).text
        sources = [dict(m.data) for m in models if isinstance(m, ColumnDataSource)]
    steps = next(s for s in sources if "reward" in s)
    evals = next((s for s in sources if "eval_reward" in s), None)  # drawn from the first evaluation on
    return {"header": header, "steps": steps, "evals": evals}


def check_page(url: str) -> None:
    """The page answers 200 over HTTP with a Bokeh document (its root element, BokehJS loaded from
    the same server) inside Dask's navigation bar, which links the page."""
    assert url.startswith("http://127.0.0.1:") and url.endswith("/streamrl")
    status, html = get(url)
    assert status == 200
    assert "data-root-id" in html and "static/js/bokeh.min.js" in html
    assert 'href="streamrl"' in html and 'href="status"' in html


def test_summary_is_small_msgpack_ready_and_leaves_the_sample_log_out():
    import numpy as np

    rec = record(3, reward=np.float32(0.25), **{"eval/pass@1": np.float64(0.5), "eval/reward_mean": 0.4,
                                                 "eval/policy_version": 3, "eval_error": "x" * 1000})
    s = dashboard.summarize(rec)
    assert "sample_log" not in json.dumps(s)
    assert len(msgpack.dumps(s)) < 600  # the record with its log: about 25 KB per step
    assert s["step"] == 3 and s["reward"] == 0.25 and s["staleness"] == 1 and s["version"] == 4
    assert s["busy"] == {"generate": 0.75, "train": 0.25}
    assert s["eval"]["pass@1"] == 0.5 and s["eval"]["reward_mean"] == 0.4 and len(s["eval"]["error"]) == 200


def page_state(dask_scheduler) -> dict:
    """On the scheduler: how many streamrl pages its dashboard serves (run_on_scheduler)."""
    return {"pages": sum(hasattr(a, "streamrl_page") for a in dask_scheduler.http_application.applications)}


def test_install_attaches_the_page_to_a_running_scheduler_once(scheduler_only):
    client = scheduler_only
    url = dashboard.install(client, name="demo", mode="async", steps=4)
    assert url == client.dashboard_link[: -len("status")] + "streamrl"
    assert dashboard.install(client, name="demo", mode="async", steps=4) == url  # again: the same page
    assert client.run_on_scheduler(page_state) == {"pages": 1}
    check_page(url)
    assert 'href="streamrl"' in get(client.dashboard_link)[1]  # Dask's own pages link it too

    page = pulled(url)
    assert "waiting for the first step" in page["header"] and page["steps"]["step"] == []
    assert page["evals"] is None
    for step in range(4):
        dashboard.publish(client, record(step, reward=0.1 * step, **(
            {"eval/reward_mean": 0.3, "eval/pass@1": 0.25} if step == 2 else {}),
            **{"offpolicy/token_staleness_mean": 0.5 * (step % 2), "offpolicy/ess": 1.0 - 0.1 * step}))
    events(client, 4)
    page = pulled(url)
    assert page["steps"]["step"] == [0, 1, 2, 3]
    assert page["steps"]["reward"] == pytest.approx([0.0, 0.1, 0.2, 0.3])
    assert page["steps"]["busy_generate"] == pytest.approx([0.75] * 4)
    assert page["steps"]["staleness"] == [0, 1, 0, 1]
    assert page["steps"]["token_staleness"] == pytest.approx([0, 0.5, 0, 0.5])
    assert page["steps"]["ess"] == pytest.approx([1.0, 0.9, 0.8, 0.7])
    assert page["evals"] == {"step": [2], "eval_reward": [0.3], "eval_pass1": [0.25]}
    for text in ("<b>demo</b>", "mode async", "4/4 steps", "policy v4", "reward 0.300",
                 "eval pass@1 0.250 at step 2", "finished"):
        assert text in page["header"]


def live_updates(dask_scheduler) -> list:
    """On the scheduler: what one browser session's figures hold after each periodic update while
    summaries keep arriving -- steps in order (streamed), a step again (a resumed run: redrawn),
    and a new run (shown from scratch)."""
    page = StreamrlPage(dask_scheduler)
    seen = []

    def log(run, step, reward):
        dask_scheduler.log_event(TOPIC, dashboard.summarize(record(step, reward), dashboard._Run(id=run)))

    def tick():
        page.update()
        seen.append((list(page.steps.data["step"]), list(page.steps.data["reward"]), page.header.text))

    log("a", 0, 0.1)
    tick()
    log("a", 1, 0.2)
    log("a", 2, 0.3)
    tick()
    tick()  # nothing new: nothing changes
    log("a", 1, 0.9)  # step 1 again, from a resumed run on the same page
    tick()
    log("b", 0, 0.7)  # another run on this scheduler
    tick()
    dask_scheduler.log_event(TOPIC, "not a summary")
    tick()
    return seen


def test_the_page_updates_live_and_follows_the_newest_run(scheduler_only):
    seen = scheduler_only.run_on_scheduler(live_updates)
    assert [(s, r) for s, r, _ in seen] == [
        ([0], [0.1]), ([0, 1, 2], [0.1, 0.2, 0.3]), ([0, 1, 2], [0.1, 0.2, 0.3]),
        ([0, 1, 2], [0.1, 0.9, 0.3]), ([0], [0.7]), ([0], [0.7])]
    assert "3 steps" in seen[1][2] and "1 step " in seen[4][2]


def test_publish_never_raises_and_warns_once(scheduler_only, recwarn):
    client = scheduler_only
    dashboard.warned_once.clear()
    dashboard.publish(client, {"no": "step"})  # not a record
    dashboard.publish(client, {"step": "x"})
    dashboard.publish(client, record(0))  # and the next good one still goes through
    assert [m["step"] for m in events(client, 1)] == [0]
    ours = [w for w in recwarn if "streamrl page" in str(w.message)]
    assert len(ours) == 1 and "a step was not sent" in str(ours[0].message)


def test_a_scheduler_without_dashboard_gets_no_page_and_no_warning(recwarn):
    cluster = SpecCluster(workers={}, scheduler={"cls": Scheduler, "options": {
        "host": "127.0.0.1", "dashboard": False, "dashboard_address": "127.0.0.1:0"}}, name="streamrl-test")
    with cluster, Client(cluster) as client:
        dashboard.warned_once.clear()
        assert dashboard.install(client) is None
        dashboard.publish(client, record(0))  # the summaries still reach the scheduler
        assert events(client, 1)[0]["step"] == 0
    assert not [w for w in recwarn if "streamrl page" in str(w.message)]


def written(path: Path) -> bool:
    """The scheduler has written its whole address file (the JSON parses)."""
    try:
        return "address" in json.loads(path.read_text())
    except (OSError, ValueError):
        return False


@pytest.mark.slow
def test_hand_started_scheduler_with_the_preload_serves_the_page_before_any_run(tmp_path):
    """``dask scheduler --preload streamrl.telemetry.dashboard``, as docs/dashboard.md says."""
    info = tmp_path / "scheduler.json"
    proc = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                             "--port", "0", "--dashboard-address", "127.0.0.1:0", "--scheduler-file", str(info),
                             "--preload", "streamrl.telemetry.dashboard"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not written(info):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
            time.sleep(0.1)
        with Client(scheduler_file=str(info)) as client:
            page = client.dashboard_link[: -len("status")] + "streamrl"
            check_page(page)  # there before install(): the preload put it there
            assert client.run_on_scheduler(page_state) == {"pages": 1}
            assert dashboard.install(client, name="by-hand", steps=2) == page
            assert client.run_on_scheduler(page_state) == {"pages": 1}  # found, not added again
            for step in range(2):
                dashboard.publish(client, record(step, reward=0.5 + step))
            assert [m["reward"] for m in events(client, 2)] == [0.5, 1.5]
            shown = pulled(page)
            assert shown["steps"]["reward"] == [0.5, 1.5] and "2/2 steps" in shown["header"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slow
def test_a_real_run_shows_on_the_page_while_it_runs(tiny_recipe, monkeypatch, recwarn):
    """A tiny recipe on the embedded cluster: the runner installs the page, each step's summary
    reaches the scheduler with the step and reward metrics.jsonl has, and the page serves them
    while the run goes on (checked at its last step, before the cluster stops)."""
    from streamrl.run import runner
    from streamrl.recipe.recipe import load_recipe

    steps = 3
    real_install, real_publish = dashboard.install, dashboard.publish
    seen: dict = {"url": None, "cost": []}

    def install(client, **kw):
        seen["url"] = real_install(client, **kw)
        return seen["url"]

    def no_waiting(*args, **kwargs):
        raise AssertionError("publish waited on the cluster")

    def publish(client, rec):
        t = time.perf_counter()
        client.sync = no_waiting  # (the instance's: every blocking call of the client goes through it)
        try:
            real_publish(client, rec)
        finally:
            del client.sync
        seen["cost"].append(time.perf_counter() - t)
        if rec["step"] == steps - 1:  # the last step: the cluster is still up
            seen["events"] = events(client, steps)
            check_page(seen["url"])
            seen["page"] = pulled(seen["url"])

    monkeypatch.setattr(dashboard, "install", install)
    monkeypatch.setattr(dashboard, "publish", publish)
    dashboard.warned_once.clear()
    folder = runner.run(load_recipe(tiny_recipe, [f"run.steps={steps}", "run.report=false", "cluster.dashboard=true"]),
                        plain=True)

    metrics = read_records(Path(folder))
    assert [m["step"] for m in seen["events"]] == [r["step"] for r in metrics] == list(range(steps))
    assert [m["reward"] for m in seen["events"]] == [r["reward_mean"] for r in metrics]
    assert [m["samples_per_s"] for m in seen["events"]] == [r["samples_per_s"] for r in metrics]
    assert len({m["run"] for m in seen["events"]}) == 1
    assert seen["page"]["steps"]["step"] == list(range(steps))
    assert seen["page"]["steps"]["reward"] == pytest.approx([r["reward_mean"] for r in metrics])
    assert sorted(k for k in seen["page"]["steps"] if k.startswith("busy_")) == [
        "busy_generate", "busy_reward", "busy_train"]
    assert f"{steps} steps" in seen["page"]["header"]
    # publish returns at once: the send happens on the client's loop, never waited for (measured:
    # ~10 us a step; the bound leaves room for a loaded machine's GIL)
    assert statistics.median(seen["cost"]) < 0.05
    assert not [w for w in recwarn if "streamrl page" in str(w.message)]


@pytest.mark.parametrize("odd", [{"busy": [1]}, {"eval": []}, {"eval": "reward_mean"}, {"steps": "x"},
                                 {"version": "<b>x</b>"}, {"staleness": [1]}, {"steps": True}, {"step": True},
                                 {"busy": {"generate": "x"}}, {"eval": {"pass@1": None}}, {"reward": 10**400},
                                 {"busy": None}, {"eval": None},
                                 # a pool name is a column in a tooltip template: HTML there runs
                                 {"busy": {"a}<img src=x onerror=alert(1)>{b": 0.5}}])
def test_a_message_of_another_shape_is_skipped_and_the_next_step_still_shows(odd, caplog):
    good = dashboard.summarize(record(1), dashboard._Run(id="a", name="<i>run</i>", steps=10))
    bad = {**dashboard.summarize(record(0), dashboard._Run(id="a", steps=10)), **odd}
    scheduler = type("Scheduler", (), {"get_events": lambda self, topic: [(1.0, bad), (2.0, good)]})()
    page = StreamrlPage(scheduler)
    with caplog.at_level("WARNING"):
        page.update()
        page.update()
    assert "update failed" not in caplog.text
    assert 1 in page.steps.data["step"]
    # the odd one was skipped (a reward past a float's range is a number: shown, as NaN; no busy
    # table or evaluation, as absent ones: shown)
    assert (0 in page.steps.data["step"]) == ("reward" in odd or None in odd.values())
    header = page.header.text
    assert "&lt;i&gt;run&lt;/i&gt;" in header and "<i>" not in header and "policy v2" in header


def test_every_field_of_the_header_is_escaped():
    # (valid() lets only ints through for these; the header escapes them all the same)
    msg = {**dashboard.summarize(record(0), dashboard._Run(id="a", name="<script>n</script>", mode="<b>m</b>")),
           "version": "<img src=x>", "staleness": "<u>s</u>", "steps": "<i>10</i>"}
    page = StreamrlPage(type("Scheduler", (), {"get_events": lambda self, topic: []})())
    page.rows, page.last_step = {0: msg}, 0
    header = page._header_html()
    assert not any(tag in header for tag in ("<script>", "<b>m", "<img", "<u>", "<i>"))
    assert "&lt;img src=x&gt;" in header and "&lt;u&gt;s&lt;/u&gt;" in header and "1 step " in header


def test_pools_past_the_pages_limit_are_not_drawn():
    # (the topic is public) a thousand messages of new pool names made a line, a column and a
    # tooltip row each, in every browser session
    from streamrl.telemetry.dashboard_app import MAX_POOLS

    msgs = [{**dashboard.summarize(record(i), dashboard._Run(id="a", steps=10)),
             "busy": {f"pool{i}_{j}": 0.5 for j in range(8)}} for i in range(20)]
    scheduler = type("Scheduler", (), {"get_events": lambda self, topic: list(enumerate(msgs, 1))})()
    page = StreamrlPage(scheduler)
    page.update()
    assert len(page.pools) == MAX_POOLS and len([k for k in page.steps.data if k.startswith("busy_")]) == MAX_POOLS
    assert page.steps.data["step"] == list(range(20))
