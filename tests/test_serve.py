"""``streamrl serve``, the way a user runs it: the CLI in its own process, a real cluster, the
real ``openai`` client on loopback; feedback becomes training steps."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path

import openai
import pytest
import torch

from tests.helpers import TINY_RECIPE, read_records, served_at, start_serving, stop_serving

pytestmark = pytest.mark.slow

KEY = "test-key"

SERVE = """
[serve]
port = {port}
api_key = "{key}"
samples_per_step = 8
max_pending = 24

[[learners]]
name = "a"

[[learners]]
name = "b"
trainer = {{ lr = 0.01 }}
when_full = "pace"
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model):
    """A ``streamrl serve`` process on a tiny recipe with two generate workers (the endpoint on
    the first spreads requests over both) and two learners (``a`` served, ``b`` a side learner,
    served beside it as a variant); yields (base url, model, run folder)."""
    tmp = tmp_path_factory.mktemp("serve")
    recipe = tmp / "serve.toml"
    text = TINY_RECIPE.format(out=tmp / "runs", model=tiny_model).replace(
        "steps = 2", 'steps = 1000\nstep_timeout_s = 0\nmode = "async"\nmax_staleness = 8')
    text = text.replace('max_new_tokens = 6', 'max_new_tokens = 6\nbatching = "slots"\nslots = 16\nmax_prompt_tokens = 48')
    text = text.replace("[pools.generate]\nthreads = 4", "[pools.generate]\nworkers = 2\nthreads = 4")
    port = free_port()
    recipe.write_text(text + SERVE.format(key=KEY, port=port))
    log = tmp / "serve.log"
    proc = start_serving("serve", recipe, log=log)
    try:
        # from the moment the port takes connections, ask every model the recipe serves
        deadline = time.time() + 180
        while proc.poll() is None and time.time() < deadline and not accepts(port):
            time.sleep(0.05)
        models = ["tiny", "tiny/a", "tiny/b"]
        while proc.poll() is None and time.time() < deadline:
            got = [post(f"http://127.0.0.1:{port}/v1", "/completions",
                        json.dumps({"model": m, "prompt": "1+1=", "max_tokens": 2}).encode())[0] for m in models]
            EARLY.extend(zip(models, got))
            if all(s == 200 for s in got):
                break
            time.sleep(0.05)
        info, run_dir = served_at(proc, tmp / "runs", log)
        yield info["url"], info["model"], run_dir
    finally:
        stop_serving(proc)


#: (model, HTTP status) of the requests fired at the endpoint from the moment its port took connections.
EARLY: list[tuple[str, int]] = []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


def test_from_its_first_connection_the_endpoint_answers_every_served_model_200_or_503_never_404(served):
    assert EARLY, "no request reached the endpoint before it was up"
    assert {status for _, status in EARLY} <= {200, 503}, EARLY
    assert {m for m, status in EARLY if status == 200} == {"tiny", "tiny/a", "tiny/b"}
    url, _, _ = served
    health = urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=30)
    assert json.loads(health.read()) == {"status": "ok"}


def client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0)


def post(url: str, path: str, body: bytes, key: str = KEY) -> tuple[int, dict]:
    """A raw POST (for bodies the ``openai`` client would not send); status and JSON body."""
    req = urllib.request.Request(url + path, data=body, method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def stats(url: str) -> dict:
    req = urllib.request.Request(url + "/serve/stats", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_completions_and_chat_answer_the_openai_client_with_tokens_and_logprobs(served, tiny_model):
    url, model, _ = served
    c = client(url)
    assert [m.id for m in c.models.list().data] == [model, f"{model}/a", f"{model}/b"]
    out = c.completions.create(model=model, prompt="12+34=", n=3, max_tokens=5)
    assert len(out.choices) == 3 and out.usage.completion_tokens > 0
    extra = out.model_extra["streamrl"]
    assert [x["index"] for x in extra["choices"]] == [0, 1, 2]
    for choice, x in zip(out.choices, extra["choices"]):
        assert 1 <= len(x["token_ids"]) <= 5 and len(x["logprobs"]) == len(x["token_ids"])
        assert choice.finish_reason in ("stop", "length")
    chat = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "1+2="}], logprobs=True)
    tokens = chat.model_extra["streamrl"]["choices"][0]["token_ids"]
    assert chat.choices[0].message.role == "assistant"
    assert len(chat.choices[0].logprobs.content) == len(tokens)
    assert [t.logprob for t in chat.choices[0].logprobs.content] == chat.model_extra["streamrl"]["choices"][0]["logprobs"]


