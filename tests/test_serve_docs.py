"""docs/serve.md's client examples, run as written against an endpoint with the engine settings
of ``recipes/serve.toml`` (its model and its ``[engine]`` table), on loopback."""

from __future__ import annotations

import contextlib
import io
import json
import re

import httpx

from streamrl.engines.hf_config import HFEngineConfig
from streamrl.engines.slots import SlotEngine
from streamrl.recipe.recipe import load_recipe
from streamrl.recipe.serve import ServeConfig
from streamrl.serve.openai_api import Endpoint
from streamrl.serve.traffic import Traffic
from tests.helpers import ROOT, endpoint_in_process

DOC = (ROOT / "docs" / "serve.md").read_text()


def test_the_docs_client_examples_answer_on_the_shipped_serve_recipe():
    loaded = load_recipe(ROOT / "recipes" / "serve.toml")
    r = loaded.recipe
    engine = SlotEngine(HFEngineConfig.model_validate({**r.engine.options(), "profile": False}))
    engine.load(str(loaded.model_path()))
    name = r.serve.model_name or r.run.name
    api = Endpoint(engine, ServeConfig(port=0), Traffic(60.0), name)
    clients = DOC[DOC.index("## Clients"):]
    python = re.search(r"```python\n(.*?)```", clients, re.S).group(1)
    curl_body = re.search(r"-d '(\{\"model\".*?\})'", clients).group(1)
    try:
        with endpoint_in_process(api) as url:
            # the curl line's body, as sent
            r1 = httpx.post(f"{url}/completions", json=json.loads(curl_body), timeout=60)
            assert r1.status_code == 200, r1.text[:300]
            assert len(r1.json()["choices"]) == json.loads(curl_body)["n"]
            # the feedback line's body, with that completion's id for its placeholder
            feedback = re.search(r"v1/feedback .*?-d '(\{.*?\})'", clients, re.S).group(1)
            r2 = httpx.post(f"{url}/feedback", json={**json.loads(feedback), "id": r1.json()["id"]}, timeout=60)
            assert r2.status_code == 200 and r2.json()["accepted"] is True, r2.text[:300]
            # the Python example, with the endpoint's address
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(python.replace("http://127.0.0.1:8000/v1", url), {})
            assert out.getvalue().count("[") >= 4  # each choice printed with its token ids
    finally:
        engine.close()
