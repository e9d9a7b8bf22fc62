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


def load_tokenizer(model_path: str):
    """``AutoTokenizer.from_pretrained(model_path)``; for a tiny model streamrl made (its
    :data:`MADE_HERE` beside it) one that adds BOS, as its model learned -- saved again (a
    trained policy's folder), it says so itself."""
    from transformers import AutoTokenizer

    made_here = (Path(model_path) / MADE_HERE).is_file()
    return AutoTokenizer.from_pretrained(model_path, **({"add_bos_token": True} if made_here else {}))


def encode_text(tokenizer, text: str) -> list[int]:
    """``text`` as its tokenizer encodes it, special tokens where it adds them (a BOS in front,
    for tokenizers that add one)."""
    return tokenizer(text).input_ids