def test_served_token_logprobs_equal_what_the_trainer_computes(served, tiny_model):
    from transformers import AutoModelForCausalLM

    from streamrl.training.logprobs import naive_token_logprobs

    url, model, _ = served
    out = client(url).completions.create(model=model, prompt="23+45=", n=4, max_tokens=6)
    extra = out.model_extra["streamrl"]
    policy = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    for x in extra["choices"]:
        assert set(x["policy_versions"]) == {0}  # nothing has trained yet: the initial weights
        ids = torch.tensor([extra["prompt_token_ids"] + x["token_ids"]])
        lp = naive_token_logprobs(policy, ids, torch.ones_like(ids), 1.0)[0, len(extra["prompt_token_ids"]) - 1:]
        assert torch.allclose(lp, torch.tensor(x["logprobs"]), atol=1e-4)


def test_a_stream_sends_each_decode_steps_tokens_before_the_end(served):
    url, model, _ = served
    chunks = list(client(url).completions.create(model=model, prompt="5+6=", n=2, max_tokens=6, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].model_extra["streamrl"]["prompt_token_ids"]
    per_token = [ch for ch in chunks if ch.model_extra.get("streamrl", {}).get("token_ids")]
    ends = [i for i, ch in enumerate(chunks) for c in ch.choices if c.finish_reason]
    tokens = sum(len(ch.model_extra["streamrl"]["token_ids"]) for ch in per_token)
    assert len(per_token) == tokens  # one event per token of each choice, as each step decodes it
    assert len(ends) == 2 and chunks.index(per_token[0]) < min(ends)
    assert chunks[-1].usage.completion_tokens == tokens and not chunks[-1].choices


def test_bad_requests_get_openai_shaped_4xx(served):
    url, model, _ = served
    c = client(url)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.completions.create(model="nope", prompt="1+1=")
    with pytest.raises(openai.BadRequestError, match="engine.max_new_tokens"):
        c.completions.create(model=model, prompt="1+1=", max_tokens=500)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.completions.create(model=model, prompt="1+1=", temperature=0.3)
    with pytest.raises(openai.BadRequestError, match="engine.max_prompt_tokens"):
        c.completions.create(model=model, prompt="1+1=" * 40)
    with pytest.raises(openai.AuthenticationError):
        client(url, key="wrong").models.list()
    with pytest.raises(openai.BadRequestError, match=r"at most 24 \(serve.max_pending\)"):  # (no wait makes room)
        c.completions.create(model=model, prompt="1+1=", n=25)
    status, body = post(url, "/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = post(url, "/completions", json.dumps({"model": model, "prompt": "1", "n": "many"}).encode())
    assert status == 400 and body["error"]["param"] == "n"
    status, body = post(url, "/feedback", json.dumps({"id": "cmpl-unknown", "reward": 1}).encode())
    assert status == 404 and "cmpl-unknown" in body["error"]["message"]


def test_every_rewarded_completion_is_trained_exactly_once(served):
    url, model, run_dir = served
    c = client(url)
    before = stats(url)
    records_before = len((run_dir / "metrics.jsonl").read_text().splitlines()) if (run_dir / "metrics.jsonl").exists() else 0
    ids = []
    for k in range(6):  # 6 requests x 4 choices = 24 samples = 3 steps of serve.samples_per_step = 8
        out = c.completions.create(model=model, prompt=f"{10 + k}+{20 + k}=", n=4, max_tokens=6)
        ids.append(out.id)
    # rewards that once overflowed a whole step's loss: refused, and the choice still takes a good one
    for hostile in ("1e308", "-1e308", "NaN", "Infinity", '"NaN"', "true"):
        body = f'{{"id": "{ids[0]}", "index": 0, "reward": {hostile}}}'.encode()
        assert post(url, "/feedback", body)[0] == 400, hostile
    for cid in ids:
        for i in range(4):
            assert post(url, "/feedback", json.dumps({"id": cid, "index": i, "reward": float(i % 2)}).encode())[0] == 200
            if cid == ids[0] and i == 0:  # a choice takes one reward: the first stands, a second is refused
                assert post(url, "/feedback", json.dumps({"id": cid, "index": 0, "reward": 1.0}).encode())[0] == 400
    assert post(url, "/feedback", json.dumps({"id": ids[0], "index": 7, "reward": 1}).encode())[0] == 400
    deadline = time.time() + 120
    while time.time() < deadline:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
        if len(lines) >= records_before + 3:
            break
        time.sleep(0.5)
    time.sleep(3)  # a fourth step would have had time to appear
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][records_before:]
    after = stats(url)
    assert after["rewarded"] - before["rewarded"] == 24
    trained = sum(r["samples"] for r in records)
    assert len(records) == 3 and trained == 24, [r["samples"] for r in records]
    assert after["ready"] == 0 and after["stale_dropped"] == before["stale_dropped"]
    versions = [r["policy_version"] for r in records]
    assert versions == list(range(versions[0], versions[0] + 3))  # each step published a new policy
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records)
    assert sum(r["reward_mean"] * r["samples"] for r in records) == 12.0  # (none of the refused values got in)
    # both generate workers answered (the endpoint's own engine, and the other's through its token server)
    assert {x["worker"] for r in records for x in r["sample_log"]} == {"generate-0", "generate-1"}


