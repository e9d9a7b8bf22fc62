"""A response ends at any token the model's generation config names as an EOS, not only at the
tokenizer's: every ``hf`` engine variant, greedy evaluation and the endpoint's finish reason."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer, GenerationConfig

from streamrl.engines.hf import HFEngine, HFEngineConfig
from streamrl.engines.stop_tokens import first_stop, stop_ids
from streamrl.sample import Prompt

PROMPT = Prompt(uid="p0", text="12+34=")


def test_stop_ids_join_the_tokenizers_eos_and_the_generation_configs(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert stop_ids(tok) == (tok.eos_token_id,)
    assert stop_ids(tok, GenerationConfig(eos_token_id=[5, tok.eos_token_id, 7])) == tuple(sorted({5, 7, tok.eos_token_id}))
    assert stop_ids(tok, GenerationConfig(eos_token_id=6)) == tuple(sorted({6, tok.eos_token_id}))
    # what is no token id in a user's file is left out, not raised on
    garbage = GenerationConfig()
    garbage.eos_token_id = ["x", -3, True, 10 ** 9, 4.0, None, 9]
    assert stop_ids(tok, garbage) == tuple(sorted({9, tok.eos_token_id}))
    assert first_stop([4, 8, 9, 8], {9, 8}) == 1 and first_stop([4], {9}) is None


def greedy_then(tiny_model, tmp_path) -> tuple[str, list[int], int]:
    """A copy of the tiny model whose generation config adds, as an EOS, a token its greedy
    response to :data:`PROMPT` draws (the untrained model repeats one: its first new token):
    the folder, that response, the token's first index."""
    engine = HFEngine(HFEngineConfig(batching="static", max_new_tokens=12, profile=False))
    engine.load(str(tiny_model))
    try:
        (sample,) = engine.generate_greedy([PROMPT])[0]
    finally:
        engine.close()
    tokens = sample.response_ids
    k = next(k for k in range(len(tokens)) if tokens[k] not in tokens[:k] and tokens[k] not in engine.stop_ids)
    assert k + 1 < len(tokens)  # (so a response that goes on past it is seen)
    folder = tmp_path / "two-eos"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "generation_config.json").read_text()) if (folder / "generation_config.json").exists() else {}
    config["eos_token_id"] = [engine.tokenizer.eos_token_id, tokens[k]]
    (folder / "generation_config.json").write_text(json.dumps(config))
    return str(folder), tokens, k


@pytest.mark.parametrize("batching", ["static", "continuous", "slots", "reproducible"])
def test_every_engine_variant_ends_a_response_at_the_generation_configs_eos(tiny_model, tmp_path, batching):
    folder, greedy, k = greedy_then(tiny_model, tmp_path)
    variant = {"reproducible": True, "seed": 1} if batching == "reproducible" else {"batching": batching}
    # (a temperature this low draws the greedy token every time: the response is known)
    engine = HFEngine(HFEngineConfig(max_new_tokens=12, profile=False, temperature=1e-3, **variant))
    engine.load(folder)
    try:
        assert greedy[k] in engine.stop_ids
        (evaluated,) = engine.generate_greedy([PROMPT])[0]
        assert evaluated.response_ids == greedy[:k + 1]
        group = engine.generate(PROMPT, 2)
        assert [s.response_ids for s in group] == [greedy[:k + 1]] * 2
    finally:
        engine.close()


def test_a_served_reply_ending_at_the_generation_configs_eos_finishes_as_a_stop(tiny_model, tmp_path):
    import openai

    from tests.helpers import slot_endpoint

    folder, greedy, k = greedy_then(tiny_model, tmp_path)
    with slot_endpoint(folder) as (api, url):
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        out = client.completions.create(model="policy", prompt=PROMPT.text, max_tokens=4, temperature=0)
    (choice,) = out.choices
    assert choice.finish_reason == "stop"
    assert out.model_extra["streamrl"]["choices"][0]["token_ids"] == greedy[:k + 1]


def test_a_model_that_samples_otherwise_than_the_engine_is_said_once_at_resolve(tiny_model, tmp_path):
    import warnings

    from streamrl.errors import RunWarning
    from streamrl.plugins.resolve import resolve
    from streamrl.recipe.recipe import load_recipe
    from tests.helpers import TINY_RECIPE

    folder = tmp_path / "qwen-like"
    shutil.copytree(tiny_model, folder)
    (tmp_path / "r.toml").write_text(TINY_RECIPE.format(out=tmp_path / "runs", model=folder))

    def said() -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resolve(load_recipe(tmp_path / "r.toml"))
        return [str(w.message) for w in caught if issubclass(w.category, RunWarning) and "samples at" in str(w.message)]
    assert said() == []
    (folder / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "eos_token_id": 2}))
    (line,) = said()
    assert "samples at temperature 0.7, top_p 0.8, top_k 20; the engine samples at engine.temperature = 1" in line
    (folder / "generation_config.json").write_text("[" * 100_000)  # (a damaged file: nothing said, nothing raised)
    assert said() == []


def test_a_replica_and_a_learners_variant_end_responses_as_their_engine_does():
    from types import SimpleNamespace

    from streamrl.serve.adapter_routes import OnAdapter
    from streamrl.serve.remote_engines import RemoteEngine

    # (the local engine's face the endpoint reads: a stand-in for a loaded slot engine)
    local = SimpleNamespace(config=None, tokenizer=None, encode=None, version=3, stop_ids=(2, 7))
    remote = RemoteEngine(local, "http://127.0.0.1:1", "key", "generate-1")
    assert remote.stop_ids == (2, 7) and OnAdapter(remote, "b").stop_ids == (2, 7)
    assert OnAdapter(local, "b").stop_ids == (2, 7)
