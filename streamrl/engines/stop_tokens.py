"""The tokens that end a response: the tokenizer's EOS and every id the model's generation
config names as one.

Instruct models often end a turn with a token that is not their tokenizer's EOS: Llama 3's
tokenizer says ``<|end_of_text|>`` while its chat turns end with ``<|eot_id|>``, Qwen2.5's
generation config lists ``<|im_end|>`` and ``<|endoftext|>``. transformers' own ``generate``
stops at any id of ``generation_config.eos_token_id``; an engine that stopped at the tokenizer's
alone would decode past the end of its turn to the token limit.
"""

from __future__ import annotations

from collections.abc import Iterable


def stop_ids(tokenizer, generation_config=None) -> tuple[int, ...]:
    """The ids that end a response, sorted: ``tokenizer.eos_token_id`` and the ids of
    ``generation_config.eos_token_id`` (an int or a list, as transformers writes it). What is no
    token id there (a string, a negative number, a value outside the vocabulary) is left out:
    a model folder's files are the user's, not checked elsewhere. Empty when neither names one
    (such a model decodes to its token limit)."""
    vocab = len(tokenizer) if hasattr(tokenizer, "__len__") else None
    found = set(_ids(getattr(tokenizer, "eos_token_id", None)))
    found |= set(_ids(getattr(generation_config, "eos_token_id", None)))
    return tuple(sorted(i for i in found if vocab is None or i < vocab))


def _ids(value) -> Iterable[int]:
    values = value if isinstance(value, (list, tuple)) else [value]
    # (bool is an int to Python, and no token id)
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def of_engine(engine) -> tuple[int, ...]:
    """An engine's stop ids: its own ``stop_ids`` where it keeps them (the ``hf`` engine, from its
    model's generation config), else its tokenizer's EOS (a plugin's engine)."""
    own = getattr(engine, "stop_ids", None)
    return tuple(own) if own is not None else stop_ids(engine.tokenizer)


def first_stop(tokens: list[int], stops: Iterable[int]) -> int | None:
    """Index of the first token of ``tokens`` that is in ``stops``; None when none is."""
    stops = set(stops)
    return next((k for k, t in enumerate(tokens) if t in stops), None)