def test_a_side_learners_policy_answers_its_model_and_every_learner_trains_on_all_traffic(served):
    url, model, run_dir = served
    c = client(url)
    status, body = post(url, "/completions", json.dumps({"model": f"{model}/zz", "prompt": "1+1="}).encode())
    assert status == 404 and f"'{model}/b'" in body["error"]["message"]
    # streamed from the side learner's worker: each decode step's tokens as they come
    chunks = list(c.completions.create(model=f"{model}/b", prompt="5+6=", n=2, max_tokens=6, stream=True))
    per_token = [ch for ch in chunks if ch.model_extra.get("streamrl", {}).get("token_ids")]
    assert per_token and all(ch.model == f"{model}/b" for ch in chunks)
    assert len(per_token) == sum(len(ch.model_extra["streamrl"]["token_ids"]) for ch in per_token)
    before = stats(url)["variants"]
    records_before = len(read_records(run_dir, partial=True))
    asked = {}
    for k in range(4):  # 4 requests x 4 choices to each policy: 32 samples, 4 steps of 8
        for m in (model, f"{model}/b"):
            out = c.completions.create(model=m, prompt=f"{30 + k}+{k}=", n=4, max_tokens=6)
            assert out.model == m and len(out.model_extra["streamrl"]["choices"]) == 4
            asked[out.id] = m
    rewards = {model: 0.0, f"{model}/b": 1.0}  # a reward that tells the variants apart
    for cid, m in asked.items():
        assert post(url, "/feedback", json.dumps({"id": cid, "reward": rewards[m]}).encode())[0] == 200
    after = stats(url)["variants"]
    for m, reward in rewards.items():
        assert after[m]["requests"] - before.get(m, {}).get("requests", 0) == 4
        assert after[m]["rewarded"] - before.get(m, {}).get("rewarded", 0) == 16
        was = before.get(m, {"rewarded": 0, "reward_mean": 0.0})
        earned = after[m]["reward_mean"] * after[m]["rewarded"] - (was["reward_mean"] or 0.0) * was["rewarded"]
        assert earned == pytest.approx(16 * reward, abs=1e-3) and after[m]["ttft_p50_ms"] > 0
    uids = {f"{cid}-{i}" for cid in asked for i in range(4)}
    # every learner trains on every rewarded sample, whichever policy answered it
    deadline, records, b_trained = time.time() + 180, [], {}
    while time.time() < deadline:
        records = read_records(run_dir, partial=True)[records_before:]
        main = {x["uid"]: r["step"] for r in records for x in r["sample_log"]}
        b_trained = {t[0]: t for r in records for t in r.get("learners", {}).get("b", {}).get("trained", [])}
        if uids <= set(main) and {main[u] for u in uids} <= set(b_trained):
            break
        if uids <= set(main):
            # the side learner's steps show in the records of the steps after them: a step more
            for k in range(2):
                extra = c.completions.create(model=model, prompt=f"{k}+1=", n=4, max_tokens=6)
                post(url, "/feedback", json.dumps({"id": extra.id, "reward": 0.5}).encode())
        time.sleep(1.0)
    steps = sorted({main[u] for u in uids})
    assert uids <= set(main), "the served learner did not train on every rewarded sample"
    for r in records:
        if r["step"] in steps:
            made_by = {x["worker"] for x in r["sample_log"] if x["uid"] in uids and asked[x["uid"].rsplit("-", 1)[0]] != model}
            assert made_by <= {"learner-b"}  # the variant's samples say which worker decoded them
            log = sorted(x["uid"] for x in r["sample_log"])
            assert b_trained[r["step"]][1:] == [len(log), zlib.crc32("\n".join(log).encode())]  # the same samples
    # the variant's engine took the side learner's new weights after its steps
    out = c.completions.create(model=f"{model}/b", prompt="7+8=", n=2, max_tokens=6)
    assert min(min(x["policy_versions"]) for x in out.model_extra["streamrl"]["choices"]) >= 1
    record = read_records(run_dir, partial=True)[-1]
    assert record["serve/variants"][f"{model}/b"]["rewarded"] >= 16


