"""Plain text is encoded as the model's tokenizer encodes it: a BOS in front only where the
tokenizer adds one (SmolLM2-Instruct's BOS is ``<|im_start|>``, a chat turn's start, which a
prompt must not begin with), and always for the tiny models streamrl makes, which learned so."""

from __future__ import annotations

import shutil

from streamrl.engines.hf import HFEngine, HFEngineConfig
from streamrl.models.tokenizers import MADE_HERE, encode_text, load_tokenizer
from streamrl.sample import Prompt


def copy_of(tiny_model, tmp_path, name: str) -> str:
    """The tiny model as a folder streamrl did not make (no ``streamrl_init.json``): its
    tokenizer adds no BOS of itself, as SmolLM2-Instruct's and Qwen's do not."""
    folder = tmp_path / name
    shutil.copytree(tiny_model, folder)
    (folder / MADE_HERE).unlink()
    return str(folder)


def test_bos_leads_a_plain_prompt_only_where_the_tokenizer_adds_one(tiny_model, tmp_path):
    made = load_tokenizer(str(tiny_model))
    bos, text = made.bos_token_id, "12+34="
    plain = made(text, add_special_tokens=False).input_ids
    assert encode_text(made, text) == [bos] + plain  # streamrl's tiny model: BOS, as it learned
    assert encode_text(load_tokenizer(copy_of(tiny_model, tmp_path, "silent")), text) == plain
    # the engine feeds a text prompt so, and a trained policy's folder keeps its tiny model's BOS
    engine = HFEngine(HFEngineConfig(batching="static", max_new_tokens=2, profile=False))
    engine.load(copy_of(tiny_model, tmp_path, "engine"))
    try:
        assert engine.prompt_ids(Prompt(uid="p", text=text)) == plain
    finally:
        engine.close()
    # (a tokenizer that adds its BOS itself -- Llama's, this saved one -- has it in front)
    made.save_pretrained(tmp_path / "policy")
    assert not (tmp_path / "policy" / MADE_HERE).exists()
    assert encode_text(load_tokenizer(str(tmp_path / "policy")), text) == [bos] + plain
