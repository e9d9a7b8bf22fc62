"""LoRA learners served side by side from one engine: a variant ``<model>/<learner>`` is the
served policy's engine with the learner's adapter, its answers are that adapter's policy (the
trainer's log-probs), and in a run every variant is answered on the generate pool."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import openai
import pytest
import torch

from streamrl.engines.adapters import POLICY
from streamrl.engines.base import HFEngineConfig
from streamrl.engines.slots import SlotEngine
from streamrl.recipe.serve import ServeConfig
from streamrl.serve.adapter_routes import OnAdapter
from streamrl.serve.http_server import start_in_thread
from streamrl.serve.openai_api import Endpoint
from streamrl.serve.routes import make_app
from streamrl.serve.traffic import Traffic
from streamrl.training.logprobs import naive_token_logprobs
from tests.helpers import TINY_RECIPE, read_records, served_at, start_serving, stop_serving
from tests.test_lora_engine import lora_trainer


def test_each_variant_answers_with_its_own_adapter_through_the_openai_client(tiny_model):
    from transformers import AutoModelForCausalLM

    served, side = lora_trainer(tiny_model, seed=0), lora_trainer(tiny_model, seed=1, rank=8)
    engine = SlotEngine(HFEngineConfig(batching="slots", slots=8, max_prompt_tokens=16, max_new_tokens=6,
                                       profile=False))
    engine.load(str(tiny_model), device="cpu")
    engine.load_weights(served.named_weights(), 4)
    engine.load_adapter("b", side.named_weights(), 6)
    api = Endpoint(engine, ServeConfig(), Traffic(60.0), "tiny")
    api.engines["tiny/b"] = [OnAdapter(engine, "b")]  # (what endpoint.add_adapter_variant does)
    api.engines["tiny/base"] = [OnAdapter(engine, "no-such-adapter")]  # an adapter not loaded: the base
    server, thread, port = start_in_thread(make_app(api), "127.0.0.1", 0, "test-serve-lora")
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        assert {m.id for m in c.models.list().data} == {"tiny", "tiny/b", "tiny/base"}
        for model, policy, version in [("tiny", served.model, 4), ("tiny/b", side.model, 6), ("tiny/base", base, 0)]:
            out = c.completions.create(model=model, prompt="23+45=", n=3, max_tokens=6)
            extra = out.model_extra["streamrl"]
            assert out.model == model
            for x in extra["choices"]:
                assert set(x["policy_versions"]) == {version}
                ids = torch.tensor([extra["prompt_token_ids"] + x["token_ids"]])
                with torch.no_grad():
                    lp = naive_token_logprobs(policy.eval(), ids, torch.ones_like(ids), 1.0)
                lp = lp[0, len(extra["prompt_token_ids"]) - 1:]
                assert torch.allclose(lp, torch.tensor(x["logprobs"]), atol=1e-4), model
        assert engine.adapters.versions.keys() == {POLICY, "b"}
    finally:
        server.should_exit = True
        thread.join(5)
        engine.close()


def test_a_restarted_replica_replaces_its_old_engine_and_leaves_the_adapter_variants():
    # (what endpoint.add_replica and remove_replica do to the endpoint's engines, on plain objects)
    from types import SimpleNamespace

    from streamrl.serve import endpoint
    from streamrl.serve.remote_engines import RemoteEngine

    local = SimpleNamespace(config=None, tokenizer=None, encode=None, version=3)
    one, two = RemoteEngine(local, "http://a", "k", "generate-1"), RemoteEngine(local, "http://b", "k", "generate-2")
    served = [local, one, two]
    api = SimpleNamespace(model_name="tiny", engines={"tiny": served, "alias": served,
                                                       "tiny/b": [OnAdapter(e, "b") for e in served]})
    assert endpoint._drop_replica(api, "generate-1") is served
    assert served == [local, two] and api.engines["alias"] is served and one.closed and not two.closed
    assert [e.engine for e in api.engines["tiny/b"]] == [local, two]  # no adapter on a restarted engine
    assert endpoint._drop_replica(api, "generate-9") is served and served == [local, two]  # none there: no change


SERVE = """
[serve]
port = {port}
samples_per_step = 8
max_pending = 24