def test_a_restarted_generate_worker_catches_up_and_is_served_again(served):
    # (the last test on `served`: it kills one of its workers; a module's tests run in order)
    from distributed import Client

    from streamrl.on_worker.resident import ENGINE
    from streamrl.serve import remote_engines
    from tests.helpers import kill_worker, worker_addresses

    url, model, run_dir = served
    log = run_dir.parent.parent / "serve.log"

    def answered_by_generate_1() -> list[dict]:
        """Send requests (and their feedback) until generate-1 made samples of them that a step
        trained; those samples."""
        asked, failed, made = set(), 0, []
        deadline = time.time() + 180
        while time.time() < deadline and not made:
            status, body = post(url, "/completions", json.dumps({"model": model, "prompt": "2+2=", "n": 4,
                                                                  "max_tokens": 6}).encode())
            if status != 200:  # asked of the dead server (a 500), passed over for a while after
                assert status == 500, body
                failed += 1
                time.sleep(0.5)
                continue
            asked.add(body["id"])
            assert post(url, "/feedback", json.dumps({"id": body["id"], "reward": 0.5}).encode())[0] == 200
            made = [x for r in read_records(run_dir, partial=True) for x in r["sample_log"]
                    if x["worker"] == "generate-1" and x["uid"].rsplit("-", 1)[0] in asked]
        assert made, f"generate-1 answered nothing ({failed} requests failed):\n{log.read_text()[-3000:]}"
        return made

    version = read_records(run_dir, partial=True)[-1]["policy_version"]
    assert version >= 1  # (so a restarted engine at the base weights would show)
    kill_worker(run_dir, "generate-1")
    made = answered_by_generate_1()
    # it caught up before answering: never a token of the base weights, nor older than at the kill
    assert min(x["version"] for x in made) >= version, made
    assert log.read_text().count("generate worker generate-1 is served again") == 1
    assert read_records(run_dir, partial=True)[-1]["serve/replicas_restarted"] == 1
    # its token server gone, at the same address (as a worker restarted on a fixed port): the
    # requests that fail to reach it have it served again
    scheduler = json.loads((run_dir / "status.json").read_text())["scheduler"]
    with Client(scheduler, timeout=10) as c:
        stopped = c.run(remote_engines.stop, ENGINE, workers=[worker_addresses(run_dir)["generate-1"]])
        assert list(stopped.values()) == [True]
    answered_by_generate_1()
    assert log.read_text().count("generate worker generate-1 is served again") == 2
    assert read_records(run_dir, partial=True)[-1]["serve/replicas_restarted"] == 2


