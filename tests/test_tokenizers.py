"""Plain text is encoded as the model's tokenizer encodes it: a BOS in front only where the
tokenizer adds one (SmolLM2-Instruct's BOS is ``<|im_start|>``, a chat turn's start, which a
prompt must not begin with), and always for the tiny models streamrl makes, which learned so --
also for a policy trained from one by an older streamrl."""

from __future__ import annotations

import json
import shutil

from streamrl.engines.hf import HFEngine, HFEngineConfig
from streamrl.models.tokenizers import MADE_HERE, encode_text, load_tokenizer
from streamrl.sample import Prompt


def copy_of(tiny_model, tmp_path, name: str, bos: str | None = None) -> str:
    """The tiny model as a folder streamrl did not make (no ``streamrl_init.json``); ``bos``:
    its tokenizer's BOS named another token (SmolLM2-Instruct's is a chat turn's start) -- so
    it is no streamrl character tokenizer."""
    folder = tmp_path / name
    shutil.copytree(tiny_model, folder)
    (folder / MADE_HERE).unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if bos is not None:
        config["bos_token"] = bos
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


def test_bos_leads_a_plain_prompt_only_where_the_tokenizer_adds_one(tiny_model, tmp_path):
    made = load_tokenizer(str(tiny_model))
    bos, text = made.bos_token_id, "12+34="
    plain = made(text, add_special_tokens=False).input_ids
    assert encode_text(made, text) == [bos] + plain  # streamrl's tiny model: BOS, as it learned
    # a policy folder an older streamrl saved from it (no marker, its tokenizer as it was): still BOS
    assert encode_text(load_tokenizer(copy_of(tiny_model, tmp_path, "old-policy")), text) == [bos] + plain
    silent = copy_of(tiny_model, tmp_path, "silent", bos="<|user|>")
    assert encode_text(load_tokenizer(silent), text) == plain
    # the engine feeds a text prompt so
    engine = HFEngine(HFEngineConfig(batching="static", max_new_tokens=2, profile=False))
    engine.load(silent)
    try:
        assert engine.prompt_ids(Prompt(uid="p", text=text)) == plain
    finally:
        engine.close()
    # (a tokenizer that adds its BOS itself -- Llama's, this saved one -- has it in front)
    made.save_pretrained(tmp_path / "policy")
    assert encode_text(load_tokenizer(str(tmp_path / "policy")), text) == [bos] + plain


def test_a_tokenizer_that_appends_eos_does_not_end_a_plain_prompt(tiny_model, tmp_path):
    tok = load_tokenizer(str(tiny_model))
    tok.add_eos_token = True  # (as a fine-tuned Llama's or Mistral's tokenizer_config.json may say)
    text = "12+34="
    plain = tok(text, add_special_tokens=False).input_ids
    assert tok(text).input_ids == [tok.bos_token_id] + plain + [tok.eos_token_id]
    assert encode_text(tok, text) == [tok.bos_token_id] + plain