[[learners]]
name = "a"
trainer = {{ lr = 0.05, lora = {{ rank = 4, alpha = 8 }} }}

[[learners]]
name = "b"
trainer = {{ lr = 0.05, lora = {{ rank = 8, alpha = 16 }} }}
when_full = "pace"
"""


@pytest.mark.slow
def test_a_run_serves_its_lora_learners_variants_from_the_generate_pools_engine(tmp_path, tiny_model):
    from tests.test_serve import free_port, post

    recipe = tmp_path / "serve.toml"
    text = TINY_RECIPE.format(out=tmp_path / "runs", model=tiny_model).replace(
        "steps = 2", 'steps = 1000\nstep_timeout_s = 0\nmode = "async"\nmax_staleness = 8')
    text = text.replace('max_new_tokens = 6', 'max_new_tokens = 6\nbatching = "slots"\nslots = 16\nmax_prompt_tokens = 48')
    port = free_port()
    recipe.write_text(text + SERVE.format(port=port))
    log = tmp_path / "serve.log"
    proc = start_serving("serve", recipe, log=log)
    try:
        info, run_dir = served_at(proc, tmp_path / "runs", log)
        url, model = info["url"], info["model"]
        c = openai.OpenAI(base_url=url, api_key="none", max_retries=2)
        assert [m.id for m in c.models.list().data] == [model, f"{model}/a", f"{model}/b"]
        # the served policy's answers are rewarded for short sums, the variant's for long ones: they drift apart
        for k in range(6):
            for m in (model, f"{model}/b"):
                out = c.completions.create(model=m, prompt=f"{30 + k}+{k}=", n=4, max_tokens=6)
                for i, x in enumerate(out.model_extra["streamrl"]["choices"]):
                    reward = float(len(x["token_ids"]) <= 3) if m == model else float(len(x["token_ids"]) > 3)
                    assert post(url, "/feedback", json.dumps({"id": out.id, "index": i, "reward": reward}).encode(),
                                key="")[0] == 200
        deadline = time.time() + 180
        while time.time() < deadline and len(read_records(run_dir, partial=True)) < 4:
            time.sleep(0.5)
        records = read_records(run_dir, partial=True)
        assert len(records) >= 4
        # every sample was decoded on the generate pool, the variant's too: no engine beside the learner
        assert {x["worker"] for r in records for x in r["sample_log"]} == {"generate-0"}
        assert all(r["publish_bytes"] < 200_000 for r in records)  # the adapter, not the model
        # the variant's adapter follows its learner's steps
        deadline = time.time() + 60
        while time.time() < deadline:
            out = c.completions.create(model=f"{model}/b", prompt="7+8=", n=2, max_tokens=6)
            if min(min(x["policy_versions"]) for x in out.model_extra["streamrl"]["choices"]) >= 1:
                break
            time.sleep(1)
        assert min(min(x["policy_versions"]) for x in out.model_extra["streamrl"]["choices"]) >= 1
        log_text = log.read_text()
        assert "Traceback" not in log_text, log_text[-3000:]
    finally:
        stop_serving(proc)


@pytest.mark.slow
def test_bench_serve_reports_each_variants_time_to_first_token(tmp_path, tiny_model):
    recipe = tmp_path / "serve.toml"
    text = TINY_RECIPE.format(out=tmp_path / "runs", model=tiny_model).replace("steps = 2", 'mode = "async"')
    text = text.replace('max_new_tokens = 6', 'max_new_tokens = 6\nbatching = "slots"\nslots = 16')
    recipe.write_text(text + SERVE.format(port=0).replace("samples_per_step = 8", "samples_per_step = 16"))
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "streamrl", "bench", "serve", str(recipe), "--clients", "3",
                           "--seconds", "4", "--repeats", "1", "--n", "2", "--all-models", "--out", str(out)],
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result["models"]) == {"tiny", "tiny/a", "tiny/b"}
    for row in result["rows"]:
        assert row["failed"] == 0 and all(m["requests"] > 0 for m in row["models"].values())
    assert result["models"]["tiny"]["ttft_over_served"] == 1.0
    assert all(m["ttft_p50_ms"] > 0 for m in result["models"].values())
    assert "time to first token p50 by model" in proc.stdout
