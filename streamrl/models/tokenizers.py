"""A model folder's tokenizer as streamrl encodes plain text with it.

Plain text (a dataset's prompt without a chat template, ``/v1/completions``) is encoded the way
its tokenizer encodes text on its own: Llama's adds its BOS, Qwen's and SmolLM2-Instruct's add
none -- SmolLM2-Instruct's BOS is ``<|im_start|>``, the start of a chat turn, and a text behind it
reads to the model as a turn whose role is the text's first word. The tiny task models streamrl
makes (``streamrl model init``) learned with BOS in front of every prompt; their tokenizers add it.
"""

from __future__ import annotations

from pathlib import Path

#: What ``streamrl model init`` writes beside a model it made (``run/model_init.py``).
MADE_HERE = "streamrl_init.json"

#: The special tokens of streamrl's character tokenizers (``tasks/tiny.py``): a policy folder a
#: run saved from a tiny model, before its tokenizer said it adds BOS, is known by them.
CHAR_SPECIALS = ("<pad>", "<bos>", "<eos>")


def load_tokenizer(model_path: str):
    """``AutoTokenizer.from_pretrained(model_path)``; for a tiny model streamrl made (its
    :data:`MADE_HERE` beside it, or its character tokenizer's specials: a policy trained from
    one) one that adds BOS, as its model learned -- saved again, it says so itself."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    specials = (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token)
    if (Path(model_path) / MADE_HERE).is_file() or specials == CHAR_SPECIALS:
        tokenizer.add_bos_token = True
    return tokenizer


def encode_text(tokenizer, text: str) -> list[int]:
    """``text`` as its tokenizer encodes it, with the BOS in front where it adds one -- and no
    other special token it adds (an EOS at the end, as ``add_eos_token`` does, would end the
    prompt)."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    bos = tokenizer.bos_token_id
    if bos is None or ids[:1] == [bos]:
        return ids
    return [bos] + ids if adds_bos(tokenizer) else ids


def adds_bos(tokenizer) -> bool:
    """Whether ``tokenizer`` puts its BOS in front of a text (its setting, not the text's: asked
    once, of a probe, and kept on the tokenizer -- a prompt's encoding needs it every time)."""
    known = getattr(tokenizer, "_streamrl_adds_bos", None)
    if known is None or known[0] != getattr(tokenizer, "add_bos_token", None):
        probe, bos = "a", tokenizer.bos_token_id
        adds = tokenizer(probe).input_ids[:1] == [bos] != tokenizer(probe, add_special_tokens=False).input_ids[:1]
        known = (getattr(tokenizer, "add_bos_token", None), adds)
        tokenizer._streamrl_adds_bos = known
    return known[1]