def test_a_host_off_loopback_without_a_key_is_refused_in_one_line(tiny_recipe):
    proc = subprocess.run([sys.executable, "-m", "streamrl", "serve", str(tiny_recipe), "--set", 'serve.host="0.0.0.0"'],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "serve.api_key" in lines[0] and "Traceback" not in proc.stderr


def test_bench_serve_measures_latency_with_learning_off_and_on(tmp_path, tiny_model):
    recipe = tmp_path / "serve.toml"
    text = TINY_RECIPE.format(out=tmp_path / "runs", model=tiny_model).replace("steps = 2", 'mode = "async"')
    recipe.write_text(text.replace('max_new_tokens = 6', 'max_new_tokens = 6\nbatching = "slots"\nslots = 16')
                      + "\n[serve]\nsamples_per_step = 16\n")
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "streamrl", "bench", "serve", str(recipe), "--clients", "2",
                           "--seconds", "4", "--repeats", "2", "--n", "4", "--out", str(out)],
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    # the second pass runs "on" first: its "off" phase starts once the feedback it left has trained
    assert [r["learning"] for r in result["rows"]] == ["off", "on", "on", "off"]
    assert all(r["steps_trained"] == 0 for r in result["rows"] if r["learning"] == "off"), result["rows"]
    rows = {r["learning"]: r for r in result["rows"]}
    for r in rows.values():
        assert r["requests"] > 0 and r["failed"] == 0 and r["hung"] == 0 and r["itl_p50_ms"] > 0
        # the serving process's host CPU per streamed token (Linux has per-thread clocks)
        assert r["http_cpu_us"] > 0 and r["loop_cpu_us"] > 0 and r["emit_us"] > 0
    assert result["training_steps"] >= 1  # learning on trained (off sends no feedback: nothing to train)
    assert result["ratios"]["itl_p50_ms"] > 0
    bad = subprocess.run([sys.executable, "-m", "streamrl", "bench", "serve", str(recipe), "--client-processes", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--client-processes" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_a_killed_serving_worker_stops_the_run_in_one_line_naming_what_was_lost(tmp_path, tiny_model):
    from tests.helpers import kill_worker, sets

    recipe = tmp_path / "serve.toml"
    text = TINY_RECIPE.format(out=tmp_path / "runs", model=tiny_model).replace(
        "steps = 2", "steps = 100\nstep_timeout_s = 0")
    text = text.replace("max_new_tokens = 6", 'max_new_tokens = 6\nbatching = "slots"\nslots = 8\nmax_prompt_tokens = 48')
    recipe.write_text(text + '\n[serve]\nport = 0\nsamples_per_step = 8\n')
    proc = subprocess.Popen([sys.executable, "-m", "streamrl", "serve", str(recipe), "--plain", *sets("run.checkpoint_every=1")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 180
        while not list((tmp_path / "runs").glob("*/serve.json")) and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        (info,) = list((tmp_path / "runs").glob("*/serve.json"))
        url = json.loads(info.read_text())["url"]
        out = client(url, "none").completions.create(model="tiny", prompt="1+2=", n=8, max_tokens=4)
        for i in range(8):  # one step's traffic: a checkpoint to name
            assert post(url, "/feedback", json.dumps({"id": out.id, "index": i, "reward": float(i % 2)}).encode(), "none")[0] == 200
        while not (info.parent / "checkpoints").exists() and time.time() < deadline:
            time.sleep(0.2)
        kill_worker(info.parent, "generate-0")
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("streamrl: error: the endpoint's worker generate-0 was restarted"), line
    assert "resume from step-000001" in line


def test_a_stop_keeps_the_rewarded_traffic_no_step_trained_and_the_resumed_run_trains_it_first(tmp_path, tiny_model):
    recipe = tmp_path / "serve.toml"
    text = TINY_RECIPE.format(out=tmp_path / "runs", model=tiny_model).replace(
        # (a bound past the 12 steps of traffic: no kept sample is too stale to train after the resume)
        "steps = 2", 'steps = 1000\nstep_timeout_s = 0\nmode = "async"\nmax_staleness = 16')
    text = text.replace("max_new_tokens = 6", 'max_new_tokens = 6\nbatching = "slots"\nslots = 16\nmax_prompt_tokens = 48')
    recipe.write_text(text + "\n[serve]\nport = 0\nsamples_per_step = 8\n")

    def serve(*argv: str, log: Path) -> tuple[subprocess.Popen, str]:
        proc = start_serving(*argv, log=log)
        return proc, served_at(proc, tmp_path / "runs", log)[0]["url"]

    def stopped(proc: subprocess.Popen, log: Path) -> str:
        stop_serving(proc, timeout=240)
        out = log.read_text()
        assert proc.returncode == 130 and "Traceback" not in out, out[-3000:]
        return out

    first, resumed = tmp_path / "first.log", tmp_path / "resumed.log"
    proc, url = serve("serve", str(recipe), log=first)
    try:
        c = client(url, "none")
        ids = [c.completions.create(model="tiny", prompt=f"{k}+{k}=", n=8, max_tokens=4, extra_body={"session": "s"}).id
               for k in range(12)]
        partly = c.completions.create(model="tiny", prompt="9+9=", n=2, max_tokens=4).id
        assert post(url, "/feedback", json.dumps({"id": partly, "index": 0, "reward": 1}).encode(), "none")[0] == 200
        # the session's 12 requests (96 samples) become ready at once: more than the steps before the stop train
        status, body = post(url, "/feedback", json.dumps({"session": "s", "reward": 1}).encode(), "none")
        assert status == 200 and body["completions"] == 12
    finally:
        err = stopped(proc, first)
    (run_dir,) = list((tmp_path / "runs").iterdir())
    records = read_records(run_dir)
    trained = [x["uid"] for r in records for x in r["sample_log"]]
    checkpoint = max((run_dir / "checkpoints").glob("step-*"))  # (the stop's)
    saved = json.loads((checkpoint / "serve_traffic.json").read_text())
    kept = [s["uid"] for g in saved["groups"] for s in g]
    # every rewarded sample is trained before the stop or kept for the resume; none both, none lost
    assert sorted(trained + kept) == sorted(f"{cid}-{k}" for cid in ids for k in range(8))
    assert kept and saved["next_step"] == len(records)
    assert saved["not_kept"] == {"waiting": 2, "accepted": 1}  # the request rewarded in part
    assert (f"serve: {len(kept)} rewarded samples no step trained are kept in the checkpoint" in err
            and "not kept: 2 samples waiting for a reward, and 1 accepted rewards" in err), err[-2000:]
    assert all(r["samples"] > 0 for r in records)  # no step fed ahead of the stop trained on nothing
    assert records[-1]["policy_version"] == len(records)

    proc, url = serve("recipe", "resume", str(run_dir), log=resumed)
    try:
        assert f"{len(kept)} rewarded samples from the checkpoint are trained first" in resumed.read_text()
        deadline, after = time.time() + 180, []
        while time.time() < deadline:
            after = read_records(run_dir, partial=True)[len(records):]
            if sum(r["samples"] for r in after) >= len(kept):
                break
            time.sleep(0.3)
        time.sleep(2)  # (a step of nothing would have had time to appear: there is no traffic)
    finally:
        stopped(proc, resumed)
    after = read_records(run_dir)[len(records):]
    assert sorted(x["uid"] for r in after for x in r["sample_log"]) == sorted(kept)  # each trained once, first
    assert after[0]["serve/restored"] == len(kept) and after[-1]["serve/stale_dropped"] == 0
    # stopped while its step waited for traffic: that one step trains nothing (the version counts
    # steps, the weights stay), and no step after it is fed ahead to train nothing again
    assert [r["samples"] for r in after][-1] == 0 and all(r["samples"] > 0 for r in after[:-1])
    assert after[-1]["policy_version"] == after[-2]["policy_version"] + 1 == len(records) + len(after)
