"""The endpoint while the run is still adding the models it will serve: 503 with
``Retry-After`` (never a 404 for a model about to be served) and ``GET /health`` saying
``starting``, then every route answers; and the example client's users, run against an endpoint
that refuses their first requests, count the failures and go on."""

from __future__ import annotations

import importlib.util
import threading
from types import SimpleNamespace

import httpx
import openai
import pytest

from streamrl.engines.hf_config import HFEngineConfig
from streamrl.engines.slots import SlotEngine
from streamrl.recipe.serve import ServeConfig
from streamrl.serve.openai_api import Endpoint
from streamrl.serve.traffic import Traffic
from tests.helpers import ROOT, endpoint_in_process, until


@pytest.fixture
def starting(tiny_model):
    """An endpoint that has not gone live yet (``api.ready`` False), on a free loopback port."""
    engine = SlotEngine(HFEngineConfig(batching="slots", slots=8, max_prompt_tokens=32, max_new_tokens=4,
                                       temperature=1.0, profile=False))
    engine.load(str(tiny_model))
    api = Endpoint(engine, ServeConfig(port=0), Traffic(60.0), "policy")
    api.ready = False
    try:
        with endpoint_in_process(api) as url:
            yield api, url
    finally:
        engine.close()


def test_a_starting_endpoint_answers_503_with_retry_after_then_serves(starting):
    api, url = starting
    root = url.removesuffix("/v1")
    health = httpx.get(f"{root}/health", timeout=30)
    assert health.status_code == 503 and health.json() == {"status": "starting"}
    for r in (httpx.get(f"{url}/models", timeout=30),
              httpx.post(f"{url}/completions", json={"model": "policy", "prompt": "1+2=", "max_tokens": 2}, timeout=30)):
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["code"] == "starting"
    api.ready = True
    assert httpx.get(f"{root}/health", timeout=30).json() == {"status": "ok"}
    assert [m["id"] for m in httpx.get(f"{url}/models", timeout=30).json()["data"]] == ["policy"]
    # the openai client's own retry of a 503 gets through once the endpoint is live
    api.ready = False
    threading.Timer(0.5, lambda: setattr(api, "ready", True)).start()
    out = openai.OpenAI(base_url=url, api_key="x", max_retries=4).completions.create(
        model="policy", prompt="1+2=", max_tokens=2)
    assert out.choices[0].text is not None


def test_the_example_clients_users_count_failed_requests_and_go_on(starting):
    api, url = starting
    spec = importlib.util.spec_from_file_location("serve_client", ROOT / "examples" / "serve_client.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = SimpleNamespace(n=2, chat=False, max_tokens=4)
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)  # every refusal reaches the user
    tally, stop = [], threading.Event()
    users = [threading.Thread(target=example.user, args=(client, url, "none", "policy", args, tally, stop, k), daemon=True)
             for k in range(2)]
    for u in users:
        u.start()
    until(lambda: sum(right is None for _, right, _ in tally) >= 2, within=30)  # refused while starting
    api.ready = True
    until(lambda: sum(right is not None for _, right, _ in tally) >= 8, within=60)  # then answered
    assert all(u.is_alive() for u in users)
    stop.set()
    for u in users:
        u.join(30)
    assert example.errors.get("InternalServerError", 0) >= 2  # (a 503, as the openai client names it)
    assert not any(u.is_alive() for u in users)
